"""The one error type of the ingress and its OpenAI-style JSON body.

Every error a client sees has the shape vLLM's own server uses
(``{"error": {"message", "type", "param", "code"}}``), so clients cannot tell the router's
4xx/5xx from the engine's.
"""

from __future__ import annotations

from typing import Any


class OpenAIError(Exception):
    """An error answered to the client.

    Args:
        status: HTTP status (400, 404, 413, 503...).
        message: human-readable message.
        type: OpenAI error type, e.g. ``BadRequestError``.
        param: the offending request field, if any.
        headers: extra response headers (``Retry-After`` for 503).
    """

    def __init__(self, status: int, message: str, type: str = "BadRequestError",
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}

    def response_headers(self, router_s: float | None = None) -> dict[str, str]:
        """The error's headers, with the router's own time from the request's arrival to
        this answer as a W3C ``Server-Timing`` entry (``router;dur=<ms>``) when
        ``router_s`` (s) is given: a client can then tell the router's part of a slow 429
        from the time it spent on the way (its own CPU, the connection, the event loop's
        backlog before the handler ran)."""
        if router_s is None:
            return dict(self.headers)
        return {**self.headers, "server-timing": f"router;dur={router_s * 1e3:.3f}"}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "BadRequestError", param)


# vLLM answers a body that fails its request schema (FastAPI's RequestValidationError) with
# type "Bad Request" (http.HTTPStatus.BAD_REQUEST.phrase) and ``param`` the dotted location
# from "body" ("body.messages"); other 400s, such as a prompt longer than the model, with
# "BadRequestError" (vllm/entrypoints/serve/exception_handling/handlers/validation.py).
VALIDATION_ERROR_TYPE = "Bad Request"
UNSUPPORTED_MEDIA_TYPE = ("1 validation error:\n  Unsupported Media Type: Only "
                          "'application/json' is allowed")


def invalid_body(message: str, loc: str | None = None) -> OpenAIError:
    """A 400 for a body that fails the request schema, in vLLM's dialect of them.

    Args:
        message: what is wrong.
        loc: the field's dotted path inside the body ("messages.0.role"), or None for the
            body as a whole; ``param`` becomes ``"body"`` or ``"body.<loc>"`` as vLLM's.
    """
    return OpenAIError(400, message, VALIDATION_ERROR_TYPE,
                       f"body.{loc}" if loc else "body")


def require_json(content_type: str | None) -> None:
    """Refuse a body that is not declared ``application/json`` as vLLM's server does (its
    ``validate_json_request``: the media type before any parameter, compared in lower case).

    Raises:
        OpenAIError: 400 with vLLM's own message, type and ``param`` (None).
    """
    media = (content_type or "").lower().split(";", 1)[0].strip()
    if media != "application/json":
        raise OpenAIError(400, UNSUPPORTED_MEDIA_TYPE, VALIDATION_ERROR_TYPE, None)


def no_replicas(retry_after_s: int = 5) -> OpenAIError:
    return OpenAIError(503, "no engine replica is available; retry later",
                       "ServiceUnavailableError", headers={"Retry-After": str(retry_after_s)})
