"""Process-wide objects shared by the ingress (FastAPI loop) and the Ray router (its own loop).

Ray Serve pickles the router's module by value and may rebuild the router, so shared state
cannot live on the router object or in its module (docs/architecture.md, decision 6). This module is
imported by reference, so its registry is one per process. Only thread-safe objects are
registered here (the in-process index and load tracker take a lock); Redis clients are
never shared across loops.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from router.config import Settings

_lock = threading.RLock()  # factories may call shared() again
_objects: dict[str, Any] = {}


def shared(key: str, factory: Callable[[], Any]) -> Any:
    """The process's object under ``key``, made by ``factory`` on first use."""
    with _lock:
        obj = _objects.get(key)
        if obj is None:
            obj = _objects[key] = factory()
        return obj


def peek(key: str) -> Any:
    """The object under ``key``, or None."""
    with _lock:
        return _objects.get(key)


def put(key: str, obj: Any) -> None:
    with _lock:
        _objects[key] = obj


def replica_count() -> int | None:
    """Engine replicas to route among (``replica_ids``), or None before any replica set
    is known."""
    ids = replica_ids()
    return None if ids is None else len(ids)


def replica_ids() -> frozenset[str] | None:
    """The ids of ``replica_infos``, or None before any replica set is known."""
    infos = replica_infos()
    return None if infos is None else frozenset(i.replica_id for i in infos)


def redis_connections(settings: Settings):
    """The process's Redis connections for ``settings`` (one client per event loop; a
    cluster client with ``redis_cluster``), whose calls check the namespace's key layout
    first (``router.index.layout``)."""
    from router.index.redis import RedisConnections

    return shared(f"redis:{settings.redis_url}:{settings.redis_timeout_s}:"
                  f"{settings.redis_cluster}:{settings.index_namespace}",
                  lambda: RedisConnections(settings.redis_url, settings.redis_timeout_s,
                                           settings.redis_connection_kwargs(),
                                           cluster=settings.redis_cluster,
                                           layout_namespace=settings.index_namespace))


def make_load_tracker(settings: Settings):
    """The load tracker for ``settings``, one per process (shared by the ingress and the
    router): in Redis when ``redis_url`` is set (shared by every router), else in-process."""
    if settings.redis_url:
        from router.load.redis import RedisLoadTracker

        return shared(f"load:{settings.redis_url}:{settings.index_namespace}",
                      lambda: RedisLoadTracker(redis_connections(settings),
                                               settings.index_namespace,
                                               shard_groups=settings.index_shard_groups))
    from router.load.memory import MemoryLoadTracker

    return shared(f"load:{settings.index_namespace}",
                  MemoryLoadTracker)


def make_index(settings: Settings):
    """The prefix index for ``settings``: Redis when ``redis_url`` is set, else in-process."""
    if settings.redis_url:
        from router.index.redis import RedisPrefixIndex

        return RedisPrefixIndex(settings.redis_url, namespace=settings.index_namespace,
                                connections=redis_connections(settings),
                                shard_groups=settings.index_shard_groups)
    from router.index.memory import MemoryPrefixIndex

    return shared(f"index:{settings.index_namespace}", MemoryPrefixIndex)


def make_atomic_route(settings: Settings, index, load):
    """The one-round-trip decision over ``index`` and ``load`` (``make_index`` and
    ``make_load_tracker`` for the same ``settings``): with Redis, an
    ``router.routing.atomic.AtomicRoute`` (with shard groups, its choice of the group,
    ``router.routing.groups.GroupChoice``, keeps this router's decisions for
    ``predicted_ttl_s``); None for the in-process backends."""
    if not settings.redis_url:
        return None
    from router.routing.atomic import AtomicRoute

    first_level = None
    if settings.index_shard_groups:
        from router.routing.groups import GroupChoice

        first_level = GroupChoice(index.groups, clock=load.clock,
                                  load_factor=settings.index_group_load_factor,
                                  ttl_s=settings.predicted_ttl_s)
    return AtomicRoute(index, load, first_level)


def make_routing_core(settings: Settings, policy):
    """A ``RoutingCore`` over this process's index, load tracker and circuit breakers, its
    index failures counted in the metrics. Make it on the event loop that will use it (a
    Redis client belongs to the loop that made it)."""
    from router import metrics
    from router.routing.core import RoutingCore

    def index_error(exc: Exception, op: str) -> None:
        metrics.inc("index_errors", tags={"op": op})
        metrics.set_gauge("index_available", 0)

    index, load = make_index(settings), make_load_tracker(settings)
    return RoutingCore(settings, index, load, policy, on_index_error=index_error,
                       health=replica_health(), atomic=make_atomic_route(settings, index, load),
                       sessions=make_session_store(settings), shadow=make_shadow(settings),
                       drains=make_drains(settings))


def make_drains(settings: Settings):
    """The process's drained replicas (``router.routing.drain``): in Redis when
    ``redis_url`` is set (every router's), else this process's."""
    from router.routing.drain import DrainedReplicas

    if settings.redis_url:
        return shared(f"drains:{settings.redis_url}:{settings.index_namespace}",
                      lambda: DrainedReplicas(redis_connections(settings),
                                              settings.index_namespace))
    return shared(f"drains:{settings.index_namespace}", DrainedReplicas)


def make_shadow(settings: Settings):
    """The shadow evaluation of ``settings`` (``router.routing.shadow``), or None when its
    sample rate is 0."""
    if settings.shadow_sample_rate <= 0:
        return None
    from router.routing.shadow import ShadowEvaluator
    return ShadowEvaluator(settings.shadow_policies, settings.shadow_sample_rate,
                           settings.policy_kwargs)


def make_session_store(settings: Settings):
    """The session pins for ``settings``: in Redis when ``redis_url`` is set (shared by
    every router), else this process's own."""
    from router.routing.sessions import MemorySessionStore, RedisSessionStore

    if settings.redis_url:
        return RedisSessionStore(redis_connections(settings), settings.index_namespace)
    return shared(f"sessions:{settings.index_namespace}", MemorySessionStore)


def replica_infos():
    """The engine replicas to route among (a tuple of ``router.routing.replica.ReplicaInfo``):
    those Ray runs, as the Ray router last heard of them (``replica_infos``, put by
    ``router.serve.request_router``), then the engines reached by URL
    (``external_replicas``, put by ``replicas.external.ExternalFleet``); None before either
    is known."""
    global _joined
    serve, external = peek("replica_infos"), peek("external_replicas")
    if external is None:
        return serve
    s, e, both = _joined  # joined once per change of either set, not on every call
    if s is not serve or e is not external:
        both = tuple(serve or ()) + tuple(external)
        _joined = (serve, external, both)
    return both


_joined: tuple = (None, None, ())  # (Serve's set, the external set, the two joined)


def replica_health():
    """The process's circuit breakers (``router.routing.health.ReplicaHealth``)."""
    from router.routing.health import ReplicaHealth

    return shared("replica_health", ReplicaHealth)
