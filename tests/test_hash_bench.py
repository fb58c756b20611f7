"""loadtest.hash_bench: both ways of hashing agree, and the figures are what it says."""

from loadtest.hash_bench import bench, table


def test_hash_bench_compares_the_two_ways_on_the_same_prompts():
    row = bench(1024, rounds=1)  # asserts that both ways give the same digests
    assert row["blocks"] == 32
    assert row["bulk_ms"] > 0 and row["per_block_ms"] > 0 and row["next_turn_ms"] > 0
    assert abs(row["speedup"] - row["per_block_ms"] / row["bulk_ms"]) < 1e-9
    assert "| 1,024 | 32 |" in table([row])
