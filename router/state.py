"""Process-wide objects shared by the ingress (FastAPI loop) and the Ray router (its own loop).

Ray Serve pickles the router's module by value and may rebuild the router, so shared state
cannot live on the router object or in its module (DESIGN.md decision 6). This module is
imported by reference, so its registry is one per process. Only thread-safe objects are
registered here (the in-process index and load tracker take a lock); Redis clients are
never shared across loops.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from router.config import Settings

_lock = threading.Lock()
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


def make_load_tracker(settings: Settings):
    """The load tracker for ``settings``: Redis-backed when a URL is set, else in-process
    (one per process, shared by the ingress and the router)."""
    from router.load import MemoryLoadTracker

    return shared(f"load:{settings.index_namespace}",
                  lambda: MemoryLoadTracker(recent_half_life_s=settings.recent_window_s))


def make_index(settings: Settings):
    """The prefix index for ``settings``: Redis when ``redis_url`` is set, else in-process."""
    if settings.redis_url:
        from router.index.redis_index import RedisPrefixIndex

        return RedisPrefixIndex(settings.redis_url, namespace=settings.index_namespace,
                                timeout_s=settings.redis_timeout_s)
    from router.index.memory import MemoryPrefixIndex

    return shared(f"index:{settings.index_namespace}", MemoryPrefixIndex)
