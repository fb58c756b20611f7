"""Autoscaling on the engines' load (``router.serve.autoscaling``), run through Serve's own
config model and policy wrapper, and the replica's drain (``EngineReplica.drain``)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingContext

from replicas.deployment import EngineReplica
from router.config import Settings
from router.routing.replica import RoutingStats
from router.serve.autoscaling import (ENGINE_REQUESTS, engine_autoscaling_config,
                                      engine_load_policy)

DEP = DeploymentID(name="EngineReplica", app_name="t")


def _name(fn) -> str:  # Serve hands back an unpickled copy of the function
    return f"{fn.__module__}:{fn.__qualname__}"


def context(config, running: int, engine_requests: list[float] | None,
            serve_requests: float = 0.0, policy_state=None) -> AutoscalingContext:
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(running)]
    metrics = None if engine_requests is None else {
        ENGINE_REQUESTS: dict(zip(replicas, engine_requests))}
    return AutoscalingContext(
        deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name,
        current_num_replicas=running, target_num_replicas=running,
        running_replicas=replicas, total_num_requests=serve_requests,
        total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=policy_state or {}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=None, config=config)


def test_the_config_names_the_engine_load_policy_and_serve_resolves_it():
    cfg = engine_autoscaling_config({"min_replicas": 1, "max_replicas": 4,
                                     "target_ongoing_requests": 2})
    assert _name(cfg.policy.get_policy()) == _name(engine_load_policy)
    named = engine_autoscaling_config({"max_replicas": 2, "policy": {
        "policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}})
    assert _name(named.policy.get_policy()) != _name(engine_load_policy)  # an operator's own policy


def test_the_policy_asks_for_the_engines_requests_over_the_target():
    cfg = engine_autoscaling_config({"min_replicas": 1, "max_replicas": 8,
                                     "target_ongoing_requests": 2})
    # Serve counts nothing on the direct path (0 requests); the engines hold 9
    desired, _ = engine_load_policy(context(cfg, 2, [5.0, 4.0], serve_requests=0.0))
    assert desired == pytest.approx(4.5)
    # before any replica reported, Serve's own count stands in
    assert engine_load_policy(context(cfg, 2, None, serve_requests=6.0))[0] == 3.0
    assert engine_load_policy(context(cfg, 0, None))[0] == 0


def test_serve_applies_the_configs_delays_around_the_policy():
    """Serve wraps a custom policy with the config's delays (its controller then rounds up
    and bounds the answer by min and max replicas)."""
    def wrapped(delay_s):
        return _apply_autoscaling_config(engine_load_policy), engine_autoscaling_config(
            {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 2,
             "upscale_delay_s": delay_s, "downscale_delay_s": delay_s})

    policy, cfg = wrapped(0)
    assert policy(context(cfg, 2, [6.0, 6.0]))[0] == 6
    assert policy(context(cfg, 2, [0.0, 1.0]))[0] == 1
    policy, cfg = wrapped(60)  # not for long enough yet: the target stays
    assert policy(context(cfg, 2, [6.0, 6.0]))[0] == 2
    assert policy(context(cfg, 2, [0.0, 0.0]))[0] == 2


def test_autoscaling_settings_are_checked_and_replace_num_replicas():
    s = Settings(autoscaling_config={"min_replicas": 2, "max_replicas": 5})
    assert s.configured_replicas == 2 and s.most_replicas == 5
    assert Settings(**s.dump()).autoscaling_config == s.autoscaling_config  # to replicas
    assert Settings(num_replicas=3).configured_replicas == 3
    with pytest.raises(ValueError, match="unknown keys"):
        Settings(autoscaling_config={"max_replica": 3})
    with pytest.raises(ValueError, match="min_replicas"):
        Settings(autoscaling_config={"min_replicas": 3, "max_replicas": 1})
    with pytest.raises(ValueError, match="not both"):
        Settings(num_replicas=2, autoscaling_config={"max_replicas": 3})


def test_the_engine_deployment_autoscales_with_the_policy(model_dir):
    from router.app import engine_deployment

    s = Settings(model=str(model_dir), autoscaling_config={"min_replicas": 1,
                                                           "max_replicas": 2})
    cfg = engine_deployment(s)._deployment_config
    assert cfg.autoscaling_config.max_replicas == 2
    assert _name(cfg.autoscaling_config.policy.get_policy()) == _name(engine_load_policy)
    assert cfg.graceful_shutdown_timeout_s == s.drain_timeout_s + 30


class _Engine:
    def alive(self):
        return True


class _DrainOnly(EngineReplica):
    def __del__(self):  # nothing was started: nothing to shut down
        pass


def _replica(states: list[tuple[int, int, float]]) -> EngineReplica:
    """An ``EngineReplica`` whose scrapes read ``states`` in turn: (running, waiting,
    finished), the last one for ever."""
    r = _DrainOnly.__new__(_DrainOnly)
    r.engine, r.stats, seq = _Engine(), RoutingStats(), list(states)

    async def scrape():
        running, waiting, finished = seq.pop(0) if len(seq) > 1 else seq[0]
        r.stats = dataclasses.replace(r.stats, running=running, waiting=waiting,
                                      requests_finished_total=finished)
    r._scrape = scrape
    return r


def test_drain_waits_for_a_quiet_engine():
    # busy for 3 scrapes, then a request finishes between scrapes, then quiet
    r = _replica([(2, 1, 5.0), (1, 0, 6.0), (0, 0, 7.0), (0, 0, 8.0), (0, 0, 8.0)])
    assert asyncio.run(r.drain(5.0, quiet_s=0.05, poll_s=0.01))
    assert r.stats.requests_finished_total == 8.0


def test_drain_gives_up_after_its_timeout():
    r = _replica([(1, 0, 0.0)])
    assert not asyncio.run(r.drain(0.1, quiet_s=0.05, poll_s=0.01))


def test_configs_the_autoscaler_could_not_serve_are_refused():
    with pytest.raises(ValueError, match="at least 1"):  # a fleet at 0 would never wake
        Settings(autoscaling_config={"min_replicas": 0, "max_replicas": 2})
    with pytest.raises(ValueError, match="must be a number"):
        Settings(autoscaling_config={"target_ongoing_requests": None})
    with pytest.raises(ValueError, match="below max_inflight_per_replica"):
        Settings(max_inflight_per_replica=4, autoscaling_config={"target_ongoing_requests": 4})
    assert Settings(max_inflight_per_replica=4,
                    autoscaling_config={"target_ongoing_requests": 3}).most_replicas == 1
    assert Settings(max_inflight_per_replica=2).autoscaling_config is None  # no autoscaler


def test_an_autoscaling_config_given_twice_is_compared_as_json(monkeypatch):
    monkeypatch.setenv("PREFIX_ROUTER_AUTOSCALING_CONFIG", '{"max_replicas": 3}')
    assert Settings.given_twice({"autoscaling_config": {"max_replicas": 3}}) == []
    (line,) = Settings.given_twice({"autoscaling_config": {"max_replicas": 2}})
    assert "PREFIX_ROUTER_AUTOSCALING_CONFIG" in line
