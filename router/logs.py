"""The project's one logger convention: ``logger = get_logger(__name__)`` in every module."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name``, a child of Ray Serve's ``ray.serve`` logger.

    Inside Serve's processes (the ingress, the router, the engine replicas) Serve configures
    the handlers of ``ray.serve``, so the module's lines reach that replica's own log file
    with Serve's request context (docs.ray.io, "Monitor your application": Serve logs through
    the ``ray.serve`` logger); elsewhere (tests, the simulator, the simulated engine's own
    process) they propagate to the root logger as any module's would.
    """
    return logging.getLogger(f"ray.serve.{name}")
