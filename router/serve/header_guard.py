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
as Latin-1 (Starlette) and validates its own.
"""

from __future__ import annotations

import json
import os

from router.serve.errors import bad_request

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


class HeaderGuard:
    """ASGI middleware: a request with a header Ray's proxy cannot decode
    (``undecodable_header``) is answered 400 with an OpenAI-style JSON body naming the
    header (``param``); every other request goes on unchanged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        bad = undecodable_header(scope.get("headers", ())) if scope["type"] == "http" else None
        if bad is None:
            return await self.app(scope, receive, send)
        body = json.dumps(bad_request(f"request header {bad!r} is not UTF-8 text",
                                      bad).body()).encode()
        await send({"type": "http.response.start", "status": 400, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list:
    """What ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names: the middlewares Ray Serve's
    HTTP proxy wraps its app in (a list of ``starlette.middleware.Middleware``)."""
    from starlette.middleware import Middleware

    return [Middleware(HeaderGuard)]
