"""``router.routing.recent.RecentDecisions``: the fallback index of a router whose shared
index fails (its own recent decisions), bounded, the latest decision owning a block."""

from __future__ import annotations

from router.clock import ManualClock
from router.routing.recent import RecentDecisions


def test_a_conversation_matches_where_its_last_turn_went_until_the_ttl():
    clock = ManualClock()
    recent = RecentDecisions(clock)
    recent.record("a", [1, 2, 3], ttl_s=10.0)
    assert recent.lookup([1, 2, 3, 4], ["a", "b"]) == {"a": 3, "b": 0}
    recent.record("b", [1, 2], ttl_s=10.0)  # a later decision takes the blocks over
    assert recent.lookup([1, 2, 3], ["a", "b"]) == {"a": 0, "b": 2}
    assert recent.lookup([3], ["a", "b"]) == {"a": 1, "b": 0}
    clock.advance(10.0)
    assert recent.lookup([1, 2, 3], ["a", "b"]) == {"a": 0, "b": 0}


def test_the_blocks_kept_stay_bounded_and_a_block_written_again_outlives_older_ones():
    clock = ManualClock()
    recent = RecentDecisions(clock, max_blocks=1000)
    system = list(range(10))  # a system prompt every conversation starts with
    for k in range(200):
        recent.record(f"r{k % 4}", system + [10_000 + 20 * k + i for i in range(20)], 60.0)
        assert len(recent) <= 1000
    for n in (499, 600, 2000):  # long prompts: still within the bound
        recent.record("big", list(range(10 ** 6 * n, 10 ** 6 * n + n)), 60.0)
        assert len(recent) <= 1000
    for k in range(200, 240):
        recent.record(f"r{k % 4}", system + [10_000 + 20 * k + i for i in range(20)], 60.0)
    assert recent.lookup(system, ["r3"]) == {"r3": 10}  # the last writer, still held
    assert recent.lookup([10_000 + 20 * 239], ["r3"]) == {"r3": 1}
    assert recent.lookup([10_000], ["r0"]) == {"r0": 0}  # the oldest-written went first


def test_a_replica_that_left_is_forgotten_in_both_generations():
    clock = ManualClock()
    recent = RecentDecisions(clock, max_blocks=4)
    recent.record("a", [1, 2], 60.0)  # fills the current generation: it turns over
    recent.record("a", [3], 60.0)
    recent.record("b", [4], 60.0)
    recent.remove_replica("a")
    assert recent.lookup([1], ["a", "b"]) == {"a": 0, "b": 0}
    assert recent.lookup([3], ["a", "b"]) == {"a": 0, "b": 0}
    assert recent.lookup([4], ["a", "b"]) == {"a": 0, "b": 1}


def test_removing_a_replica_does_not_bring_back_the_owner_it_replaced():
    recent = RecentDecisions(ManualClock(), max_blocks=6)
    recent.record("a", [1, 2], 60.0)
    recent.record("x", [10, 11], 60.0)  # the current generation turns over
    recent.record("b", [1], 60.0)  # b takes block 1 over from a
    recent.remove_replica("b")
    assert recent.lookup([1, 2], ["a", "b"]) == {"a": 0, "b": 0}
