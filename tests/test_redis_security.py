"""Redis with AUTH, ACLs and TLS, through the settings the service uses: a TLS-only
redis-server of the tests' own with client certificates required, as the ACL user that
may run the router's commands alone (``router.redis_keys.acl_rules``). The index's and the
route script's whole suites also run there (``redis-tls-acl`` in tests/test_index.py and
tests/test_route_lua.py)."""

from __future__ import annotations

import random
import uuid

import pytest

from router.config import Settings
from router.index.base import IndexUnavailable
from router.kv_events.wire import KVEvent
from router.policy.prefix_aware import PrefixAware
from router.routing.replica import ReplicaInfo
from router.serve import state


def _settings(secure, **over) -> Settings:
    tls = {"redis_tls_ca_file": secure.tls["ca_cert"],
           "redis_tls_cert_file": secure.tls["client_cert"],
           "redis_tls_key_file": secure.tls["client_key"]}
    return Settings(**{"redis_url": secure.url, "index_namespace":
                       f"test-{uuid.uuid4().hex[:8]}", "redis_timeout_s": 2.0, **tls, **over})


async def test_the_service_settings_reach_a_tls_redis_with_a_password(secure_redis):
    """``rediss://user:password@host`` plus the TLS files: the routing core routes by the
    index on it (cache hit on the replica whose events hold the prefix), atomically."""
    s = _settings(secure_redis)
    core = state.make_routing_core(s, PrefixAware(random.Random(0)))
    assert core.atomic is not None
    await core.index.apply_events("b", [KVEvent("stored", list(range(40)), None)])
    reps = [ReplicaInfo("a", {}, {}), ReplicaInfo("b", {}, {})]
    d = await core.decide("r1", 40 * 32 + 5, list(range(40)) + [77], reps)
    assert d.replica == "b" and d.reason == "cache"
    await core.load.release("r1")
    assert sum(v.inflight for v in (await core.load.loads(["a", "b"])).values()) == 0
    await core.index.flush()


@pytest.mark.parametrize("case", ["wrong password", "no client certificate", "no TLS",
                                  "a namespace the user may not touch"])
async def test_a_refused_connection_degrades_routing_and_never_shows_the_password(
        secure_redis, case):
    """Redis refusing the router (a wrong password, no client certificate, plain TCP to
    the TLS port, keys outside the ACL user's namespace) fails no request: the decision
    falls back to load, and the error names the server without the password."""
    over: dict = {}
    if case == "wrong password":
        over["redis_url"] = secure_redis.url.replace(secure_redis.ROUTER_PASSWORD, "guess-pw")
    elif case == "no client certificate":
        over = {"redis_tls_cert_file": None, "redis_tls_key_file": None}
    elif case == "no TLS":
        over["redis_url"] = secure_redis.url.replace("rediss://", "redis://")
    else:
        over["index_namespace"] = "elsewhere"
    s = _settings(secure_redis, redis_timeout_s=0.5, **over)
    index = state.make_index(s)
    with pytest.raises(IndexUnavailable) as err:
        await index.lookup([1, 2, 3], ["a"])
    assert secure_redis.ROUTER_PASSWORD not in str(err.value)
    assert "guess-pw" not in str(err.value)
    core = state.make_routing_core(s, PrefixAware(random.Random(0)))
    reps = [ReplicaInfo("a", {}, {}), ReplicaInfo("b", {}, {})]
    d = await core.decide("r1", 400, list(range(10)), reps)
    assert d.replica in ("a", "b") and d.reason == "fallback"
    await core.load.release("r1")
