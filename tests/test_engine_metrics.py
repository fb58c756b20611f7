"""Parsing an engine's Prometheus ``/metrics`` (``replicas.engine_metrics``): the KV cache's
size from ``vllm:cache_config_info``, as vLLM and the simulated engine publish it."""

from __future__ import annotations

from replicas.engine_metrics import parse_engine_metrics
from replicas.sim.engine import EngineConfig, SimEngine
from replicas.sim.server import EventPublisher, SimServer
from replicas.sim.step_model import StepTimeModel

# vLLM's own lines (vllm/v1/metrics/loggers.py log_metrics_info: every CacheConfig field
# as a label, values as str(), one label set per engine)
VLLM = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",\
engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="127500",\
prefix_caching_hash_algo="sha256"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


def test_the_kv_capacity_is_num_gpu_blocks_times_block_size():
    snap = parse_engine_metrics(VLLM)
    assert snap.kv_capacity_tokens == 127500 * 16
    assert snap.kv_usage_frac == 0.25


def test_two_engines_publish_the_servers_count_once_each_and_an_unset_count_is_unknown():
    """Two data-parallel engines of 127,500 blocks each: vLLM's front end publishes the
    summed count (255,000) under both engine labels; a request runs on one engine of
    127,500 blocks, and with one engine half full and the other empty a quarter of the
    blocks is in use: an average engine has 95,625 free."""
    info, usage = VLLM.split("# HELP vllm:kv_cache_usage_perc")
    one = info.splitlines()[-1].replace('num_gpu_blocks="127500"', 'num_gpu_blocks="255000"')
    two = (info.replace('num_gpu_blocks="127500"', 'num_gpu_blocks="255000"')
           + one.replace('engine="0"', 'engine="1"') + "\n# HELP vllm:kv_cache_usage_perc"
           + usage.replace(" 0.25", " 0.5")
           + 'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.0\n')
    snap = parse_engine_metrics(two)
    assert snap.kv_capacity_tokens == 127500 * 16
    assert snap.kv_usage_frac == 0.25
    from router.policy.base import kv_free_tokens
    assert kv_free_tokens(snap.kv_capacity_tokens, snap.kv_usage_frac) == 95625 * 16
    unset = VLLM.replace('num_gpu_blocks="127500"', 'num_gpu_blocks="None"')
    assert parse_engine_metrics(unset).kv_capacity_tokens is None
    assert parse_engine_metrics("").kv_capacity_tokens is None
    no_usage = VLLM.split("# HELP vllm:kv_cache_usage_perc")[0]  # size alone: unknown
    assert parse_engine_metrics(no_usage).kv_capacity_tokens is None


def test_the_simulated_engine_publishes_its_kv_size_as_vllm_does():
    engine = SimEngine(EngineConfig(num_blocks=1000, block_size=32),
                       StepTimeModel.load("h200-qwen2.5-7b"))
    server = SimServer(engine, None, "m", EventPublisher(None, None, ""))  # no prompts here
    snap = parse_engine_metrics(server.metrics_text())
    assert snap.kv_capacity_tokens == 32000
    assert snap.kv_usage_frac == 0.0
