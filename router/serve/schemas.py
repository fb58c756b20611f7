"""The fields of OpenAI requests the router reads, as pydantic models mirroring OpenAI's
schema: malformed JSON or a wrong type becomes an OpenAI-style 400; every other field
passes through to the engine untouched (the client's body is forwarded byte for byte)."""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from router.prompt.render import CHAT_PATH, COMPLETIONS_PATH


class ChatMessage(BaseModel):
    """One chat message: its role and content; other fields pass through."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list, None] = None


class StreamOptions(BaseModel):
    """``stream_options``: whether the stream ends with a usage chunk."""

    model_config = ConfigDict(extra="allow")
    include_usage: Optional[bool] = None


class ChatRequest(BaseModel):
    """The fields of a chat request the router reads; every other field passes through."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    messages: list[ChatMessage]
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    tools: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    cache_salt: Optional[str] = None


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    prompt: Union[str, list[str], list[int], list[list[int]], None] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    cache_salt: Optional[str] = None


SCHEMAS = {CHAT_PATH: ChatRequest, COMPLETIONS_PATH: CompletionRequest}


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The first validation error as an OpenAI-style message and its ``param`` (the
    field's dotted path)."""
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    return f"invalid request: {loc}: {err.get('msg')}", loc or None


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.rsplit("/", 1)[1]], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def request_body_schema(path: str) -> dict[str, Any]:
    """The JSON schema of the body the router reads at ``path``, self-contained (its
    ``$defs`` inlined), for the OpenAPI document: the fields the router checks; every other
    field passes through to the engine."""
    schema = SCHEMAS[path].model_json_schema()
    return _inline_refs(schema, schema.get("$defs", {}))


ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["integer", "string", "null"]}}}}}


def openapi_route(path: str | None, *, stream: bool = False) -> dict[str, Any]:
    """``openapi_extra`` and ``responses`` of a route for FastAPI: its request body (the
    schema of ``path``, or none), its answers (an OpenAI-style JSON object, or an SSE stream)
    and every error status the router or the engine gives, in the one error shape."""
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if stream:  # each event's data: a chunk (or an error) object, and last "[DONE]"
        ok["text/event-stream"] = {"schema": {"anyOf": [
            {"type": "object"}, {"type": "string", "const": "[DONE]"}]}}
    responses: dict[Any, Any] = {200: {"description": "the engine's answer", "content": ok}}
    for status, why in ((400, "invalid request (the router's or the engine's)"),
                        (401, "no or unknown API key"), (403, "not an admin key"),
                        (404, "unknown model or path"),
                        (408, "body stalled for body_idle_timeout_s"),
                        (413, "body over max_body_bytes"),
                        (429, "rate limit or overload"), (499, "the client left"),
                        (500, "internal error"), (502, "engine failed"),
                        (503, "no replica")):
        responses[status] = {"description": why,
                             "content": {"application/json": {"schema": ERROR_SCHEMA}}}
    extra: dict[str, Any] = {}
    if path is not None:
        extra["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": request_body_schema(path)}}}
    return {"openapi_extra": extra, "responses": responses}
