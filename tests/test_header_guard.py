"""``router.serve.header_guard``: headers Ray Serve's proxy cannot decode get a 400."""

from __future__ import annotations

import json

import pytest

from router.serve.header_guard import HeaderGuard, proxy_middlewares, undecodable_header


def test_the_headers_rays_proxy_decodes_must_be_utf8():
    ok = [(b"content-type", b"application/json"), (b"x-session-id", "café".encode()),
          (b"x-note", b"\xff latin-1 bytes elsewhere are the application's")]
    assert undecodable_header(ok) is None
    for name in (b"x-session-id", b"X_Session_Id", b"x-request-id",
                 b"serve-multiplexed-model-id"):
        assert undecodable_header(ok + [(name, b"\xff")]) == name.decode()
    assert undecodable_header([(b"x-\xe9", b"v")]) == "x-\xe9"  # a name: always decoded


def _recording_guard():
    """A ``HeaderGuard`` around an app that records the scopes it is called with, and an
    ASGI ``send`` that records the messages: (guard, scopes, messages, send)."""
    calls, sent = [], []

    async def app(scope, receive, send):
        calls.append(scope)

    async def send(message):
        sent.append(message)

    return HeaderGuard(app), calls, sent, send


async def test_the_guard_answers_400_in_the_openai_shape_and_passes_the_rest():
    guard, calls, sent, send = _recording_guard()
    await guard({"type": "http", "headers": [(b"x-session-id", b"\xff")]}, None, send)
    assert not calls and sent[0]["status"] == 400
    body = json.loads(sent[1]["body"])
    assert body["error"]["param"] == "x-session-id" and body["error"]["code"] == 400
    await guard({"type": "http", "headers": [(b"x-session-id", b"abc")]}, None, send)
    await guard({"type": "lifespan"}, None, send)
    assert len(calls) == 2 and len(sent) == 2
    assert [m.cls for m in proxy_middlewares()] == [HeaderGuard]


async def test_headers_over_the_limit_get_a_431_in_the_openai_shape(monkeypatch):
    """Found by a break test: 200 headers of 8 KB (1.6 MB) were accepted and served; past
    ``max_header_bytes()`` (64 KiB unless ``PREFIX_ROUTER_MAX_HEADER_BYTES`` says otherwise)
    a request is answered 431 before the application sees it."""
    from router.config import Settings
    from router.serve.header_guard import max_header_bytes

    guard, calls, sent, send = _recording_guard()
    assert guard.limit == Settings().max_header_bytes == 65536
    big = [(b"x-pad-%d" % i, b"v" * 8000) for i in range(9)]  # 72 KB
    await guard({"type": "http", "headers": big}, None, send)
    assert not calls and sent[0]["status"] == 431
    body = json.loads(sent[1]["body"])
    assert body["error"]["code"] == 431 and "PREFIX_ROUTER_MAX_HEADER_BYTES" in \
        body["error"]["message"]
    await guard({"type": "http", "headers": big[:7]}, None, send)  # 56 KB: passed on
    assert len(calls) == 1 and len(sent) == 2
    monkeypatch.setenv("PREFIX_ROUTER_MAX_HEADER_BYTES", "200000")
    assert max_header_bytes() == 200000 and _recording_guard()[0].limit == 200000
    for bad in ("0", "-5", "1e5", "lots"):  # logged, the default taken: the proxy stays up
        monkeypatch.setenv("PREFIX_ROUTER_MAX_HEADER_BYTES", bad)
        assert max_header_bytes() == 65536
        with pytest.raises(ValueError):  # the ingress refuses it at its start
            Settings()
