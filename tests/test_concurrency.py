"""docs/fault-cases.md 11.1: the in-process index and load tracker under concurrent threads and
tasks.

The router loop, the event consumers and the ingress loop touch the same objects from
different threads; nothing may raise ("dictionary changed size during iteration") and the
predicted-entry bound must hold.
"""

from __future__ import annotations

import random
import threading

from router.index.memory import MemoryPrefixIndex
from router.kv_events.wire import KVEvent
from router.load.memory import MemoryLoadTracker


def test_index_survives_concurrent_lookups_event_bursts_and_expiry():
    index = MemoryPrefixIndex(max_predicted_entries=5000)
    errors: list[BaseException] = []
    stop = threading.Event()
    prefixes = [[p * 10_000 + i for i in range(64)] for p in range(20)]

    def guard(fn):
        def run():
            try:
                while not stop.is_set():
                    fn()
            except BaseException as exc:  # noqa: BLE001 - the test collects every failure
                errors.append(exc)
        return run

    rng = random.Random(0)

    def lookups():
        p = rng.choice(prefixes)
        index.lookup_now(p + [rng.getrandbits(40)], ["a", "b", "c", "d"])

    def predictions():
        index.record_predicted_now(rng.choice("abcd"), rng.choice(prefixes)[:rng.randrange(64)]
                                   + [rng.getrandbits(40) for _ in range(8)], ttl_s=0.05)

    def events():
        rep = rng.choice("abcd")
        hs = rng.choice(prefixes)[:rng.randrange(1, 64)]
        index.apply_events_now(rep, [KVEvent("stored", hs, None),
                                     KVEvent("removed", hs[len(hs) // 2:])])
        if rng.random() < 0.01:
            index.apply_events_now(rep, [KVEvent("cleared")])

    def stats():
        import asyncio
        asyncio.run(index.stats())
        index.exact_entries(rng.choice("abcd"))

    threads = [threading.Thread(target=guard(f)) for f in
               (lookups, lookups, predictions, predictions, events, events, stats)]
    for t in threads:
        t.start()
    stop.wait(3.0)
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors, errors[:3]
    assert index._n_predicted <= 5000


def test_load_tracker_counts_stay_exact_under_concurrent_reserve_and_release():
    load = MemoryLoadTracker()
    n_threads, per_thread = 8, 2000

    def worker(k: int):
        for i in range(per_thread):
            rid = f"{k}-{i}"
            load.reserve_now(rid, f"r{i % 4}", 100)
            if i % 3 == 0:
                load.prefill_done_now(rid)
            load.release_now(rid)
            load.release_now(rid)  # a second release of the same request is a no-op

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loads = load.loads_now(["r0", "r1", "r2", "r3"])
    assert all(v.inflight == 0 and v.prefill_tokens == 0 for v in loads.values()), loads
