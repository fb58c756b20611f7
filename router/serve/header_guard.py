"""Request headers Ray Serve's HTTP proxy would fail on, answered with a 400 before it reads
them.

Ray Serve's proxy decodes, as UTF-8, the name of every request header and the values of the
session header (``x-session-id``, ``RAY_SERVE_SESSION_ID_HEADER_KEY``), ``x-request-id`` and
``serve_multiplexed_model_id`` (``ray.serve._private.proxy``,
``setup_request_context_and_handle``, Ray 2.60). A byte that is not UTF-8 there (HTTP allows
any octet above 0x7F in a value) raised ``UnicodeDecodeError`` in the proxy: the client got
a plain-text 500, and nothing was logged. ``HeaderGuard`` runs in the proxy, ahead of that
code, as a Starlette middleware that Serve's proxy loads from
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=router.serve.header_guard:proxy_middlewares``
(``deploy/run.sh`` and the Kubernetes manifests set it): such a request gets an OpenAI-style
400 naming the header. Every other header is left to the application, which reads values
as Latin-1 (Starlette) and validates its own. (A header *name* with a byte above 0x7F never
gets here behind uvicorn: a name must be an HTTP token, and its parser answers the request
with its own plain-text 400, "Invalid HTTP request received.", before any middleware runs.
The guard checks names too, for servers that pass them on.)

The guard also bounds the headers' size: more than ``max_header_bytes()`` bytes of names
and values together (64 KiB unless ``PREFIX_ROUTER_MAX_HEADER_BYTES`` says otherwise) get an
OpenAI-style 431. Neither uvicorn's parser (with httptools) nor Serve's proxy bounds them: a
break test sent 200 headers of 8 KB (1.6 MB) and got a 200, each request's headers held in
memory by the proxy and the ingress. 64 KiB is above what clients send (nginx refuses a
request line or header line over 8 KiB by default, ``large_client_header_buffers``; Node's
HTTP server refuses more than 16 KiB of headers, ``--max-http-header-size``).
"""

from __future__ import annotations

import json
import logging
import os

from router.serve.errors import OpenAIError, bad_request

# the headers whose values Ray's proxy decodes (names compared as it compares them:
# lower case, '-' and '_' alike)
_REQUEST_ID = "x-request-id"
_MULTIPLEXED_MODEL_ID = "serve_multiplexed_model_id"


def _norm(name: str) -> str:
    return name.lower().replace("-", "_")


def undecodable_header(headers) -> str | None:
    """The first header of ``headers`` (ASGI ``(name, value)`` byte pairs) that Ray's proxy
    would fail to decode: a name that is not UTF-8, or a value that is not UTF-8 under a
    name the proxy decodes the value of. Returns its name as sent (Latin-1 decoded), or
    None."""
    decoded = {_norm(os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id")),
               _norm(_REQUEST_ID), _norm(_MULTIPLEXED_MODEL_ID)}
    for name, value in headers:
        try:
            text = name.decode()
        except UnicodeDecodeError:
            return name.decode("latin-1")
        if _norm(text) in decoded:
            try:
                value.decode()
            except UnicodeDecodeError:
                return text
    return None


def max_header_bytes() -> int:
    """The most bytes of header names and values a request may carry
    (``Settings.max_header_bytes``): ``PREFIX_ROUTER_MAX_HEADER_BYTES`` as Serve's proxy
    process, which the guard runs in, has it (from the environment its Ray node started
    with: ``deploy/run.sh``'s), else the setting's default. A value that is not a positive
    integer is logged and the default taken: raising here would take Serve's proxy, and
    every request through it, down (the ingress refuses such a value at its start,
    ``Settings``)."""
    from router.config import Settings

    default = Settings.model_fields["max_header_bytes"].default
    raw = os.environ.get("PREFIX_ROUTER_MAX_HEADER_BYTES", "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) <= 0:
        logging.getLogger(__name__).error(
            "PREFIX_ROUTER_MAX_HEADER_BYTES=%r is not a positive integer: the header guard "
            "takes %d", raw, default)
        return default
    return int(raw)


class HeaderGuard:
    """ASGI middleware: a request with a header Ray's proxy cannot decode
    (``undecodable_header``) is answered 400 with an OpenAI-style JSON body naming the
    header (``param``), one whose headers take more than ``limit`` bytes (names and values;
    default ``max_header_bytes()``) 431; every other request goes on unchanged."""

    def __init__(self, app, limit: int | None = None):
        self.app = app
        self.limit = max_header_bytes() if limit is None else limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers", ())
        size = sum(len(name) + len(value) for name, value in headers)
        if size > self.limit:
            err = OpenAIError(431, f"the request's headers take {size} bytes, over the "
                                   f"router's limit of {self.limit} "
                                   "(PREFIX_ROUTER_MAX_HEADER_BYTES)",
                              "RequestHeaderFieldsTooLargeError")
            return await _answer(send, err)
        bad = undecodable_header(headers)
        if bad is None:
            return await self.app(scope, receive, send)
        await _answer(send, bad_request(f"request header {bad!r} is not UTF-8 text", bad))


async def _answer(send, err: OpenAIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list:
    """What ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names: the middlewares Ray Serve's
    HTTP proxy wraps its app in (a list of ``starlette.middleware.Middleware``)."""
    from starlette.middleware import Middleware

    return [Middleware(HeaderGuard)]
