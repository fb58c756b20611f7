"""Per-tenant rate limits (router/serve/ratelimit.py): in Redis (shared by routers), in
fakeredis, on the TLS/ACL Redis, and in one process; one sliding-minute rule."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from router.clock import ManualClock
from router.index.redis import RedisConnections
from router.serve.auth import Tenant
from router.serve.errors import OpenAIError
from router.serve.ratelimit import (RateLimiter, context_tokens, max_output_tokens,
                                    request_tokens)

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(params=["memory", "redis", "fakeredis", "redis-tls-acl"])
def make_limiter(request):
    """A factory of limiters sharing one store (several routers), on one clock."""
    clock = ManualClock(120.0 * (int(time.time()) // 120))  # at a window's start
    ns = f"test-{uuid.uuid4().hex[:8]}"
    if request.param == "memory":
        one = RateLimiter(None, ns, clock)
        return lambda: one, clock
    if request.param == "redis-tls-acl":
        secure = request.getfixturevalue("secure_redis")
        conn = RedisConnections(secure.url, 2.0, secure.connection_kwargs)
    else:
        conn = RedisConnections(REDIS_URL, 2.0)
    if request.param == "fakeredis":
        import fakeredis
        fake = fakeredis.FakeAsyncRedis()
        conn.client = lambda *timeout: fake
    return (lambda: RateLimiter(conn, ns, clock)), clock


async def test_requests_per_minute_are_shared_and_refused_with_retry_after(make_limiter):
    make, clock = make_limiter
    routers = [make(), make()]
    t = Tenant("acme", requests_per_minute=4)
    for i in range(4):
        await routers[i % 2].check(t, 10)
    clock.advance(15.0)
    with pytest.raises(OpenAIError) as err:
        await routers[0].check(t, 10)
    e = err.value
    assert e.status == 429 and e.body()["error"]["type"] == "RateLimitError"
    assert e.headers["retry-after"] == "45" and e.headers["x-ratelimit-limit-requests"] == "4"
    assert e.headers["x-ratelimit-remaining-requests"] == "0"
    await routers[1].check(Tenant("other", requests_per_minute=4), 10)  # tenants apart
    clock.advance(45.0 + 30.0)  # half of the last window still inside the sliding minute
    await routers[1].check(t, 10)  # 4 * 0.5 + 0 used: room for 2 more
    await routers[0].check(t, 10)
    with pytest.raises(OpenAIError):
        await routers[0].check(t, 10)


async def test_tokens_per_minute_count_prompt_and_budget_and_refuse_without_counting(
        make_limiter):
    make, _ = make_limiter
    limiter = make()
    t = Tenant("acme", requests_per_minute=100, tokens_per_minute=1000)
    await limiter.check(t, 700)
    with pytest.raises(OpenAIError) as err:
        await limiter.check(t, 400)  # would be 1,100
    assert "tokens" in err.value.message and err.value.headers["retry-after"]
    await limiter.check(t, 300)  # the refused one was not counted
    with pytest.raises(OpenAIError) as err:
        await limiter.check(Tenant("big", tokens_per_minute=1000), 5000)
    assert "retry-after" not in err.value.headers  # waiting would not help


async def test_no_limits_no_tenant_no_check(make_limiter):
    make, _ = make_limiter
    limiter = make()
    for _ in range(50):
        await limiter.check(None, 10**9)
        await limiter.check(Tenant("free"), 10**9)


async def test_redis_down_counts_in_this_process():
    conn = RedisConnections("redis://127.0.0.1:1/0", 0.05)
    limiter = RateLimiter(conn, "t", ManualClock(0.0))
    t = Tenant("acme", requests_per_minute=2)
    await limiter.check(t, 1)
    await limiter.check(t, 1)
    with pytest.raises(OpenAIError):
        await limiter.check(t, 1)


async def test_redis_failing_mid_minute_checks_against_what_this_process_admitted():
    """Two requests admitted through Redis, then Redis times out: the third is checked
    against this process's own count of the two, and refused."""
    conn = RedisConnections(REDIS_URL, 2.0)
    clock = ManualClock(120.0 * (int(time.time()) // 120))
    limiter = RateLimiter(conn, f"test-{uuid.uuid4().hex[:8]}", clock)
    t = Tenant("acme", requests_per_minute=2)
    await limiter.check(t, 1)
    await limiter.check(t, 1)
    limiter.conn = RedisConnections("redis://127.0.0.1:1/0", 0.05)  # Redis now fails
    with pytest.raises(OpenAIError) as err:
        await limiter.check(t, 1)
    assert err.value.status == 429


def test_a_requests_tokens_are_its_prompt_and_what_it_may_generate():
    assert max_output_tokens({"max_tokens": 100}) == 100
    assert max_output_tokens({"max_completion_tokens": 50, "max_tokens": 9, "n": 3}) == 150
    assert max_output_tokens({"max_tokens": True}) == 0 and max_output_tokens({}) == 0
    # /v1/completions: vLLM's default max_tokens is 16 (an explicit null: the context)
    assert max_output_tokens({"n": 2}, completions=True) == 32
    assert max_output_tokens({"max_tokens": None}, completions=True) == 0
    assert max_output_tokens({"max_tokens": 5}, completions=True) == 5
    assert request_tokens(1000, 100, 99999) == 1100
    assert request_tokens(0, 10, 4000) == 1010  # not tokenized: a token per 4 bytes
    # no max_tokens: the engine may fill the context (vLLM's default), n times
    assert request_tokens(1000, 0, 99999, context_tokens=4096) == 4096
    assert request_tokens(1000, 0, 99999, context_tokens=4096, n=2) == 1000 + 2 * 3096
    assert request_tokens(1000, 0, 99999) == 1000  # the context unknown: the prompt alone
    assert request_tokens(1000, 100, 99999, context_tokens=4096) == 1100


def test_the_context_length_is_max_model_len_or_the_models_own(tmp_path):
    assert context_tokens(2048, None) == 2048
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 32768}')
    assert context_tokens(None, str(tmp_path)) == 32768
    assert context_tokens(1024, str(tmp_path)) == 1024
    assert context_tokens(None, str(tmp_path / "none")) is None
    (tmp_path / "config.json").write_text('[1]')
    assert context_tokens(None, str(tmp_path)) is None


async def test_a_request_without_max_tokens_is_charged_the_context_it_may_fill(model_dir):
    """docs/security.md: a tenant's token limit counts the prompt plus the most the request
    may generate; naming no ``max_tokens`` is no way around it."""
    from router.config import Settings
    from router.serve.ingress import IngressCore

    core = IngressCore(Settings(model=str(model_dir), max_model_len=512), engine_handle=None)
    assert core.context_tokens == 512
    t = Tenant("t", tokens_per_minute=600)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = await core.prepare("/v1/chat/completions", json.dumps(body).encode(), None, t,
                                None, None)
    assert req.max_output_tokens == 0 and req.choices == 1
    cost = request_tokens(req.prompt_tokens, req.max_output_tokens, len(req.body),
                          core.context_tokens, req.choices)
    assert cost == 512
    await core.rate_limits.check(t, cost)
    with pytest.raises(OpenAIError) as err:  # a second one does not fit the minute
        await core.rate_limits.check(t, cost)
    assert err.value.status == 429
