"""Admission (router/serve/admission.py): a bounded queue by priority, then a fast 429."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.load.memory import MemoryLoadTracker
from router.serve.admission import Admission, parse_priority
from router.serve.auth import Tenant
from router.serve.errors import OpenAIError
from router.serve.ingress import resolve_priority

REPLICAS = ["a", "b"]


async def _full(load, per_replica=2):
    for r in REPLICAS:
        for i in range(per_replica):
            await load.reserve(f"{r}{i}", r, 10)


async def _free_one(load, adm, request_id):
    await load.release(request_id)
    adm.released()


async def test_no_bound_admits_everything_at_once():
    load = MemoryLoadTracker()
    await _full(load, 50)
    adm = Admission(load, None)
    assert await adm.admit("x", lambda: REPLICAS) == 0.0 and adm.waiting == 0


async def test_a_request_waits_for_a_free_slot_then_goes():
    load = MemoryLoadTracker()
    await _full(load)
    adm = Admission(load, 2, timeout_s=5.0)
    task = asyncio.create_task(adm.admit("x", lambda: REPLICAS))
    await asyncio.sleep(0.05)
    assert not task.done() and adm.waiting == 1
    await _free_one(load, adm, "a0")
    waited = await asyncio.wait_for(task, 1.0)
    assert 0.04 < waited < 1.0 and adm.waiting == 0


async def test_every_replica_full_past_the_timeout_is_a_fast_429_with_retry_after():
    load = MemoryLoadTracker()
    await _full(load)
    adm = Admission(load, 2, timeout_s=0.2, retry_after_s=3)
    t0 = time.monotonic()
    with pytest.raises(OpenAIError) as err:
        await adm.admit("x", lambda: REPLICAS)
    assert time.monotonic() - t0 >= 0.2
    assert err.value.status == 429 and err.value.headers["retry-after"] == "3"
    assert err.value.body()["error"]["type"] == "RateLimitError"
    assert adm.waiting == 0
    await _free_one(load, adm, "a0")  # the refused request took no slot
    assert await adm.admit("y", lambda: REPLICAS) == 0.0


async def test_the_queue_is_served_by_priority_then_arrival():
    load = MemoryLoadTracker()
    await _full(load)
    adm = Admission(load, 2, timeout_s=5.0)
    order = []

    async def one(name, prio):
        await adm.admit(name, lambda: REPLICAS, prio)
        order.append(name)
        await load.reserve(name, "a", 1)  # admitted: now in flight
        adm.reserved(name)

    tasks = []
    for name, prio in (("late-5", 5), ("urgent-0", 0), ("mid-3", 3), ("mid-3b", 3)):
        tasks.append(asyncio.create_task(one(name, prio)))
        await asyncio.sleep(0.02)
    for rid in ("a0", "a1", "b0", "b1"):
        await _free_one(load, adm, rid)
        await asyncio.sleep(0.05)
    await asyncio.wait_for(asyncio.gather(*tasks), 2.0)
    assert order == ["urgent-0", "mid-3", "mid-3b", "late-5"]


async def test_admitted_but_not_yet_reserved_requests_hold_their_slot():
    """Two requests at once for the one free slot: the second waits until the first has
    reserved and finished, instead of both going (no overshoot within a process)."""
    load = MemoryLoadTracker()
    adm = Admission(load, 1, timeout_s=5.0)
    first = await adm.admit("first", lambda: ["a"])
    second = asyncio.create_task(adm.admit("second", lambda: ["a"]))
    await asyncio.sleep(0.05)
    assert first == 0.0 and not second.done()
    await load.reserve("first", "a", 1)
    adm.reserved("first")
    adm.reserved("first")  # idempotent
    await asyncio.sleep(0.05)
    assert not second.done()  # the slot is taken by the reservation now
    await _free_one(load, adm, "first")
    await asyncio.wait_for(second, 1.0)


async def test_concurrent_looks_do_not_take_one_slot_twice():
    """Many requests at once for 3 free slots, each look awaiting the load as a Redis read
    does: exactly 3 go."""
    class SlowLoads(MemoryLoadTracker):
        async def loads(self, replicas):
            await asyncio.sleep(0.005)
            return await super().loads(replicas)

    load = SlowLoads()
    adm = Admission(load, 3, timeout_s=0.2)
    results = await asyncio.gather(*(adm.admit(f"r{i}", lambda: ["a"]) for i in range(10)),
                                   return_exceptions=True)
    assert sum(1 for r in results if r == 0.0) == 3
    assert all(isinstance(r, OpenAIError) and r.status == 429 for r in results if r != 0.0)


async def test_a_request_that_reserves_during_a_look_still_counts_in_it():
    """Two looks overlap: the later one (``first``'s) is answered sooner, ``first`` is
    admitted, reserves and stops being pending, all while the earlier look's answer, read
    before that reservation, travels. That look must count ``first`` anyway (its read
    missed it and it is pending no more), or the one slot goes twice. CI saw 5 requests
    admitted on a bound of 4 this way."""
    delays = iter([0.1, 0.01])

    class SnapshotThenSlow(MemoryLoadTracker):
        async def loads(self, replicas):
            snapshot = await super().loads(replicas)  # read now, answered after a delay
            await asyncio.sleep(next(delays, 0.0))
            return snapshot

    load = SnapshotThenSlow()
    adm = Admission(load, 1, timeout_s=0.3)
    second = asyncio.create_task(adm.admit("second", lambda: ["a"]))  # its read: 0.1 s
    await asyncio.sleep(0.001)
    assert await adm.admit("first", lambda: ["a"]) == 0.0  # its read: 0.01 s
    await load.reserve("first", "a", 1)
    adm.reserved("first")
    with pytest.raises(OpenAIError):
        await second  # the one slot is first's: second never gets it
    assert (await load.loads(["a"]))["a"].inflight == 1


async def test_a_request_counted_twice_by_a_look_does_not_hide_the_last_free_slot():
    """The converse: ``first`` reserves while ``second``'s read travels, and the read (taken
    after the reservation landed) counts it, as does the look (it reserved during the read).
    One slot of two is free: ``second`` gets it at once, not from the queue later (nor a
    429 under overload: CI saw 3 requests served on a fleet bound of 4 this way)."""
    delays = iter([0.05])

    class SlowThenSnapshot(MemoryLoadTracker):
        async def loads(self, replicas):
            await asyncio.sleep(next(delays, 0.0))  # the read reaches Redis late
            return await super().loads(replicas)

    load = SlowThenSnapshot()
    adm = Admission(load, 2, timeout_s=0.3)
    second = asyncio.create_task(adm.admit("second", lambda: ["a"]))
    await asyncio.sleep(0.001)
    assert await adm.admit("first", lambda: ["a"]) == 0.0
    await load.reserve("first", "a", 1)
    adm.reserved("first")
    assert await second == 0.0 and adm.waiting == 0


async def test_a_client_that_leaves_while_waiting_leaves_no_trace():
    load = MemoryLoadTracker()
    await _full(load)
    adm = Admission(load, 2, timeout_s=5.0)
    task = asyncio.create_task(adm.admit("x", lambda: REPLICAS))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert adm.waiting == 0
    await _free_one(load, adm, "a0")
    assert await adm.admit("y", lambda: REPLICAS) == 0.0


def test_priorities_are_integers_and_a_tenant_cannot_jump_its_tier():
    assert parse_priority(None) == 0 and parse_priority(" -3 ") == -3
    for bad in ("high", "1.5", "9" * 12, "nan"):
        with pytest.raises(OpenAIError) as err:
            parse_priority(bad)
        assert err.value.status == 400 and err.value.param == "x-priority"
        # an integer out of range is told the range (found by a new-user review)
        assert ("from -2147483647 to 2147483647" in err.value.body()["error"]["message"])
    assert parse_priority(str(2 ** 31 - 1)) == 2 ** 31 - 1
    with pytest.raises(OpenAIError) as err:  # the operator's own header is the one named
        resolve_priority("high", None, "x-tier")
    assert err.value.param == "x-tier"
    assert resolve_priority(None, None) == 0 and resolve_priority("7", None) == 7
    gold, free = Tenant("gold", priority=0), Tenant("free", priority=10)
    assert resolve_priority(None, free) == 10 and resolve_priority("0", free) == 10
    assert resolve_priority("20", free) == 20 and resolve_priority("-5", gold) == 0


async def test_before_the_replica_set_is_known_nothing_waits():
    load = MemoryLoadTracker()
    adm = Admission(load, 1, timeout_s=0.1)
    assert await adm.admit("x", list) == 0.0


async def test_sustained_overload_is_refused_on_arrival_not_after_the_timeout():
    """Once the queue has drained at a measured rate, a request that would wait longer than
    the timeout behind those ahead of it is refused at once; a more urgent one, with
    nobody ahead of it, still waits for its slot."""
    load = MemoryLoadTracker()
    await _full(load)
    adm = Admission(load, 2, timeout_s=1.0)
    for i in range(20):  # slots handed out at about 10 per second (more than arrive now)
        adm._grants.append(time.monotonic() - 2.0 + 0.1 * i)
    assert 5 < adm.drain_rate() < 20
    waiting = [asyncio.create_task(adm.admit(f"w{i}", lambda: REPLICAS, 5)) for i in range(12)]
    await asyncio.sleep(0.01)
    t0 = time.monotonic()
    with pytest.raises(OpenAIError) as err:
        await adm.admit("late", lambda: REPLICAS, 5)
    assert err.value.status == 429 and time.monotonic() - t0 < 0.1
    urgent = asyncio.create_task(adm.admit("urgent", lambda: REPLICAS, 0))
    await asyncio.sleep(0.05)
    assert not urgent.done()  # queued, at the head
    await _free_one(load, adm, "a0")
    await asyncio.wait_for(urgent, 1.0)
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_arrivals_well_past_the_grants_refuse_a_blocked_request_at_once():
    """Offered load past OVERLOAD_RATIO x the slots handed out over the window is sustained
    overload even when the queue empties between arrivals: a request that finds no slot
    is refused at once; with arrivals about equal to the grants it waits the long timeout (a
    burst under capacity)."""
    load = MemoryLoadTracker()
    await _full(load)
    now = time.monotonic()
    for arrivals, short in ((20, False), (40, True)):
        adm = Admission(load, 2, timeout_s=0.3, overloaded_timeout_s=0.02)
        for i in range(20):  # 20 slots handed out over the last 2 s
            adm._grants.append(now - 2.0 + 0.1 * i)
        for i in range(arrivals - 1):  # the one below makes `arrivals`
            adm._arrivals.append(now - 2.0 + 2.0 * i / arrivals)
        assert adm.sustained_overload() is short  # 19 or 39 arrivals against 20 grants
        t0 = time.monotonic()
        with pytest.raises(OpenAIError) as err:
            await adm.admit("blocked", lambda: REPLICAS)
        waited = time.monotonic() - t0
        assert err.value.status == 429 and err.value.headers["retry-after"] == "1"
        assert ("arrive much faster" in err.value.message) is short, err.value.message
        assert (waited < 0.1) if short else (waited >= 0.25), (arrivals, waited)


async def test_a_standing_queue_refuses_newcomers_after_the_short_timeout():
    """A queue that has not been empty for queue_timeout_s is sustained overload: who joins
    it gets its 429 after overloaded_timeout_s, not after queue_timeout_s (the
    controlled-delay rule); once the queue has drained, a burst may wait the long timeout
    again."""
    load = MemoryLoadTracker()
    await _full(load)
    adm = Admission(load, 2, timeout_s=0.3, overloaded_timeout_s=0.02)
    t_start = time.monotonic()
    w0 = asyncio.create_task(adm.admit("w0", lambda: REPLICAS))  # waits 0 .. 0.3 s
    await asyncio.sleep(0.2)
    w1 = asyncio.create_task(adm.admit("w1", lambda: REPLICAS))  # a burst: 0.2 .. 0.5 s
    await asyncio.sleep(0.15)  # 0.35 s: the queue has not been empty since 0
    t0 = time.monotonic()
    with pytest.raises(OpenAIError) as err:
        await adm.admit("late", lambda: REPLICAS)
    assert time.monotonic() - t0 < 0.1 and err.value.status == 429
    for task in (w0, w1):
        with pytest.raises(OpenAIError):
            await task
    assert time.monotonic() - t_start >= 0.45 and adm.waiting == 0
    t0 = time.monotonic()
    with pytest.raises(OpenAIError):  # drained: a new burst waits the long timeout
        await adm.admit("again", lambda: REPLICAS)
    assert time.monotonic() - t0 >= 0.25


def test_an_error_answer_carries_the_routers_own_time():
    """A 429's Server-Timing entry: what the overload benchmark splits a slow refusal by."""
    from router.serve.admission import overloaded
    err = overloaded(None, 2)
    headers = err.response_headers(0.0123)
    assert headers["retry-after"] == "2" and headers["server-timing"] == "router;dur=12.300"
    assert "server-timing" not in err.response_headers()


async def test_under_sustained_overload_a_blocked_request_is_refused_before_its_render(
        model_dir, monkeypatch):
    """The ingress asks admission before it renders, tokenizes and hashes a body: under
    sustained overload with every slot taken, the 429 comes without that work (so it waits
    behind no render); with a free slot, or without the overload, the request goes on."""
    from router.config import Settings
    from router.prompt.render import COMPLETIONS_PATH
    from router.routing.replica import ReplicaInfo
    from router.serve import state
    from router.serve.ingress import IngressCore

    state.put("replica_infos", tuple(
        ReplicaInfo(r, {"engine_url": f"http://{r}"}, {"engine_alive": True})
        for r in REPLICAS))
    try:
        core = IngressCore(Settings(model=str(model_dir), index_namespace="early-refusal",
                                    max_inflight_per_replica=2), engine_handle=None)
        prepared = []

        async def prepare(*args, **kwargs):
            prepared.append(args)
            raise OpenAIError(418, "prepared", "Teapot")  # stop here: no engine exists

        monkeypatch.setattr(core, "prepare", prepare)
        await _full(core.load)
        now = time.monotonic()
        for i in range(20):
            core.admission._grants.append(now - 2.0 + 0.1 * i)
        for i in range(20):  # about as many arrivals as grants: no overload yet
            core.admission._arrivals.append(now - 2.0 + 0.1 * i)
        body = b'{"model": "tiny-qwen2", "prompt": "hi", "max_tokens": 1}'
        with pytest.raises(OpenAIError) as err:
            await core.handle(COMPLETIONS_PATH, body, 0.0)
        assert err.value.status == 418 and len(prepared) == 1
        for i in range(40):  # now 60 arrivals against 20 grants
            core.admission._arrivals.append(now - 1.0 + 0.02 * i)
        with pytest.raises(OpenAIError) as err:
            await core.handle(COMPLETIONS_PATH, body, 0.0)
        assert err.value.status == 429 and "arrive much faster" in err.value.message
        assert len(prepared) == 1  # not rendered
        await core.load.release("a0")  # a free slot: it goes on to its render
        with pytest.raises(OpenAIError) as err:
            await core.handle(COMPLETIONS_PATH, body, 0.0)
        assert err.value.status == 418 and len(prepared) == 2
    finally:
        state.put("replica_infos", None)


def test_the_slot_probability_is_the_exact_poisson_binomial_tail():
    """slot_probability against a brute-force sum over every outcome of each slot, with
    hold times that vary (so each slot of this process has its own probability) and slots
    of other processes at the stationary one."""
    import itertools
    import random

    rnd = random.Random(7)
    adm = Admission(MemoryLoadTracker(), 4, timeout_s=0.5)
    assert adm.slot_probability(1, 0.5) is None  # no hold times yet: the drain rate decides
    adm._held.extend(rnd.uniform(0.5, 3.0) for _ in range(40))
    now = time.monotonic()
    for i in range(6):
        adm._holds[f"r{i}"] = now - rnd.uniform(0.0, 2.9)
    adm._inflight_seen = 9  # 3 slots held elsewhere
    held = sorted(adm._held)

    def survival(x):
        return sum(d > x for d in held) / len(held)
    stationary = sum(min(d, 0.5) for d in held) / sum(held)
    probs = [(survival(now - t) - survival(now - t + 0.5)) / survival(now - t)
             for t in adm._holds.values()] + [stationary] * 3
    for needed in (1, 2, 4):
        brute = 0.0
        for outcome in itertools.product((0, 1), repeat=len(probs)):
            if sum(outcome) >= needed:
                w = 1.0
                for o, p in zip(outcome, probs):
                    w *= p if o else 1 - p
                brute += w
        got = adm.slot_probability(needed, 0.5, now)
        assert abs(got - brute) < 1e-9, (needed, got, brute)
    assert adm.slot_probability(0, 0.5, now) == 1.0


async def test_a_request_waits_only_when_a_slot_is_likely_to_free_within_its_timeout():
    """Every answer holding its slot about 4 s (the hold times seen): a request that finds
    no slot while the oldest one in flight is 3.9 s old waits and gets the slot it frees;
    when every request in flight began just now, none frees within the 0.25 s timeout,
    and the request is refused at once instead of after waiting the whole timeout."""
    load = MemoryLoadTracker()
    adm = Admission(load, 2, timeout_s=0.25)
    adm._held.extend([4.0] * 20)
    now = time.monotonic()
    for i, r in enumerate(REPLICAS * 2):  # 4 slots, all of this process
        await load.reserve(f"h{i}", r, 10)
        adm._holds[f"h{i}"] = now - 0.1
    t0 = time.monotonic()
    with pytest.raises(OpenAIError) as err:
        await adm.admit("young", lambda: REPLICAS)
    assert time.monotonic() - t0 < 0.1 and err.value.status == 429
    assert adm.waiting == 0

    adm._holds["h0"] = time.monotonic() - 3.9  # nearly done
    task = asyncio.create_task(adm.admit("old", lambda: REPLICAS))
    await asyncio.sleep(0.05)
    assert not task.done() and adm.waiting == 1
    await load.release("h0")
    adm.released("h0")
    await asyncio.wait_for(task, 1.0)
    assert len(adm._held) == 21 and adm._held[-1] > 3.9  # its hold time joined the others
    assert "old" in adm._holds and "h0" not in adm._holds


async def test_slots_of_other_routers_free_at_the_stationary_rate():
    """With every slot held by other router processes (ages unknown), four 4 s holds free
    one within 0.25 s with probability 1 - (1 - 0.25 / 4) ** 4 = 0.23: refused at once;
    with 64 such slots, 0.98: the request waits."""
    for slots, waits in ((4, False), (64, True)):
        load = MemoryLoadTracker()
        await _full(load, slots // 2)
        adm = Admission(load, slots // 2, timeout_s=0.25)
        adm._held.extend([4.0] * 20)
        task = asyncio.create_task(adm.admit("x", lambda: REPLICAS))
        await asyncio.sleep(0.05)
        assert task.done() is not waits, slots
        if waits:
            await _free_one(load, adm, "a0")
        try:
            await asyncio.wait_for(task, 1.0)
            assert waits
        except OpenAIError as exc:
            assert not waits and exc.status == 429
