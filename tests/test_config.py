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
    from router.policies import make_policy
    monkeypatch.setenv("PREFIX_ROUTER_LOAD_FACTOR", "1.5")
    s = Settings()
    assert make_policy("prefix_aware", **s.policy_kwargs("prefix_aware")).load_factor == 1.5
    assert s.policy_kwargs("round_robin") == {}
    with pytest.raises(ValidationError):
        Settings(load_factor=0.9)  # a bound below the mean would refuse every replica
