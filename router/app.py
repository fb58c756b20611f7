"""The Ray Serve application: the ingress deployment in front of the engine deployment.

``serve run deploy/cpu.yaml`` (or ``python -m deploy.run``) calls ``build_app(args)``; the
YAML's ``args`` are ``Settings`` fields and override the environment and the config file.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from typing import Any

import ray
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.config import RequestRouterConfig
from starlette.requests import ClientDisconnect

from router.config import DEFAULT_MODEL_DIR, Settings
from router.index.base import IndexUnavailable
from router.logs import get_logger
from router.prompt.render import CHAT_PATH, COMPLETIONS_PATH
from router.routing.replica import ReplicaMetadata, hash_mismatches
from router.serve import state
from router.serve.admission import TenantSlots
from router.serve.auth import ApiKeys
from router.serve.errors import OpenAIError, no_replicas, require_json
from router.serve.ingress import IngressCore, build_fastapi_app, json_object
from router.serve.protocol import route_label
from router.serve.schemas import openapi_route

logger = get_logger(__name__)

fastapi_app = build_fastapi_app()


def _enum_name(value) -> str:
    """A Serve status's name as its API spells it (``UPDATING``, ``RUNNING``): the value of
    Serve's string enums, whose ``str()`` is ``DeploymentStatus.UPDATING``."""
    return str(getattr(value, "value", value)).rsplit(".", 1)[-1]


def header_value(request: Request, name: str) -> str | None:
    """The value of header ``name``, matched without regard to case or to '-' versus '_'
    (some clients and proxies spell ``x-session-id`` as ``X_Session_Id``)."""
    want = name.lower().replace("_", "-")
    for key, value in request.headers.items():
        if key.lower().replace("_", "-") == want:
            return value
    return None


async def _read_body(request: Request, settings: Settings) -> bytes:
    """The request body, refused with 413 beyond ``settings.max_body_bytes`` bytes
    (docs/fault-cases.md 10.2), and with 408 when it stops arriving for
    ``settings.body_idle_timeout_s`` seconds.

    Raises:
        OpenAIError: 413 or 408.
    """
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        logger.warning("request body of %s bytes refused (limit %d)", declared, limit)
        raise OpenAIError(413, f"request body exceeds the router's limit of {limit} bytes "
                               "(setting max_body_bytes)", "RequestTooLargeError")
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            # a deadline on this task rather than wait_for's task per chunk (Python 3.11+)
            async with asyncio.timeout(settings.body_idle_timeout_s):
                chunk = await stream.__anext__()
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            logger.warning("request body stalled for %.0f s after %d bytes: 408",
                           settings.body_idle_timeout_s, size)
            # the unread rest of the body makes the connection unusable: closed after the
            # answer (a client that sent the next request on it would wait for nothing)
            raise OpenAIError(408, f"the request body stopped arriving for "
                                   f"{settings.body_idle_timeout_s:g} s (setting "
                                   "body_idle_timeout_s)", "RequestTimeoutError",
                              headers={"connection": "close"}) from None
        size += len(chunk)
        if size > limit:
            logger.warning("request body over %d bytes refused", limit)
            raise OpenAIError(413, f"request body exceeds the router's limit of {limit} bytes "
                                   "(setting max_body_bytes)", "RequestTooLargeError")
        if chunk:  # Starlette's stream ends with an empty chunk
            chunks.append(chunk)
    # a body that came in one chunk is not copied: joining a 134 KB body cost 0.08-0.15 ms
    # in a burst (each copy, kept for the request's life, lands on fresh pages)
    return bytes(chunks[0]) if len(chunks) == 1 else b"".join(chunks)


def with_adapters(content: bytes, adapters) -> bytes:
    """An engine's ``/v1/models`` answer with a card for every configured LoRA adapter
    (``config.LoraAdapter``) it lacks: one engine answers, and adapters loaded on some
    replicas only are missing from the others' lists. A card is the base model's, with the
    adapter's ``id``, its path as ``root`` and the base model as ``parent``, as vLLM lists
    the adapters it loads. An answer that is not such a list is returned unchanged."""
    try:
        listing = json.loads(content)
        cards = listing["data"]
        base = next(c for c in cards if c.get("parent") is None)
    except (ValueError, KeyError, TypeError, StopIteration):
        return content
    have = {c.get("id") for c in cards}
    for a in adapters:
        if a.name not in have:
            cards.append({**base, "id": a.name, "root": a.path, "parent": base.get("id")})
    return json.dumps(listing).encode()


def health_of(infos, configured: int) -> tuple[int, dict[str, Any]]:
    """``/health``'s status code and body for the replicas known (``infos``: a sequence of
    ``router.routing.replica.ReplicaInfo``, None before any replica set is known) and the
    ``configured`` count of replicas (Serve's and external engines').

    200 while at least one replica can serve: its engine is up or not known to be down
    (routing passes over engines reported down, ``engine_alive`` false); 503 while none
    can (no replica set known yet, none left, or every engine reported down). The body:
    ``status`` (``starting``, ``no replicas``, ``ok`` or ``degraded``), ``ready`` (every
    configured replica's engine is up, and at least one), ``replicas``, ``engines_alive``
    and ``configured_replicas``."""
    n = None if infos is None else len(infos)
    alive = sum(1 for i in infos or () if i.stats.engine_alive)
    can_serve = any(i.stats.engine_alive is not False for i in infos or ())
    ready = n is not None and alive >= max(configured, 1)
    status = ("starting" if n is None else "no replicas" if n == 0 else
              "ok" if ready else "degraded")
    return (200 if can_serve else 503), {
        "status": status, "ready": ready, "replicas": n, "engines_alive": alive,
        "configured_replicas": configured}


# Serve's replica states of a replica it keeps (not one it stops): ray.serve._private.common
# ReplicaState, as serve.status() reports them; PENDING_MIGRATION not (a replica on a
# draining node: its replacement is STARTING)
_KEPT_REPLICA_STATES = frozenset({"STARTING", "UPDATING", "RECOVERING", "RUNNING"})
# the deployment's states in which its replicas are the ones its config asks for (while
# it deploys, UPDATING, Serve may not have made them all yet)
_SETTLED_DEPLOYMENT_STATES = frozenset({"HEALTHY", "UNHEALTHY", "UPSCALING", "DOWNSCALING"})


def engine_replicas_configured(settings, deployment: dict | None) -> int:
    """The engine replicas ``/health`` is ``ready`` with, Serve's own: with a fixed count,
    the replicas Serve keeps of the engine deployment (those not stopping, from
    ``serve.status()``, as ``_engine_deployment_status`` gives it), so that a
    ``deployments:`` override of ``num_replicas`` (applied in place, the application's
    arguments unchanged) is counted; ``settings.configured_replicas`` (``num_replicas``, or
    with autoscaling ``min_replicas``) while Serve's status is not known or the deployment
    is still being deployed or updated. ``deployment``: ``{"status": "X", "replica_states":
    {state: count}}`` (Serve's enums or their names, ``_enum_name``) or None."""
    if deployment is None or settings.autoscaling_config is not None \
            or not settings.engines_in_ray:
        return settings.configured_replicas
    status = _enum_name(deployment.get("status", ""))
    if status not in _SETTLED_DEPLOYMENT_STATES:
        return settings.configured_replicas
    kept = sum(int(n) for st, n in (deployment.get("replica_states") or {}).items()
               if _enum_name(st) in _KEPT_REPLICA_STATES)
    return kept or settings.configured_replicas


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then move every object still alive to the garbage
    collector's permanent generation (``gc.freeze``): later collections, the full ones
    included, walk only the objects made since. An ingress process holds about 0.6 M
    objects after start-up (Ray, vLLM's request models, torch, the tokenizer), and a full
    collection over them took about 300 ms on the 2-core VM, during which the process
    serves nothing; after the freeze, a few microseconds (docs/benchmarks.md, "Start-up
    objects and the garbage collector"). vLLM's API server does the same after its own
    start-up (``vllm.utils.gc_utils.freeze_gc_heap``). Objects frozen are still freed when
    their reference count falls to zero; only reference cycles among them are never
    collected.

    Returns:
        The number of objects frozen (``gc.get_freeze_count()``).
    """
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("start-up heap frozen: %d objects out of the garbage collector's walks "
                "(%.0f ms)", frozen, (time.perf_counter() - t0) * 1e3)
    return frozen


@serve.deployment(name="Ingress")
@serve.ingress(fastapi_app)
class Ingress:
    """OpenAI-compatible HTTP front door (see ``router.serve.ingress``)."""

    def __init__(self, settings: dict[str, Any], engine_handle):
        self.settings = Settings(**settings)
        self.keys = ApiKeys(self.settings.api_keys_file, self.settings.api_keys)
        self.core = IngressCore(self.settings, engine_handle)
        self.engine_handle = engine_handle
        self._status_cache: tuple[float, dict | None] | None = None
        self._status_call: asyncio.Future | None = None  # Serve's status, asked in a thread
        self.tenant_slots = TenantSlots(self.settings.tenant_inflight_limit)
        self.fleet = None
        if self.settings.external_engines or self.settings.external_engines_file:
            from replicas.external import ExternalFleet
            self.fleet = ExternalFleet(
                self.settings, state.make_index(self.settings),
                on_removed=self.core.routing_core().forget_replica,
                publish=lambda infos: state.put("external_replicas", infos),
                client=self.core.engine_client())
            self.fleet.start()
        if self.settings.gc_freeze_at_start:
            freeze_startup_heap()
        # The handle creates its router on first use; one call makes it learn the replica
        # set now, so /health and the 503 check know the replica count before traffic.
        self._warmup = asyncio.get_event_loop().create_task(self._warm_up())

    async def __del__(self):
        """Serve's stop hook (it awaits an async ``__del__``): close the pooled engine
        connections and the external fleet's watchers."""
        if getattr(self, "fleet", None) is not None:
            await self.fleet.stop()
        if getattr(self, "core", None) is not None:
            await self.core.close()

    async def _warm_up(self, timeout_s: float = 30.0) -> None:
        """Ping one engine replica through the handle, so that its router starts and hears
        of the replica set. With no replica started yet the call waits in the handle's
        queue, where it would count as demand for an autoscaler: it is cancelled after
        ``timeout_s``; the router stays. With none in Ray (``num_replicas`` 0: external
        engines only) no call is made: Serve scales a deployment from zero at its first
        queued call, and started an engine replica that no one asked for. Opens the
        process's Redis connections first (``IngressCore.open_connections``)."""
        await self.core.open_connections()
        if not self.settings.engines_in_ray:
            return  # a call would make Serve start one from zero
        response = self.engine_handle.ping.remote()
        try:
            async with asyncio.timeout(timeout_s):
                await response
        except TimeoutError:  # replicas not up yet: update_replicas will tell us
            response.cancel()
            logger.info("no engine replica answered within %.0f s of this ingress's start "
                        "(engines still starting): the replica set is learnt as they come "
                        "up", timeout_s)
        except Exception as exc:
            response.cancel()
            logger.info("engine warm-up call failed: %s", type(exc).__name__)

    @contextlib.asynccontextmanager
    async def _tenant_body(self, request: Request):
        """What every route that takes a body does first: authenticate the caller, require
        JSON, take one of the tenant's slots (``tenant_max_inflight``), read the body.
        Yields ``(tenant, raw body bytes, slot)``; the slot is held until the block ends
        (or ``slot.release()``).

        Raises:
            OpenAIError: 401 (keys), 400 (not JSON, vLLM's answer), 429 (the tenant's
                slots), 413 or 408 (``_read_body``).
        """
        tenant = self.keys.authenticate(request.headers.get("authorization"))
        require_json(request.headers.get("content-type"))
        with self.tenant_slots.take(tenant.name if tenant is not None else None) as slot:
            yield tenant, await _read_body(request, self.settings), slot

    async def _infer(self, path: str, request: Request) -> Response:
        t0 = time.perf_counter()
        route = route_label(path)
        from router import metrics
        try:
            async with self._tenant_body(request) as (tenant, raw, slot):
                resp = await self.core.handle(
                    path, raw, t0, body_s=time.perf_counter() - t0,
                    policy=request.headers.get("x-routing-policy"),
                    data_path=request.headers.get("x-data-path"), tenant=tenant,
                    priority=request.headers.get(self.settings.priority_header),
                    session=header_value(request, self.settings.session_header),
                    prepared=slot.release)
        except OpenAIError as exc:
            metrics.inc("requests", 1, tags={"route": route, "status": str(exc.status)})
            return JSONResponse(exc.body(), status_code=exc.status,
                                headers=exc.response_headers(time.perf_counter() - t0))
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
            return JSONResponse(err.body(), status_code=500,
                                headers=err.response_headers(time.perf_counter() - t0))
        metrics.inc("requests", 1, tags={"route": route, "status": str(resp.status_code)})
        return resp

    @fastapi_app.post(CHAT_PATH, **openapi_route(CHAT_PATH, stream=True))
    async def chat_completions(self, request: Request) -> Response:
        return await self._infer(CHAT_PATH, request)

    @fastapi_app.post(COMPLETIONS_PATH, **openapi_route(COMPLETIONS_PATH, stream=True))
    async def completions(self, request: Request) -> Response:
        return await self._infer(COMPLETIONS_PATH, request)

    @fastapi_app.get("/v1/models", **openapi_route(None))
    async def models(self, request: Request) -> Response:
        self.keys.authenticate(request.headers.get("authorization"))
        resp = await self._any_engine("GET", "/v1/models")
        if resp.status_code != 200 or not self.settings.lora_adapters:
            return resp
        return Response(with_adapters(resp.body, self.settings.lora_adapters),
                        status_code=200, headers={k: v for k, v in resp.headers.items()
                                                  if k.lower() != "content-length"})

    @fastapi_app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``, answered by an engine (clients such as vLLM's benchmark
        align prompts with it); the router's own routing never calls it."""
        return await self._tokens(request, "/tokenize")

    @fastapi_app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``, answered by an engine."""
        return await self._tokens(request, "/detokenize")

    async def _tokens(self, request: Request, path: str) -> Response:
        """``/tokenize`` and ``/detokenize`` as the inference routes take a request: the
        tenant's slot (``tenant_max_inflight``), a JSON object (an OpenAI-style 400, not the
        engine's), and the tenant's rate limits, a request and, for tokens, its body's bytes
        (at most a token per byte: a 10 MB text kept the engines busy for 19 s, with every
        other tenant's requests waiting); a text longer than any prompt of the model, or
        more tokens than its context, is refused before an engine sees it
        (``IngressCore.check_tokens_body``)."""
        async with self._tenant_body(request) as (tenant, raw, _):
            self.core.check_tokens_body(path, json_object(raw))
            await self.core.rate_limits.check(tenant, len(raw))
            return await self._any_engine("POST", path, raw)

    async def _any_engine(self, method: str, path: str, body: bytes | None = None) -> Response:
        """An endpoint every engine answers alike, from one that is up: 503 with no replica
        or when none answered (JSON, never a plain-text 500)."""
        if state.replica_count() == 0:
            err = no_replicas()
            return JSONResponse(err.body(), status_code=503, headers=err.headers)
        try:
            status, headers, content = await self.core.any_engine(method, path, body)
        except OpenAIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        return Response(content, status_code=status, headers=headers)

    @fastapi_app.api_route("/health", methods=["GET", "HEAD"])
    async def health(self) -> Response:
        """200 while at least one engine replica can serve, 503 while none can
        (``health_of``), with what a load balancer and an operator need to tell apart:
        ``ready`` once every configured replica's engine is up, ``degraded`` while some are
        missing or down (and then Serve's own status of the engine deployment, which names
        a replica that keeps failing its start)."""
        deployment = await self._engine_deployment_status()
        configured = engine_replicas_configured(self.settings, deployment) + \
            (len(self.fleet.replicas) if self.fleet is not None else 0)
        code, body = health_of(state.replica_infos(), configured)
        if not body["ready"]:
            body["engine_deployment"] = deployment
        return JSONResponse(body, status_code=code)

    async def _engine_deployment_status(self) -> dict | None:
        """The engine deployment's status as Serve's controller reports it (its state,
        message and replica states), asked at most every 5 s, one call at a time, waited for
        at most 1 s (then the last known, so a slow controller never holds up a health
        probe); None when it cannot tell, and None at once where there is no engine
        deployment to ask about (``num_replicas`` 0) or no Ray to ask (this class made
        outside Ray Serve, as the benchmarks do: ``serve.status()`` would start a local
        Ray instance there, from a thread, whose agents outlive the process)."""
        if not self.settings.engines_in_ray or not ray.is_initialized():
            return None
        now = time.monotonic()
        cached = self._status_cache[1] if self._status_cache is not None else None
        if self._status_cache is not None and now - self._status_cache[0] < 5.0:
            return cached
        if self._status_call is None or self._status_call.done():
            self._status_call = asyncio.ensure_future(asyncio.to_thread(serve.status))
        out = cached
        try:  # a probe waits at most a second (the call goes on; one at a time)
            st = await asyncio.wait_for(asyncio.shield(self._status_call), 1.0)
            out = None
            app_name = serve.get_replica_context().app_name
            dep = st.applications[app_name].deployments.get("EngineReplica")
            if dep is not None:
                out = {"status": _enum_name(dep.status), "message": dep.message,
                       "replica_states": {_enum_name(k): v
                                          for k, v in dep.replica_states.items()}}
        except asyncio.TimeoutError:
            logger.debug("engine deployment status: Serve's controller is slow")
            return out  # the last one known, asked again at the next probe
        except Exception as exc:  # outside Serve (tests), or the controller is busy
            logger.debug("engine deployment status unavailable: %s", exc)
        self._status_cache = (now, out)
        return out

    @fastapi_app.get("/replicas")
    async def replicas(self, request: Request) -> Response:
        """The engine replicas the router sees (Serve's, then the engines reached by URL),
        each with what it advertises (endpoints, hash settings), its routing stats, its
        hash compatibility with this router, its circuit and drain state, how routing
        treats it (``mode``: ``exact`` from its KV events, ``predicted`` from the router's
        own predictions, ``degraded`` while its engine is down, its circuit open or its
        hashing differs) and the blocks the index holds for it (``blocks_held``, exact
        entries; None when the index does not answer). An admin key's, with keys."""
        self.keys.authorize_admin(request.headers.get("authorization"))
        rr = state.peek("request_router")
        running = sorted(rr.curr_replicas.values() if rr is not None else [],
                         key=lambda r: r.replica_id.unique_id)
        infos = [(r.replica_id.unique_id, ReplicaMetadata.from_dict(r.replica_metadata),
                  dict(r.replica_metadata or {}), dict(r.routing_stats or {}), False)
                 for r in running]
        infos += [(i.replica_id, i.metadata, i.metadata.to_dict(), i.stats.to_dict(), True)
                  for i in state.peek("external_replicas") or ()]
        health = state.replica_health()
        drained = await state.make_drains(self.settings).refresh()
        index = self.core.prefix_index()
        out = []
        for rid, md, md_dict, stats, external in infos:
            mismatch = hash_mismatches(self.settings.hash_settings, md)
            circuit_open = health.is_open(rid)
            try:
                held = await index.exact_entry_count(rid)
            except IndexUnavailable:
                held = None
            mode = "degraded" if stats.get("engine_alive") is False or circuit_open \
                or mismatch else "exact" if md.hash_probe == "ok" \
                and stats.get("kv_events_live") is not False else "predicted"
            row = {"replica_id": rid, "mode": mode, "blocks_held": held, "metadata": md_dict,
                   "routing_stats": stats, "circuit_open": circuit_open,
                   "drained": rid in drained, "hash_mismatch": mismatch}
            if external:
                row["external"] = True
            out.append(row)
        return JSONResponse({"replicas": out})

    @fastapi_app.post("/admin/replicas/{replica_id}/drain")
    async def drain(self, replica_id: str, request: Request) -> Response:
        """Drain a replica (an admin key's, with keys): from every router's next decision
        on (within a second) it takes no new request unless no other replica is left; its
        requests in flight finish. ``router.routing.drain``."""
        return await self._set_drained(replica_id, request, True)

    @fastapi_app.post("/admin/replicas/{replica_id}/undrain")
    async def undrain(self, replica_id: str, request: Request) -> Response:
        """Undo ``drain``: the replica takes requests again."""
        return await self._set_drained(replica_id, request, False)

    async def _set_drained(self, replica_id: str, request: Request,
                           drained: bool) -> Response:
        """Raises: OpenAIError 404 for a replica the router does not know, 503 when Redis
        did not take the change (nothing changed)."""
        self.keys.authorize_admin(request.headers.get("authorization"))
        if replica_id not in (state.replica_ids() or ()):
            raise OpenAIError(404, f"no engine replica {replica_id!r} (GET /replicas lists "
                                   "them)", "NotFoundError", "replica_id")
        drains = state.make_drains(self.settings)
        try:
            now = await drains.set(replica_id, drained)
        except IndexUnavailable as exc:
            raise OpenAIError(503, f"the drained set was not changed: {exc}",
                              "ServiceUnavailableError") from None
        logger.warning("replica %s %s by an operator", replica_id,
                       "drained" if drained else "undrained")
        body: dict[str, Any] = {"replica_id": replica_id, "drained": drained,
                                "drained_replicas": sorted(now), "shared": drains.shared}
        if not drains.shared and self.settings.ingress_replicas > 1:
            body["warning"] = ("without redis_url each ingress process keeps its own drained "
                               "set: this call reached one of "
                               f"{self.settings.ingress_replicas}")
        return JSONResponse(body)

    @fastapi_app.post("/admin/explain")
    async def explain(self, request: Request, route: str = "chat") -> Response:
        """Why a request would go where it goes (an admin key's, with keys): the body is an
        inference request's (``route``: ``chat`` for /v1/chat/completions, ``completions``
        for /v1/completions), hashed as the calling key's tenant's would be; the answer is
        ``RoutingCore.explain``'s (candidates best first with their matched blocks, loads
        and costs, the choice), with nothing reserved or written. The policy is the
        ``x-routing-policy`` header's (with ``allow_policy_override``) or the default, as
        this ingress holds it: on ``data_path: serve`` the Ray router decides with its own
        copy (the same rule and state, other counters and random draws).

        Raises:
            OpenAIError: 400 for another ``route`` or a malformed body, 503 with no replica
                or when the index cannot be read.
        """
        from router.serve.errors import bad_request

        tenant = self.keys.authorize_admin(request.headers.get("authorization"))
        paths = {"chat": CHAT_PATH, "completions": COMPLETIONS_PATH}
        if route not in paths:
            raise bad_request("route must be 'chat' or 'completions'", "route")
        require_json(request.headers.get("content-type"))
        policy_name = request.headers.get("x-routing-policy")
        self.core.check_policy(policy_name)
        try:
            raw = await _read_body(request, self.settings)
            req = await self.core.prepare(paths[route], raw, policy_name, tenant)
            if req.rest is not None:  # explained on every block, held head or not
                await req.rest.finish(req)
            infos = await self.core.replica_set()
            out = await self.core.routing_core().explain(
                req.prompt_tokens, req.block_hashes, infos, self.core.policies.get(policy_name),
                cacheable=bool(req.block_hashes), adapter=req.lora_name)
        except IndexUnavailable as exc:
            raise OpenAIError(503, f"the index could not be read: {exc}",
                              "ServiceUnavailableError") from None
        except ClientDisconnect:
            return Response(status_code=499)
        except OpenAIError:
            raise
        except Exception as exc:  # a bug: still an OpenAI-style body, and a log line
            logger.exception("explain failed")
            raise OpenAIError(500, f"internal router error: {type(exc).__name__}",
                              "InternalServerError") from None
        return JSONResponse(out)

    @fastapi_app.get("/metrics")
    async def metrics_text(self, request: Request) -> Response:
        """Prometheus text of every router and engine process (an admin key's, with keys:
        Prometheus sends one with its scrape config's ``authorization``)."""
        self.keys.authorize_admin(request.headers.get("authorization"))
        from router.metrics import MetricsUnavailable, scrape_cluster_metrics
        try:
            text = await scrape_cluster_metrics()
        except MetricsUnavailable as exc:  # a failed scrape (up == 0), not an empty one
            logger.warning("metrics scrape failed: %s", exc)
            raise OpenAIError(503, f"metrics unavailable: {exc}",
                              "ServiceUnavailableError") from None
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def engine_deployment(settings: Settings):
    """The engine deployment with the prefix-aware ``RequestRouter`` attached."""
    from replicas.deployment import EngineReplica

    resources: dict[str, Any] = {"num_cpus": settings.replica_num_cpus}
    if settings.replica_num_gpus:
        resources["num_gpus"] = settings.replica_num_gpus
    if settings.autoscaling_config is not None:  # Serve's autoscaler, on the engines' load
        from router.serve.autoscaling import engine_autoscaling_config
        scale: dict[str, Any] = {
            "autoscaling_config": engine_autoscaling_config(settings.autoscaling_config)}
    elif settings.engines_in_ray:
        scale = {"num_replicas": settings.num_replicas}
    else:  # Serve refuses num_replicas=0; an autoscaler pinned at zero is the same thing
        scale = {"autoscaling_config": {"min_replicas": 0, "initial_replicas": 0,
                                        "max_replicas": 1, "upscale_delay_s": 3600}}
    return serve.deployment(EngineReplica, name="EngineReplica").options(
        **scale,
        ray_actor_options=resources,
        max_ongoing_requests=settings.max_ongoing_requests,
        max_replicas_per_node=settings.max_replicas_per_node,
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=settings.drain_timeout_s + 30,  # the drain, then the stop
        request_router_config=RequestRouterConfig(
            request_router_class="router.serve.request_router:PrefixCacheRequestRouter",
            request_router_kwargs={"settings": settings.dump()},
            request_routing_stats_period_s=2,
            request_routing_stats_timeout_s=5,
        ),
    )


def build_app(args: dict[str, Any] | None = None):
    """Ray Serve application builder: ``args`` are ``Settings`` fields.

    Raises:
        ValueError: a setting is given twice with different values (in ``args`` and in a
            ``PREFIX_ROUTER_*`` variable or the config file): ``args`` would win silently,
            and the operator would run something else than asked.
    """
    conflicts = Settings.given_twice(args or {})
    if conflicts:
        raise ValueError("settings given twice with different values (the application's "
                         "args win over the environment; remove one): " + "; ".join(conflicts))
    settings = Settings(**(args or {}))
    ApiKeys(settings.api_keys_file, settings.api_keys)  # a bad keys file fails here, clearly
    logger.info("prefix-router settings: %s", json.dumps(settings.redacted(), sort_keys=True))
    shape = "tiny" if settings.model == str(DEFAULT_MODEL_DIR) else settings.generate_model_shape
    if shape:
        from deploy.make_model import ensure_model
        ensure_model(settings.model, shape)
    engines = engine_deployment(settings).bind(settings.dump())
    return Ingress.options(
        num_replicas=settings.ingress_replicas,
        # a stopping ingress replica (app deleted, redeployed) finishes the requests it
        # relays, streams included, as long as an engine replica drains (deploy/stop.py)
        graceful_shutdown_timeout_s=settings.drain_timeout_s + 30,
        ray_actor_options={"num_cpus": settings.ingress_num_cpus},
        max_ongoing_requests=settings.ingress_max_ongoing,
    ).bind(settings.dump(), engines)

