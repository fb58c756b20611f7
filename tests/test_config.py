"""Settings: sources, validation, and the generated configuration reference."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from router.config import Settings, settings_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_configuration_reference_is_current():
    assert settings_markdown() in DOC.read_text()


def test_environment_overrides_defaults_and_arguments_override_environment(monkeypatch):
    monkeypatch.setenv("PREFIX_ROUTER_POLICY", "round_robin")
    monkeypatch.setenv("PREFIX_ROUTER_NUM_REPLICAS", "3")
    s = Settings()
    assert (s.policy, s.num_replicas) == ("round_robin", 3)
    assert Settings(policy="random").policy == "random"


def test_a_variable_that_names_no_setting_is_refused(monkeypatch):
    """Found by a docs audit: pydantic-settings skips ``PREFIX_ROUTER_*`` names it does
    not know, so a misspelt variable ran the default without a word."""
    monkeypatch.setenv("PREFIX_ROUTER_NUM_REPLICA", "3")
    with pytest.raises(ValidationError) as err:
        Settings()
    assert "PREFIX_ROUTER_NUM_REPLICA" in str(err.value)
    monkeypatch.delenv("PREFIX_ROUTER_NUM_REPLICA")
    # a nested field's variable and the config file's are settings' names
    monkeypatch.setenv("PREFIX_ROUTER_AUTOSCALING_CONFIG__MAX_REPLICAS", "3")
    assert Settings().autoscaling_config == {"max_replicas": 3}  # read as JSON
    monkeypatch.delenv("PREFIX_ROUTER_AUTOSCALING_CONFIG__MAX_REPLICAS")
    monkeypatch.setenv("prefix_router_port", "9000")  # a removed setting, any case
    with pytest.raises(ValidationError):
        Settings()
    monkeypatch.delenv("prefix_router_port")
    # a nested key of a plain setting: pydantic-settings would drop it without a word
    monkeypatch.setenv("PREFIX_ROUTER_POLICY__X", "random")
    with pytest.raises(ValidationError):
        Settings()


def test_yaml_file_named_by_environment_is_read(monkeypatch, tmp_path):
    f = tmp_path / "router.yaml"
    f.write_text("policy: least_loaded\nredis_url: redis://127.0.0.1:6379/3\n")
    monkeypatch.setenv("PREFIX_ROUTER_CONFIG", str(f))
    s = Settings()
    assert s.policy == "least_loaded" and s.redis_url.endswith("/3")


@pytest.mark.parametrize("bad", [{"policy": "fastest"}, {"block_size": 0},
                                 {"no_such_setting": 1}, {"hash_algo": "sha256"}])
def test_invalid_settings_are_refused(bad):
    with pytest.raises(ValidationError):
        Settings(**bad)


def test_model_name_and_tokenizer_default_from_the_model_directory():
    s = Settings(model="/models/Qwen2.5-7B-Instruct")
    assert s.served_model_name == "Qwen2.5-7B-Instruct"
    assert s.tokenizer == "/models/Qwen2.5-7B-Instruct"


def test_load_factor_reaches_the_prefix_aware_policy(monkeypatch):
    from router.policy import make_policy
    monkeypatch.setenv("PREFIX_ROUTER_LOAD_FACTOR", "1.5")
    s = Settings()
    assert make_policy("prefix_aware", **s.policy_kwargs("prefix_aware")).load_factor == 1.5
    assert s.policy_kwargs("round_robin") == {}
    with pytest.raises(ValidationError):
        Settings(load_factor=0.9)  # a bound below the mean would refuse every replica


@pytest.mark.parametrize("name", ["cpu.yaml", "gpu.yaml", "gpu-shared.yaml"])
def test_every_deploy_config_is_a_valid_serve_config_of_valid_settings(name):
    """The GPU configs are checked here, not run (CI has no GPU): Serve's own schema of a
    config file, our settings, and the engine command each replica would start."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from replicas.engine import EnginePorts, EngineProcess

    cfg = yaml.safe_load((DOC.parent.parent / "deploy" / name).read_text())
    ServeDeploySchema.model_validate(cfg)
    s = Settings(**cfg["applications"][0]["args"])
    device = "gpu" if s.device == "gpu" else "cpu"
    cmd = EngineProcess(s, EnginePorts(8100, "ipc:///tmp/a", "ipc:///tmp/b"), "t",
                        device).command()
    assert "--prefix-caching-hash-algo" in cmd and "--kv-events-config" in cmd
    if device == "gpu":
        assert s.replica_num_gpus * s.num_replicas <= 1 or s.replica_num_gpus == 1
        if s.replica_num_gpus < 1:  # engines sharing a GPU get their KV cache explicitly,
            # and each asks at start for no more free memory than its share (vLLM's check)
            assert s.gpu_memory_utilization <= s.replica_num_gpus
            assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(
                int(s.kv_cache_memory_gib * 2**30))
        assert s.block_size % 16 == 0 and not s.enforce_eager
        assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes"


def test_a_relative_model_directory_is_made_absolute_for_the_replicas(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = Settings(model="models/qwen2.5-7b", generate_model_shape="qwen2.5-7b")
    assert s.model == str(tmp_path / "models" / "qwen2.5-7b")
    assert Settings(**s.dump()).model == s.model
    (tmp_path / "local-model").mkdir()
    assert Settings(model="local-model").model == str(tmp_path / "local-model")
    # a name that is no local directory (a model hub id) stays as it is
    assert Settings(model="Qwen/Qwen2.5-7B-Instruct").model == "Qwen/Qwen2.5-7B-Instruct"


def test_the_tie_tolerance_reaches_the_prefix_aware_policy():
    from router.policy import make_policy
    s = Settings(tie_tolerance_s=0.01)
    assert make_policy("prefix_aware", **s.policy_kwargs("prefix_aware")).tie_abs_s == 0.01


def test_a_setting_given_twice_with_different_values_is_reported(monkeypatch, tmp_path):
    """The application's args beat PREFIX_ROUTER_* variables: an operator who sets both to
    different values learns it at start-up instead of running something else."""
    monkeypatch.setenv("PREFIX_ROUTER_NUM_REPLICAS", "1")
    monkeypatch.setenv("PREFIX_ROUTER_POLICY", "round_robin")
    f = tmp_path / "router.yaml"
    f.write_text("max_model_len: 2048\n")
    monkeypatch.setenv("PREFIX_ROUTER_CONFIG", str(f))
    found = Settings.given_twice({"num_replicas": 2, "policy": "round_robin",
                                  "max_model_len": 8192, "block_size": 32})
    assert len(found) == 2
    assert any("num_replicas" in c and "PREFIX_ROUTER_NUM_REPLICAS" in c for c in found)
    assert any("max_model_len" in c and str(f) in c for c in found)
    assert Settings.given_twice({"policy": "round_robin", "num_replicas": "1"}) == []


def test_the_application_refuses_settings_given_twice(monkeypatch):
    from router.app import build_app
    monkeypatch.setenv("PREFIX_ROUTER_NUM_REPLICAS", "1")
    with pytest.raises(ValueError, match="num_replicas"):
        build_app({"num_replicas": 2})


def test_extra_key_encoding_reaches_the_hasher(monkeypatch):
    """The engines' vLLM version decides how a salt enters block 0's hash: the setting
    reaches the router's hasher (the start-up probe is unsalted and cannot tell)."""
    from router.hashing import BlockHasher

    ids = list(range(64))
    monkeypatch.setenv("PREFIX_ROUTER_EXTRA_KEY_ENCODING", "vllm-0.26")
    old = Settings(block_size=32)
    assert old.hash_settings.extra_key_encoding == "vllm-0.26"
    new = Settings(block_size=32, extra_key_encoding="vllm-0.32")
    salted = [BlockHasher(s.hash_settings).block_hashes(ids, cache_salt="t-acme")
              for s in (old, new)]
    assert salted[0] != salted[1]
    assert BlockHasher(old.hash_settings).block_hashes(ids) == \
        BlockHasher(new.hash_settings).block_hashes(ids)  # unsalted: the same


@pytest.mark.parametrize("text", ["None", "null", ""])
def test_an_optional_numbers_none_can_be_given_as_a_variable(monkeypatch, text):
    """``sse_keepalive_s`` is on by default and None turns it off: a variable can say so."""
    assert Settings().sse_keepalive_s is not None
    monkeypatch.setenv("PREFIX_ROUTER_SSE_KEEPALIVE_S", text)
    monkeypatch.setenv("PREFIX_ROUTER_MAX_INFLIGHT_PER_REPLICA", text)
    monkeypatch.setenv("PREFIX_ROUTER_RENDER_THREADS", text)
    s = Settings()
    assert s.sse_keepalive_s is None and s.max_inflight_per_replica is None
    assert s.render_threads is None


def _optional_numbers() -> list[str]:
    import typing

    def optional_number(annotation) -> bool:
        args = set(typing.get_args(annotation))
        return type(None) in args and bool(args & {int, float})
    return [name for name, f in Settings.model_fields.items() if optional_number(f.annotation)]


@pytest.mark.parametrize("text", ["None", "null", ""])
def test_every_optional_number_reads_none_from_a_variable(monkeypatch, text):
    """docs/configuration.md: "An optional number is turned off (None) by ``none``,
    ``null`` or an empty value" (an audit found ``tenant_max_inflight`` refused them)."""
    names = _optional_numbers()
    assert "tenant_max_inflight" in names and "load_factor" in names
    for name in names:
        monkeypatch.setenv(f"PREFIX_ROUTER_{name.upper()}", text)
    s = Settings()
    assert {name: getattr(s, name) for name in names} == dict.fromkeys(names)


def test_autoscaling_given_one_key_per_variable(monkeypatch):
    """``PREFIX_ROUTER_AUTOSCALING_CONFIG__<KEY>`` values come as text: read as JSON (it was
    a TypeError at start, comparing '4' with 1)."""
    monkeypatch.setenv("PREFIX_ROUTER_AUTOSCALING_CONFIG__MIN_REPLICAS", "1")
    monkeypatch.setenv("PREFIX_ROUTER_AUTOSCALING_CONFIG__MAX_REPLICAS", '"4"')  # quoted
    s = Settings()
    assert s.autoscaling_config == {"min_replicas": 1, "max_replicas": 4}
    assert s.most_replicas == 4 and s.configured_replicas == 1


def test_ports_asked_together_are_distinct_and_free():
    """``free_ports`` binds its sockets together, so no port comes twice (asked one at a
    time, a port not yet taken may be handed out again), and each is free to bind after;
    an engine's TCP endpoints (``EnginePorts.allocate(tcp=True)``) are three such ports."""
    import socket

    from replicas.engine import EnginePorts, free_ports

    ports = free_ports(256)  # one at a time, 256 ports repeated one in 94 of 100 tries (VM)
    assert len(set(ports)) == 256
    socks = [socket.socket() for _ in ports]
    try:
        for s, p in zip(socks, ports):
            s.bind(("127.0.0.1", p))
    finally:
        for s in socks:
            s.close()
    tcp = EnginePorts.allocate("t", tcp=True)
    assert tcp.kv_events.startswith("tcp://*:") and tcp.kv_replay.startswith("tcp://*:")
    assert len({tcp.http, int(tcp.kv_events.rsplit(":", 1)[1]),
                int(tcp.kv_replay.rsplit(":", 1)[1])}) == 3
