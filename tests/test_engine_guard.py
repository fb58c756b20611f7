"""The engine guard (``replicas/engine_guard.py``): no process of an engine outlives it.

The engine here is a stand-in with vLLM's shape: a process that starts a child (its "engine
core") which would live on by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.conftest import ROOT, wait_until

# an "API server" that starts an "engine core" child in its group, prints both pids, waits
ENGINE = textwrap.dedent("""
    import subprocess, sys, time
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(core.pid, flush=True)
    if "--exit" in sys.argv:
        sys.exit(3)
    time.sleep(120)
""")


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _start_guard(*engine_args: str, tmp_root=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "replicas.engine_guard", "--grace-s", "3",
                             *(("--tmp-root", str(tmp_root)) if tmp_root else ()),
                             "--", sys.executable, "-c", ENGINE, *engine_args], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)


def test_an_engine_that_exits_takes_its_engine_core_along():
    guard = _start_guard("--exit")
    guard.stdout.readline()  # the core is up
    assert guard.wait(10) == 3  # the engine's own exit code
    wait_until(lambda: _gone(guard.pid), 10, 0.1, "the engine's process group to be gone")


def test_sigterm_to_the_guard_stops_the_whole_engine():
    guard = _start_guard()
    guard.stdout.readline()
    time.sleep(0.3)
    guard.send_signal(signal.SIGTERM)
    assert guard.wait(10) == 128 + signal.SIGTERM
    wait_until(lambda: _gone(guard.pid), 10, 0.1, "the engine's process group to be gone")


def test_a_replica_killed_with_sigkill_takes_its_engine_along():
    """The replica (here a stand-in parent) dies without a word: the kernel tells the guard
    (PR_SET_PDEATHSIG), which stops its group."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        g = subprocess.Popen([sys.executable, "-m", "replicas.engine_guard", "--grace-s", "3",
                              "--", sys.executable, "-c", {ENGINE!r}],
                             start_new_session=True, stdout=subprocess.DEVNULL)
        print(g.pid, flush=True)
        time.sleep(120)
    """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    guard_pid = int(parent.stdout.readline())
    time.sleep(1.0)  # the engine and its core are up
    assert not _gone(guard_pid)
    parent.kill()
    parent.wait(10)
    wait_until(lambda: _gone(guard_pid), 15, 0.1, "the orphaned engine's group to be gone")


def test_a_guard_killed_with_sigkill_still_stops_its_engine(tmp_path):
    """Ray SIGKILLs the direct children of a worker that exits: the guard. Its engine hears
    of it from the kernel and exits (here the stand-in's SIGTERM ends it and its core goes
    with the group, as vLLM's API server stops its engine core). The engine's temp folder
    stays where the replica asked for it (the Ray session's folder; here the test's)."""
    guard = _start_guard(tmp_root=tmp_path)
    guard.stdout.readline()
    time.sleep(0.3)
    engine = next(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != guard.pid
                  and _ppid(int(p)) == guard.pid)
    guard.kill()
    guard.wait(10)
    wait_until(lambda: not os.path.exists(f"/proc/{engine}") or _ppid(engine) == 0, 10, 0.1,
               "the engine to exit")


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return 0 if fields[0] == "Z" else int(fields[1])


def test_the_engines_temp_files_go_with_it(tmp_path):
    """Found by a new user's trial: each stop left vLLM's ``vllm_dist_*`` files and ZeroMQ
    IPC sockets in /tmp (they go to the temp folder and nothing deletes them). The engine
    gets a temp folder of its own, deleted once it is gone, whether it exits or is
    stopped."""
    leaver = textwrap.dedent("""
        import os, socket, sys, tempfile, time
        fd, path = tempfile.mkstemp(prefix="vllm_dist_")
        s = socket.socket(socket.AF_UNIX)
        s.bind(os.path.join(tempfile.gettempdir(), "3f1c2d9e-ipc"))
        print(tempfile.gettempdir(), flush=True)
        if "--exit" in sys.argv:
            sys.exit(0)
        time.sleep(120)
    """)
    for args, stop, root in ((["--exit"], False, None), ([], True, None),
                             ([], True, tmp_path)):
        guard = subprocess.Popen([sys.executable, "-m", "replicas.engine_guard", "--grace-s",
                                  "3", *(("--tmp-root", str(root)) if root else ()), "--",
                                  sys.executable, "-c", leaver, *args], cwd=ROOT,
                                 stdout=subprocess.PIPE, text=True, start_new_session=True)
        tmp = guard.stdout.readline().strip()
        assert os.path.basename(tmp).startswith("e-" if root else "prefix-router-engine-")
        assert root is None or os.path.dirname(tmp) == str(root)
        assert len(os.listdir(tmp)) == 2
        if stop:
            guard.send_signal(signal.SIGTERM)
        guard.wait(15)
        assert not os.path.exists(tmp)


# an "engine core" that maps a shared-memory segment and keeps it from Python's resource
# tracker, as vLLM's processes do (its broadcast queues, its multimodal cache)
SHM_CORE = textwrap.dedent("""
    from multiprocessing import resource_tracker, shared_memory
    import time
    m = shared_memory.SharedMemory(create=True, size=1 << 20)
    resource_tracker.unregister(m._name, "shared_memory")
    print(m.name, flush=True)
    time.sleep(120)
""")
# an "API server" that starts that core in its group and prints the segment's name
SHM_ENGINE = textwrap.dedent("""
    import subprocess, sys, time
    core = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE,
                            text=True)
    print(core.stdout.readline().strip(), flush=True)
    time.sleep(120)
""")


def test_the_engines_shared_memory_goes_with_it():
    """Found by an operator's trial: 400 MiB of vLLM's ``/dev/shm/psm_*`` files stayed
    after a full stop (a process stopped by SIGKILL never unlinks what it made). What the
    engine's processes map is deleted once they are gone, however the engine stopped; a
    segment of another process's stays."""
    from multiprocessing import shared_memory
    other = shared_memory.SharedMemory(create=True, size=4096)  # not the engine's
    try:
        for stop in ("engine killed", "guard stopped"):
            guard = subprocess.Popen([sys.executable, "-m", "replicas.engine_guard",
                                      "--grace-s", "3", "--", sys.executable, "-c",
                                      SHM_ENGINE, SHM_CORE], cwd=ROOT, stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)
            path = "/dev/shm/" + guard.stdout.readline().strip().lstrip("/")
            assert os.path.exists(path), path
            if stop == "engine killed":  # the API server, the guard's child, by SIGKILL
                api = int(subprocess.check_output(["pgrep", "-P", str(guard.pid)]).split()[0])
                os.kill(api, signal.SIGKILL)
            else:
                time.sleep(1.5)  # a scan while it runs
                guard.send_signal(signal.SIGTERM)
            guard.wait(15)
            wait_until(lambda: _gone(guard.pid), 10, 0.1, "the engine's group to be gone")
            assert not os.path.exists(path), stop
        assert os.path.exists("/dev/shm/" + other.name.lstrip("/"))
    finally:
        other.close()
        other.unlink()


# an engine whose "engine core" fails: its root cause first, then the API server's long
# traceback that fills the log's tail (vLLM's order)
FAILING_ENGINE = textwrap.dedent("""
    import sys, traceback
    print("(EngineCore pid=1) ERROR 12-06 12:00:00 core.py:1 EngineCore failed to start.")
    try:
        raise OSError("Address already in use (addr='tcp://*:5557')")
    except OSError:
        traceback.print_exc()
    for i in range(200):
        print("  File \\"api_server.py\\", line", i, ", in run_server")
    print("RuntimeError: Engine core initialization failed. See root cause above.")
    sys.exit(1)
""")


async def test_an_engines_start_failure_names_its_root_cause(tmp_path):
    """``EngineStartError`` carries the error lines of this start (not an earlier one's),
    though the log's tail holds only the API server's traceback."""
    import pytest

    from replicas.engine import EnginePorts, EngineProcess, EngineStartError
    from router.config import Settings

    class Failing(EngineProcess):
        def command(self) -> list[str]:
            return [sys.executable, "-c", FAILING_ENGINE]

    proc = Failing(Settings(engine="sim"), EnginePorts.allocate("failing"), topic="t",
                   device="cpu", log_dir=str(tmp_path))
    proc.log_path.write_text('Traceback (most recent call last):\n  File "x.py", line 1\n'
                             "ValueError: an earlier start's failure\n")
    with pytest.raises(EngineStartError) as e:
        await proc.start()
    message = str(e.value)
    assert "Address already in use (addr='tcp://*:5557')" not in proc.log_tail()
    assert "OSError: Address already in use (addr='tcp://*:5557')" in message
    assert "EngineCore failed to start." in message
    assert message.index("EngineCore failed") < message.index("--- log tail:")
    assert "an earlier start's failure" not in message


def test_the_replica_deletes_the_shared_memory_of_an_engine_whose_guard_was_killed(tmp_path):
    """Two ``/dev/shm/psm_*`` segments stayed after a run of the test suite: where the
    guard is killed with SIGKILL (a Ray worker's exit does so), its clean-up never runs,
    and the replica kills what remains of the group (``EngineProcess.reap``). It deletes
    the segments those processes map."""
    import types

    from replicas.engine import EngineProcess
    guard = subprocess.Popen([sys.executable, "-m", "replicas.engine_guard", "--grace-s", "3",
                              "--", sys.executable, "-c", SHM_ENGINE, SHM_CORE], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    path = "/dev/shm/" + guard.stdout.readline().strip().lstrip("/")
    guard.kill()  # the guard's API server dies with it; its "engine core" stays, mapping
    guard.wait(10)
    assert os.path.exists(path) and not _gone(guard.pid)
    engine = EngineProcess.__new__(EngineProcess)  # reap reads its process's pid and code
    engine.proc = types.SimpleNamespace(pid=guard.pid, returncode=-signal.SIGKILL)
    engine.log_path = tmp_path / "engine-1.log"  # no record beside it: maps alone
    engine.reap()
    assert not os.path.exists(path)
    wait_until(lambda: _gone(guard.pid), 10, 0.1, "the engine's group to be gone")


# an "engine core" that makes a segment, then, at SIGTERM, unmaps it and lingers without
# unlinking it (vLLM's core stopping when the replica's SIGKILL comes half way)
SHM_CORE_UNMAPS = textwrap.dedent("""
    from multiprocessing import resource_tracker, shared_memory
    import signal, time
    m = shared_memory.SharedMemory(create=True, size=1 << 20)
    resource_tracker.unregister(m._name, "shared_memory")
    def stopping(*_):
        m.close()
        print("unmapped", flush=True)
    signal.signal(signal.SIGTERM, stopping)
    print(m.name, flush=True)
    time.sleep(120)
""")


def test_the_replica_deletes_what_the_guard_recorded_once_the_core_has_unmapped_it(tmp_path):
    """The segments a suite run still left (two, 400 MiB) were made by an engine core that
    was stopping when the replica killed its group: its guard had been SIGKILLed, its API
    server was shutting it down, it had unmapped them and not yet unlinked them, so the
    replica found no mapping of them. The guard records what it finds (``--shm-record``)
    and the replica deletes those names too."""
    import types

    from replicas.engine import EngineProcess
    engine = EngineProcess.__new__(EngineProcess)
    engine.log_path = tmp_path / "engine-1.log"
    guard = subprocess.Popen([sys.executable, "-m", "replicas.engine_guard", "--grace-s", "3",
                              "--shm-record", str(engine.shm_record_path), "--",
                              sys.executable, "-c", SHM_ENGINE, SHM_CORE_UNMAPS], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    path = "/dev/shm/" + guard.stdout.readline().strip().lstrip("/")
    wait_until(lambda: engine.shm_record_path.exists(), 10, 0.1, "the guard's record")
    assert engine.shm_record_path.read_text() == path + "\n"
    guard.kill()
    guard.wait(10)
    core = [int(p) for p in subprocess.check_output(["pgrep", "-g", str(guard.pid)]).split()]
    for pid in core:
        os.kill(pid, signal.SIGTERM)  # the core unmaps its segment and lingers
    time.sleep(0.5)
    from replicas.engine_guard import group_shared_memory
    assert os.path.exists(path) and group_shared_memory(guard.pid) == set()
    engine.proc = types.SimpleNamespace(pid=guard.pid, returncode=-signal.SIGKILL)
    engine.reap()
    assert not os.path.exists(path) and not engine.shm_record_path.exists()
    wait_until(lambda: _gone(guard.pid), 10, 0.1, "the engine's group to be gone")


def test_a_guard_that_stops_deletes_its_record(tmp_path):
    """The record lives while the engine does: a guard that cleaned up after itself leaves
    none behind."""
    record = tmp_path / "engine.shm"
    guard = subprocess.Popen([sys.executable, "-m", "replicas.engine_guard", "--grace-s", "3",
                              "--shm-record", str(record), "--", sys.executable, "-c",
                              SHM_ENGINE, SHM_CORE], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    path = "/dev/shm/" + guard.stdout.readline().strip().lstrip("/")
    wait_until(record.exists, 10, 0.1, "the guard's record")
    guard.send_signal(signal.SIGTERM)
    guard.wait(15)
    assert not os.path.exists(path) and not record.exists()
