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


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "BadRequestError", param)


def no_replicas(retry_after_s: int = 5) -> OpenAIError:
    return OpenAIError(503, "no engine replica is available; retry later",
                       "ServiceUnavailableError", headers={"Retry-After": str(retry_after_s)})
