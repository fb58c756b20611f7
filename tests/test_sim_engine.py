"""The simulated engine's block pool and scheduler follow vLLM's prefix-caching semantics."""

from __future__ import annotations

from replicas.sim.block_pool import BlockPool
from replicas.sim.engine import EngineConfig, SimEngine, SimRequest
from replicas.sim.step_model import StepTimeModel

BS = 32
FLAT = StepTimeModel(0.001, 1e-5, 1e-4, 0.0, name="flat")


def engine(num_blocks=64, budget=8192):
    return SimEngine(EngineConfig(num_blocks=num_blocks, block_size=BS,
                                  max_num_batched_tokens=budget), FLAT)


def run(e: SimEngine, *reqs: SimRequest) -> float:
    for r in reqs:
        e.add_request(r)
    t = 0.0
    while e.has_work:
        t += e.step().duration_s
    return t


def test_repeat_prompt_reuses_whole_blocks_capped_below_the_prompt_length():
    e = engine()
    run(e, SimRequest("a", list(range(100)), 4))
    b = SimRequest("b", list(range(100)), 4)
    run(e, b)
    assert b.num_cached_tokens == 96
    c = SimRequest("c", list(range(96)), 4)  # exactly 3 blocks: the last one is recomputed
    run(e, c)
    assert c.num_cached_tokens == 64


def test_a_recomputed_block_is_stored_again_as_a_second_copy():
    e = engine()
    run(e, SimRequest("a", list(range(64)), 1))
    e.take_events()
    run(e, SimRequest("b", list(range(64)), 1))
    stored = [ev for ev in e.take_events() if ev.kind == "stored"]
    assert len(stored) == 1 and len(stored[0].block_hashes) == 1  # block 1 again
    assert len(e.pool.cached[stored[0].block_hashes[0]]) == 2


def test_eviction_is_lazy_lru_and_takes_a_finished_requests_tail_first():
    e = engine(num_blocks=6)
    a = SimRequest("a", list(range(128)), 1)            # 4 blocks
    run(e, a)
    e.take_events()
    run(e, SimRequest("b", list(range(1000, 1080)), 1))  # needs 3 blocks: 2 free + 1 evicted
    removed = [h for ev in e.take_events() if ev.kind == "removed" for h in ev.block_hashes]
    assert removed == [a.block_hashes[3]]               # a's tail block went first
    c = SimRequest("c", list(range(128)), 1)
    run(e, c)
    assert c.num_cached_tokens == 96                     # a's first 3 blocks survive


def test_chunked_prefill_spreads_a_long_prompt_over_steps():
    e = engine(num_blocks=200, budget=256)
    r = SimRequest("a", list(range(1000)), 2)
    e.add_request(r)
    steps_to_first = 0
    while not r.output_token_ids:
        e.step()
        steps_to_first += 1
    assert steps_to_first == 4  # 256 + 256 + 256 + 232


def test_step_time_follows_the_model():
    e = engine()
    e.add_request(SimRequest("a", list(range(320)), 3))
    first = e.step()
    assert abs(first.duration_s - FLAT.step_s(320, 0, 320)) < 1e-12
    second = e.step()
    assert second.decode_seqs == 1 and second.prefill_tokens == 0


def test_reset_prefix_cache_clears_only_when_idle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [11], None)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert [ev.kind for ev in pool.take_events()] == ["stored", "cleared"]
    assert pool.get_cached_block(11) is None


def test_preemption_frees_blocks_and_the_request_still_completes():
    e = engine(num_blocks=8, budget=8192)
    a = SimRequest("a", list(range(200)), 40)  # grows to 8 blocks
    b = SimRequest("b", list(range(500, 700)), 40)
    run(e, a, b)
    assert a.finished and b.finished
    assert len(a.output_token_ids) == 40 and len(b.output_token_ids) == 40
    assert e.pool.num_free_blocks == 8


def test_bulk_decode_equals_step_by_step():
    """The simulator's speed-up keeps results exact: same tokens, blocks, events and time."""
    def build():
        e = engine(num_blocks=400)
        for i in range(5):
            e.add_request(SimRequest(f"r{i}", list(range(i * 1000, i * 1000 + 100 + 7 * i)),
                                     40 + 9 * i))
        return e

    slow, fast = build(), build()
    t_slow = run(slow)
    t_fast = 0.0
    while fast.has_work:
        res = fast.decode_run(1000) or fast.step()
        t_fast += res.duration_s
    assert abs(t_slow - t_fast) < 1e-9
    assert slow.generation_tokens_total == fast.generation_tokens_total
    assert sorted(slow.pool.cached) == sorted(fast.pool.cached)
    # the same blocks stored and removed (bulk runs group one request's blocks together)
    def blocks(e):
        return sorted((ev.kind, h) for ev in e.take_events() for h in ev.block_hashes)
    assert blocks(slow) == blocks(fast)
