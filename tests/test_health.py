"""Circuit breakers per replica (docs/fault-cases.md 6.2): open after consecutive failures,
half-open after ``open_s``, and a half-open replica that the policy passes over is not shut out."""

from __future__ import annotations

import random

from router.clock import ManualClock
from router.config import Settings
from router.index.memory import MemoryPrefixIndex
from router.load.memory import MemoryLoadTracker
from router.policy import PrefixAware
from router.routing.core import RoutingCore
from router.routing.health import ReplicaHealth
from router.routing.replica import ReplicaInfo


def opened(clock: ManualClock) -> ReplicaHealth:
    h = ReplicaHealth(failure_threshold=3, open_s=10.0, clock=clock)
    for _ in range(3):
        h.record("A", False)
    return h


def test_circuit_opens_after_the_threshold_and_half_opens_after_open_s():
    clock = ManualClock(100.0)
    h = ReplicaHealth(failure_threshold=3, open_s=10.0, clock=clock)
    h.record("A", False)
    h.record("A", False)
    assert h.available("A") and not h.is_open("A")
    h.record("A", False)
    assert not h.available("A") and h.is_open("A")
    clock.advance(9.9)
    assert not h.available("A")
    clock.advance(0.2)
    assert h.available("A")


def test_considering_a_half_open_replica_does_not_take_its_probe():
    clock = ManualClock(100.0)
    h = opened(clock)
    clock.advance(11)
    # many decisions look at A and pick another replica: A stays a candidate
    assert all(h.available("A") for _ in range(5))


def test_the_probe_is_the_one_request_sent_until_its_outcome():
    clock = ManualClock(100.0)
    h = opened(clock)
    clock.advance(11)
    h.routed("A")
    assert not h.available("A")
    h.record("A", True)
    assert h.available("A") and not h.is_open("A")
    h.routed("A")  # a closed circuit: a request is no probe
    assert h.available("A")


def test_a_failed_probe_opens_the_circuit_again():
    clock = ManualClock(100.0)
    h = opened(clock)
    clock.advance(11)
    h.routed("A")
    h.record("A", False)
    assert not h.available("A")
    clock.advance(10.1)
    assert h.available("A")


def test_a_probe_whose_outcome_never_comes_blocks_only_for_open_s():
    clock = ManualClock(100.0)
    h = opened(clock)
    clock.advance(11)
    h.routed("A")  # its client left before any answer: no record
    clock.advance(9)
    assert not h.available("A")
    clock.advance(1.1)
    assert h.available("A")


async def test_a_half_open_replica_passed_over_by_the_policy_gets_traffic_again():
    """The fault behind a flaky CI run: the readmission probe was taken by the candidate
    filter of a decision that chose another replica, and the replica stayed out for good."""
    clock = ManualClock(100.0)
    h = opened(clock)
    core = RoutingCore(Settings(), MemoryPrefixIndex(clock=clock),
                       MemoryLoadTracker(clock=clock), PrefixAware(random.Random(0)), health=h)
    reps = [ReplicaInfo("A", {}, {}), ReplicaInfo("B", {}, {})]
    clock.advance(11)
    # B is busier than A by one request per decision, so the decisions alternate
    chosen = []
    for i in range(6):
        d = await core.decide(f"r{i}", 100, [], reps)
        chosen.append(d.replica)
        if d.replica == "A":
            h.record("A", True)
    assert "A" in chosen and chosen.count("A") >= 2, chosen


def test_health_answers_503_while_no_replica_can_serve():
    """Found by a docs audit: ``/health`` said 200 with every engine reported down (and
    before any replica was known), where the README promises 503 while none can serve."""
    from router.app import health_of
    from router.routing.replica import ReplicaInfo

    def infos(*alive):
        return tuple(ReplicaInfo(f"r{i}", {}, {} if a is None else {"engine_alive": a})
                     for i, a in enumerate(alive))

    assert health_of(None, 2)[0] == 503 and health_of(None, 2)[1]["status"] == "starting"
    assert health_of((), 2) == (503, {"status": "no replicas", "ready": False,
                                      "replicas": 0, "engines_alive": 0,
                                      "configured_replicas": 2})
    assert health_of(infos(False, False), 2)[0] == 503
    assert health_of(infos(False, None), 2)[0] == 200  # not known down: routed to
    code, body = health_of(infos(False, True), 2)
    assert (code, body["status"], body["ready"], body["engines_alive"]) == \
        (200, "degraded", False, 1)
    code, body = health_of(infos(True, True), 2)
    assert (code, body["status"], body["ready"]) == (200, "ok", True)


def test_ready_counts_the_replicas_serve_keeps_after_a_deployments_override():
    """An operator's review: after a ``deployments:`` override of ``num_replicas`` (applied in
    place, the application's arguments unchanged) ``/health`` counted the arguments' count,
    so it said ``degraded`` forever after a scale-in and ``ready`` too early after a
    scale-out. The deployment status is shaped as ``Ingress._engine_deployment_status``
    gives it from ``serve.status()``: its enums by name (``UPDATING``; a break test saw
    ``DeploymentStatus.UPDATING`` in ``/health``), as Serve's REST API spells them."""
    from ray.serve._private.common import DeploymentStatus, ReplicaState

    from router.app import _enum_name, engine_replicas_configured

    def dep(status, **states):
        return {"status": _enum_name(status), "message": "",
                "replica_states": {_enum_name(ReplicaState[k]): n for k, n in states.items()}}

    assert dep(DeploymentStatus.UPDATING, STARTING=1) == {
        "status": "UPDATING", "message": "", "replica_states": {"STARTING": 1}}

    fixed = Settings(num_replicas=4)
    # scaled out to 12 by the override: 4 run, 8 start
    assert engine_replicas_configured(
        fixed, dep(DeploymentStatus.UPSCALING, RUNNING=4, STARTING=8)) == 12
    # scaled in to 2: the replicas Serve stops are not counted
    assert engine_replicas_configured(
        fixed, dep(DeploymentStatus.DOWNSCALING, RUNNING=2, STOPPING=2)) == 2
    assert engine_replicas_configured(fixed, dep(DeploymentStatus.HEALTHY, RUNNING=2)) == 2
    # a replica on a draining node is replaced: the replacement counts, it does not
    assert engine_replicas_configured(
        fixed, dep(DeploymentStatus.HEALTHY, RUNNING=3, PENDING_MIGRATION=1, STARTING=1)) == 4
    # still deploying, or Serve's status not known: the arguments' count
    assert engine_replicas_configured(
        fixed, dep(DeploymentStatus.UPDATING, STARTING=1)) == 4
    assert engine_replicas_configured(fixed, None) == 4
    # no engine in Ray (external engines only): none, whatever Serve starts
    assert engine_replicas_configured(
        Settings(num_replicas=0), dep(DeploymentStatus.UPSCALING, STARTING=1)) == 0
    # autoscaling: min_replicas, whatever Serve runs now
    auto = Settings(autoscaling_config={"min_replicas": 2, "max_replicas": 5})
    assert engine_replicas_configured(auto, dep(DeploymentStatus.HEALTHY, RUNNING=5)) == 2


def test_health_outside_ray_asks_serve_nothing_and_starts_no_ray(monkeypatch):
    """The ingress made outside Ray Serve (``loadtest.router_throughput``): ``/health``'s
    question to Serve's controller (``serve.status()``) started a local Ray instance from a
    thread, whose dashboard and runtime-env agents outlived the benchmark's processes. Ray
    not initialized (as in such a process; pytest's may have started it), nothing is asked;
    nor with ``num_replicas`` 0, where no engine deployment exists."""
    import asyncio
    from types import SimpleNamespace

    import ray
    from ray import serve

    from router import app as router_app

    asked = []
    monkeypatch.setattr(serve, "status", lambda: asked.append(1))
    cls = router_app.Ingress.func_or_class.__mro__[1]  # the class @serve.ingress wraps

    def deployment_status(num_replicas: int):
        ingress = SimpleNamespace(settings=Settings(num_replicas=num_replicas),
                                  _status_cache=None, _status_call=None)
        return asyncio.run(cls._engine_deployment_status(ingress))

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert deployment_status(2) is None and asked == []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert deployment_status(0) is None and asked == []
    deployment_status(2)  # in Ray, with engines in Ray: asked
    assert asked == [1]
