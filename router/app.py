"""The Ray Serve application: the ingress deployment in front of the engine deployment.

``serve run deploy/cpu.yaml`` (or ``python -m deploy.run``) calls ``build_app(args)``; the
YAML's ``args`` are ``Settings`` fields and override the environment and the config file.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import ClientDisconnect
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.config import RequestRouterConfig

from router import state
from router.config import DEFAULT_MODEL_DIR, Settings
from router.errors import OpenAIError, no_replicas
from router.ingress import IngressCore, build_fastapi_app
from router.prompts import CHAT_PATH, COMPLETIONS_PATH
from router.protocol import route_label
from router.routing import hash_mismatches

logger = logging.getLogger("ray.serve")

fastapi_app = build_fastapi_app()


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 beyond ``limit`` bytes (FAULTS.md 10.2)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        logger.warning("request body of %s bytes refused (limit %d)", declared, limit)
        raise OpenAIError(413, f"request body exceeds the router's limit of {limit} bytes "
                               "(setting max_body_bytes)", "RequestTooLargeError")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            logger.warning("request body over %d bytes refused", limit)
            raise OpenAIError(413, f"request body exceeds the router's limit of {limit} bytes "
                                   "(setting max_body_bytes)", "RequestTooLargeError")
        chunks.append(chunk)
    return b"".join(chunks)


@serve.deployment(name="Ingress")
@serve.ingress(fastapi_app)
class Ingress:
    """OpenAI-compatible HTTP front door (see ``router.ingress``)."""

    def __init__(self, settings: dict[str, Any], engine_handle):
        self.settings = Settings(**settings)
        self.core = IngressCore(self.settings, engine_handle)
        self.engine_handle = engine_handle
        # The handle creates its router on first use; one call makes it learn the replica
        # set now, so /health and the 503 check know the replica count before traffic.
        self._warmup = asyncio.get_event_loop().create_task(self._warm_up())

    async def _warm_up(self) -> None:
        try:
            await self.engine_handle.ping.remote()
        except Exception as exc:  # replicas not up yet: update_replicas will tell us
            logger.info("engine warm-up call failed: %s", exc)

    async def _infer(self, path: str, request: Request) -> Response:
        t0 = time.perf_counter()
        route = route_label(path)
        from router import metrics
        try:
            raw = await _read_body(request, self.settings.max_body_bytes)
            policy = request.headers.get("x-routing-policy") \
                if self.settings.allow_policy_override else None
            resp = await self.core.handle(path, raw, t0, policy=policy)
        except OpenAIError as exc:
            metrics.inc("requests", 1, tags={"route": route, "status": str(exc.status)})
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        except (ClientDisconnect, TaskCancelledError, asyncio.CancelledError) as exc:
            # the client left (while sending its body, or before the answer started):
            # counted as nginx's 499 "client closed request", not as a router error. Serve
            # shows it as any of the three, depending on when its proxy saw the disconnect
            # (TaskCancelledError: from the body's receive call the proxy cancelled).
            metrics.inc("requests", 1, tags={"route": route, "status": "499"})
            logger.info("client closed %s before the answer started", path)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return Response(status_code=499)
        except Exception as exc:  # a bug: still an OpenAI-style body, and a log line
            logger.exception("unexpected error on %s", path)
            metrics.inc("requests", 1, tags={"route": route, "status": "500"})
            err = OpenAIError(500, f"internal router error: {type(exc).__name__}",
                              "InternalServerError")
            return JSONResponse(err.body(), status_code=500)
        metrics.inc("requests", 1, tags={"route": route, "status": str(resp.status_code)})
        return resp

    @fastapi_app.post(CHAT_PATH)
    async def chat_completions(self, request: Request) -> Response:
        return await self._infer(CHAT_PATH, request)

    @fastapi_app.post(COMPLETIONS_PATH)
    async def completions(self, request: Request) -> Response:
        return await self._infer(COMPLETIONS_PATH, request)

    @fastapi_app.get("/v1/models")
    async def models(self) -> Response:
        if state.replica_count() == 0:
            err = no_replicas()
            return JSONResponse(err.body(), status_code=503, headers=err.headers)
        # A replica whose engine is down (restarting) fails this call: ask again, Serve
        # picks a replica by load; then a JSON 503, never a plain-text 500.
        for attempt in range(3):
            try:
                return JSONResponse(await self.engine_handle.models.remote())
            except Exception as exc:
                logger.warning("model list from a replica failed (%s: %s)",
                               type(exc).__name__, exc)
        err = OpenAIError(503, "no engine replica answered the model list; retry shortly",
                          "ServiceUnavailableError", headers={"retry-after": "1"})
        return JSONResponse(err.body(), status_code=503, headers=err.headers)

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        n = state.replica_count()
        ok = n is None or n > 0
        return JSONResponse({"status": "ok" if ok else "no replicas", "replicas": n},
                            status_code=200 if ok else 503)

    @fastapi_app.get("/replicas")
    async def replicas(self) -> Response:
        """The engine replicas the router sees, with what each advertises (endpoints, hash
        settings) and its hash compatibility with this router."""
        rr = state.peek("request_router")
        running = list(rr.curr_replicas.values()) if rr is not None else []
        hs = self.settings.hash_settings
        health = state.replica_health()
        out = []
        for r in sorted(running, key=lambda r: r.replica_id.unique_id):
            md = dict(r.replica_metadata or {})
            out.append({"replica_id": r.replica_id.unique_id, "metadata": md,
                        "routing_stats": dict(r.routing_stats or {}),
                        "circuit_open": health.is_open(r.replica_id.unique_id),
                        "hash_mismatch": hash_mismatches(hs, md)})
        return JSONResponse({"replicas": out})

    @fastapi_app.get("/metrics")
    async def metrics_text(self) -> Response:
        from router.metrics import scrape_cluster_metrics
        return PlainTextResponse(await scrape_cluster_metrics(),
                                 media_type="text/plain; version=0.0.4")


def engine_deployment(settings: Settings):
    """The engine deployment with the prefix-aware ``RequestRouter`` attached."""
    from replicas.deployment import EngineReplica

    resources: dict[str, Any] = {"num_cpus": settings.replica_num_cpus}
    if settings.replica_num_gpus:
        resources["num_gpus"] = settings.replica_num_gpus
    if settings.num_replicas > 0:
        scale: dict[str, Any] = {"num_replicas": settings.num_replicas}
    else:  # Serve refuses num_replicas=0; an autoscaler pinned at zero is the same thing
        scale = {"autoscaling_config": {"min_replicas": 0, "initial_replicas": 0,
                                        "max_replicas": 1, "upscale_delay_s": 3600}}
    return serve.deployment(EngineReplica, name="EngineReplica").options(
        **scale,
        ray_actor_options=resources,
        max_ongoing_requests=settings.max_ongoing_requests,
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=20,
        request_router_config=RequestRouterConfig(
            request_router_class="router.request_router:PrefixCacheRequestRouter",
            request_router_kwargs={"settings": settings.dump()},
            request_routing_stats_period_s=2,
            request_routing_stats_timeout_s=5,
        ),
    )


def build_app(args: dict[str, Any] | None = None):
    """Ray Serve application builder: ``args`` are ``Settings`` fields."""
    settings = Settings(**(args or {}))
    if settings.model == str(DEFAULT_MODEL_DIR):
        from deploy.make_model import ensure_model
        ensure_model(DEFAULT_MODEL_DIR)
    engines = engine_deployment(settings).bind(settings.dump())
    return Ingress.options(
        num_replicas=settings.ingress_replicas,
        ray_actor_options={"num_cpus": settings.ingress_num_cpus},
        max_ongoing_requests=max(settings.max_ongoing_requests * max(settings.num_replicas, 1),
                                 100),
    ).bind(settings.dump(), engines)

