"""Locust users for OpenAI-compatible LLM servers: the router, or any single engine.

Import it from a locustfile (``loadtest/locustfile.py`` is a ready one) and run it with
locust's own command (headless with ``--csv``/``--html``, the web UI, or a master and
workers). Each streamed answer is recorded as locust entries of its own:

====================  =======================================================================
request type          value (milliseconds)
====================  =======================================================================
``POST`` (the route)  end-to-end time; a failure when the status is not 200, the stream breaks
                      (connection dropped, an SSE ``error`` event, no ``data: [DONE]``) or the
                      router applied another policy than the one asked for
``TTFT``              request sent to the first content delta (streamed requests)
``ITL``               every gap between two content deltas
``TPOT``              (end-to-end - TTFT) / (output tokens - 1), per request
====================  =======================================================================

Per replica (from the router's ``x-routed-replica`` and ``x-predicted-cached-tokens``
headers, and the engine's own ``usage.prompt_tokens_details.cached_tokens``): requests,
prompt tokens, cached tokens reported by the engines, predicted cached tokens and how many
predictions were exact. They are shown in a "Replicas" tab of the web UI, written to
``<--csv prefix>_replicas.csv``, and summed up at the end of a run (hit rate, TTFT and ITL
percentiles, requests per replica), printed and drawn into ``<prefix>_summary.png``. In
locust's distributed mode the workers send their counts to the master with their stats
reports. A server that sends no router headers (one vLLM directly) counts as one replica,
named after its address, so the same run compares the two with one ``--host``.

Options: ``python -m loadtest.openai_users`` lists them (locust's own ``--help`` prints
its options before it reads the locustfile, so it does not list these): ``--model``
(default: the first of ``/v1/models``), ``--routing-policy`` (sent as
``x-routing-policy``), ``--no-stream``, ``--tokenizer`` (a model directory: prompts of
exact token counts; default: the served model's own folder, ``root`` in ``/v1/models``,
when it is on this machine), ``--samples-jsonl`` (every request's figures, one JSON line
each), and the workloads' own (``MultiTurnChatUser``, ``TraceReplayUser``).

A run ends with exit code 2 on an option it cannot use (a trace that cannot be read, a
``--trace-speed`` not above 0, no trace row left to replay, a ``--host`` without
``http://`` or ``https://``), and with exit code 1 when no inference request finished.

This module imports neither Ray nor vLLM: locust's gevent patching fails in a process that
has (run locust as its own process, also from tests).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import random
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

from locust import HttpUser, between, events, task
from locust.exception import RescheduleTask
from locust.runners import MasterRunner, WorkerRunner

from loadtest.openai_stream import Sample, failure_kind, read_stream, take_usage
from loadtest.texts import (
    MOONCAKE_CONVERSATION,
    mt_bench_turns,
    trace_prompt,
    trace_rows,
    words_text,
)
from router.serve.protocol import parse_server_timing

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# per-replica attribution, merged over workers
# ---------------------------------------------------------------------------------------------

#: the row of answers the router gave itself (refusals, errors before any replica)
ROUTER_ITSELF = "(router, not routed)"
#: the row of streams the router began with keep-alives while the request waited (its
#: headers, sent before the request was routed, cannot name the replica)
ROUTED_UNNAMED = "(routed, replica not named)"
_IN_FLIGHT = [0]  # inference requests of this process sent and not yet answered in full
_IN_FLIGHT_AT_STOP: list[int | None] = [None]  # ... as the test stopped (its users not yet
# killed; a worker's goes to its master with its last stats report)

_FIELDS = ("requests", "failures", "prompt_tokens", "cached_tokens", "predicted_cached_tokens",
           "predicted_exact", "predicted_requests")


class ReplicaTable:
    """Per-replica counts (``_FIELDS``), thread-safe; a worker's are sent to the master with
    every stats report and reset (``take``), the master adds them up (``merge``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.rows: dict[str, dict[str, int]] = {}

    def add(self, s: Sample) -> None:
        with self._lock:
            row = self.rows.setdefault(s.replica or "?", dict.fromkeys(_FIELDS, 0))
            row["requests"] += 1
            row["failures"] += 0 if s.ok else 1
            if s.ok:
                row["prompt_tokens"] += s.prompt_tokens
                row["cached_tokens"] += s.cached_tokens
                if s.predicted_cached_tokens >= 0 and s.prompt_tokens:
                    row["predicted_requests"] += 1
                    row["predicted_cached_tokens"] += s.predicted_cached_tokens
                    row["predicted_exact"] += int(s.predicted_cached_tokens == s.cached_tokens)

    def take(self) -> dict[str, dict[str, int]]:
        with self._lock:
            rows, self.rows = self.rows, {}
            return rows

    def merge(self, rows: dict[str, dict[str, int]]) -> None:
        with self._lock:
            for rep, add in rows.items():
                row = self.rows.setdefault(rep, dict.fromkeys(_FIELDS, 0))
                for k, v in add.items():
                    row[k] = row.get(k, 0) + v

    def snapshot(self) -> list[dict[str, Any]]:
        """Rows for display: counts plus the hit rate and the share of exact predictions."""
        with self._lock:
            out = []
            for rep, row in sorted(self.rows.items()):
                r = {"replica": rep, **row}
                r["hit_rate"] = round(row["cached_tokens"] / row["prompt_tokens"], 4) \
                    if row["prompt_tokens"] else 0.0
                r["exact_predictions"] = round(row["predicted_exact"]
                                               / row["predicted_requests"], 4) \
                    if row["predicted_requests"] else None
                out.append(r)
            return out

    def csv(self) -> str:
        cols = ["replica", *_FIELDS, "hit_rate", "exact_predictions"]
        lines = [",".join(cols)]
        for r in self.snapshot():
            lines.append(",".join("" if r[c] is None else str(r[c]) for c in cols))
        return "\n".join(lines) + "\n"


REPLICAS = ReplicaTable()
_samples_lock = threading.Lock()
_samples_file = None


def _record_sample(environment, s: Sample) -> None:
    REPLICAS.add(s)
    path = getattr(environment.parsed_options, "samples_jsonl", None) \
        if environment.parsed_options else None
    if not path:
        return
    global _samples_file
    with _samples_lock:
        if _samples_file is None:
            runner = environment.runner
            if isinstance(runner, WorkerRunner):
                root, ext = os.path.splitext(path)
                path = f"{root}.worker{runner.worker_index}{ext}"
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            _samples_file = open(path, "a", buffering=1)
        row = asdict(s)
        row.pop("text")
        row["tpot_s"] = s.tpot_s
        _samples_file.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------------
# the base user
# ---------------------------------------------------------------------------------------------


class OpenAIUser(HttpUser):
    """An OpenAI-compatible client: ``chat`` and ``complete`` send one request (streamed
    unless ``--no-stream``) and record it (module docstring). Subclasses add tasks."""

    abstract = True
    wait_time = between(0, 0)
    _card_lock = threading.Lock()
    _card: dict[str, Any] | None = None  # the server's model card, once it answered
    _card_asked_at = -1e9  # when it was last asked (monotonic s), with --model
    CARD_RETRY_S = 5.0  # with --model: how often an unanswered model card is asked again

    @property
    def options(self):
        return self.environment.parsed_options

    def auth_headers(self) -> dict[str, str]:
        """``Authorization: Bearer`` with ``--api-key`` (or ``OPENAI_API_KEY``), if any."""
        key = getattr(self.options, "api_key", None) if self.options else None
        key = key or os.environ.get("OPENAI_API_KEY")
        return {"authorization": f"Bearer {key}"} if key else {}

    def _model_option(self) -> str:
        return (getattr(self.options, "model", None) if self.options else None) or ""

    def model_card(self) -> dict[str, Any] | None:
        """The server's ``/v1/models`` entry of ``--model`` (else of its first model):
        ``id``, and from vLLM ``max_model_len`` and ``root`` (the model's folder; for a
        LoRA adapter, its base model's, ``tokenizer_root``), kept once the server answered;
        None until then.

        Without ``--model`` the card is needed (its id is the requests' model): each ask is
        a ``/v1/models`` entry of locust's table and a failed one its failure, saying why
        (no answer from the host, the status, not a model list). With ``--model`` the card
        only adds the context length and the tokenizer: it is asked at most every
        ``CARD_RETRY_S`` until it answers, outside locust's table (a server without
        ``/v1/models``, or one still starting, fails no run), a failure logged once."""
        cls = OpenAIUser
        with cls._card_lock:
            if cls._card is None:
                if self._model_option():
                    now = time.monotonic()
                    if now - cls._card_asked_at >= self.CARD_RETRY_S:
                        cls._card_asked_at = now
                        cls._card = self._ask_model_card(recorded=False)
                else:
                    cls._card = self._ask_model_card(recorded=True)
            return cls._card

    def _ask_model_card(self, recorded: bool) -> dict[str, Any] | None:
        opt = self._model_option()
        if recorded:
            with self.client.get("/v1/models", name="/v1/models", catch_response=True,
                                 headers=self.auth_headers()) as r:
                card, why = _model_card_of(r, opt, self.host or "")
                if why:
                    r.failure(why)
                else:
                    r.success()
                return card
        import requests  # gevent-patched by locust: yields to the other users
        try:
            r = requests.get(f"{(self.host or '').rstrip('/')}/v1/models",
                             headers=self.auth_headers(), timeout=(10, 30))
        except requests.RequestException as exc:
            r = _NoAnswer(exc)
        card, why = _model_card_of(r, opt, self.host or "")
        global _warned_card
        if why and not _warned_card:
            _warned_card = True
            logger.warning("GET /v1/models: %s; the model's context length and folder stay "
                           "unknown until it answers (asked every %.0f s)", why,
                           self.CARD_RETRY_S)
        return card

    def model(self) -> str:
        """``--model``, else the first model the server lists (``model_card``). Without
        either the task is given up (``RescheduleTask``, after a second: no tight loop
        against a host that is down) and tried again; tasks call it before they change
        any state of their own."""
        opt = self._model_option()
        if opt:
            return opt
        card = self.model_card()
        if card is None:
            time.sleep(1.0)  # gevent-patched: yields to the other users
            raise RescheduleTask()
        return card["id"]

    def tokenizer(self) -> str | None:
        """``--tokenizer``; else the served model's folder (``tokenizer_root`` of its model
        card) when it holds a ``tokenizer.json`` on this machine (vLLM's own); else None
        (and, when the server answered, a warning once): generated prompts are then only
        about as long as asked (a word of their vocabulary can be several tokens of the
        model's)."""
        opt = getattr(self.options, "tokenizer", None) if self.options else None
        if opt:
            return opt
        card = self.model_card()
        if card is None:  # the server has not answered: asked again later
            return None
        root = card.get("tokenizer_root")
        if isinstance(root, str) and (Path(root) / "tokenizer.json").is_file():
            return root
        global _warned_tokenizer
        if not _warned_tokenizer:
            _warned_tokenizer = True
            logger.warning("no --tokenizer, and the served model's folder (%r) is not on this "
                           "machine: prompt lengths are approximate (a word may be several "
                           "tokens); pass --tokenizer <model folder> for exact ones", root)
        return None

    def chat(self, messages: list[dict], max_tokens: int, name: str = "chat",
             meta: dict | None = None, **extra) -> Sample:
        """One ``/v1/chat/completions`` request; returns its ``Sample`` (``meta``: fields of
        the sample to set, e.g. ``session`` and ``turn``)."""
        body = {"model": self.model(), "messages": messages, "max_tokens": max_tokens, **extra}
        return self._send("/v1/chat/completions", body, name, meta)

    def complete(self, prompt: str | list[int], max_tokens: int, name: str = "completions",
                 **extra) -> Sample:
        """One ``/v1/completions`` request; returns its ``Sample``."""
        body = {"model": self.model(), "prompt": prompt, "max_tokens": max_tokens, **extra}
        return self._send("/v1/completions", body, name)

    def _send(self, path: str, body: dict, name: str, meta: dict | None = None) -> Sample:
        opts = self.options
        stream = not (opts and getattr(opts, "no_stream", False))
        body = {**body, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"content-type": "application/json", **self.auth_headers()}
        policy = getattr(opts, "routing_policy", None) if opts else None
        if policy:
            headers["x-routing-policy"] = policy
        sample = Sample(route=name, status=0, ok=True, t_start=time.time(), **(meta or {}))
        t0 = time.perf_counter()
        _IN_FLIGHT[0] += 1
        try:
            return self._exchange(path, body, name, headers, stream, policy, sample, t0)
        finally:
            _IN_FLIGHT[0] -= 1

    def _exchange(self, path: str, body: dict, name: str, headers: dict, stream: bool,
                  policy: str | None, sample: Sample, t0: float) -> Sample:
        with self.client.request("POST", path, data=json.dumps(body), headers=headers,
                                 name=name, stream=stream, catch_response=True,
                                 timeout=(30, 600)) as r:
            sample.status = r.status_code or 0
            h = r.headers or {}
            timing = parse_server_timing(h.get("server-timing"))
            # an answer of the router's own (a 400, a 429, a 503) names no replica, nor does
            # a stream it began with keep-alives before the request was routed: neither is
            # counted as a replica named after the router's address
            from_router = "router" in timing or "x-data-path" in h
            sample.replica = h.get("x-routed-replica") or (
                (ROUTED_UNNAMED if sample.status == 200 else ROUTER_ITSELF) if from_router
                else urlparse(self.host or "").netloc)
            sample.policy = h.get("x-routing-policy", "")
            if h.get("x-predicted-cached-tokens") is not None:
                sample.predicted_cached_tokens = int(h["x-predicted-cached-tokens"])
            routing = timing.get("routing")
            if routing is not None:
                sample.routing_s = routing
            try:
                if sample.status == 0:
                    sample.ok = False
                    sample.error = f"no answer: {_no_answer(r)}"
                elif sample.status != 200:
                    sample.ok = False
                    sample.error = f"HTTP {sample.status}: {(r.text or '')[:200]}"
                elif stream:
                    read_stream(_lines(r), sample, t0)
                else:
                    obj = r.json()
                    if obj.get("usage"):
                        take_usage(sample, obj["usage"])
                    sample.text = "".join(
                        (c.get("message") or {}).get("content") or c.get("text") or ""
                        for c in obj.get("choices") or [])
            except Exception as exc:  # noqa: BLE001 - a dropped connection mid-stream
                sample.ok = False
                sample.error = f"stream broke: {type(exc).__name__}: {exc}"
            if sample.ok and policy and sample.policy and sample.policy != policy:
                sample.ok = False
                sample.error = f"asked for policy {policy!r}, the router applied " \
                               f"{sample.policy!r}"
            sample.e2e_s = time.perf_counter() - t0
            r.request_meta["response_time"] = sample.e2e_s * 1000
            if sample.ok:
                r.success()
            else:  # one line of locust's failure table per kind, not per number in it
                r.failure(failure_kind(sample.error))
        self._fire_latencies(sample, name)
        _record_sample(self.environment, sample)
        return sample

    def _fire_latencies(self, s: Sample, name: str) -> None:
        if not s.ok:
            return
        fire = self.environment.events.request.fire
        if s.ttft_s is not None:
            fire(request_type="TTFT", name=name, response_time=s.ttft_s * 1000,
                 response_length=0, exception=None, context={})
        for gap in s.itl_s:
            fire(request_type="ITL", name=name, response_time=gap * 1000, response_length=0,
                 exception=None, context={})
        if s.tpot_s is not None:
            fire(request_type="TPOT", name=name, response_time=s.tpot_s * 1000,
                 response_length=0, exception=None, context={})


_warned_tokenizer = False
_warned_card = False


class _NoAnswer:
    """A request that got no HTTP answer, shaped as a response of status 0."""

    status_code = 0
    text = ""

    def __init__(self, error: BaseException):
        self.error = error


def _model_card_of(r, model: str, host: str) -> tuple[dict[str, Any] | None, str]:
    """The model card of ``model`` (else the first listed) in a ``/v1/models`` response,
    with ``tokenizer_root``: its ``root``, or, for a LoRA adapter whose folder holds no
    tokenizer, its ``parent``'s. Returns (card, "") or (None, why not)."""
    if not r.status_code:
        return None, f"no answer from {host}: {_no_answer(r)}"
    if r.status_code != 200:
        return None, f"HTTP {r.status_code}: {(r.text or '')[:200]}"
    try:
        models = [m for m in r.json()["data"] if isinstance(m, dict) and "id" in m]
    except (ValueError, KeyError, TypeError):
        return None, ("not an OpenAI model list (--host is the server's root, without /v1): "
                      f"{(r.text or '')[:100]!r}")
    card = next((m for m in models if m["id"] == model), None) if model else \
        (models[0] if models else None)
    if card is None:
        return None, (f"the server lists no model {model!r}" if model
                      else "the server lists no model")
    root = card.get("root")
    if isinstance(card.get("parent"), str) and not (
            isinstance(root, str) and (Path(root) / "tokenizer.json").is_file()):
        base = next((m for m in models if m["id"] == card["parent"]), None)
        root = (base or {}).get("root", root)
    return {**card, "tokenizer_root": root}, ""


def _no_answer(r) -> str:
    """Why a request got no HTTP answer (status 0): the error the client recorded."""
    err = getattr(r, "error", None)
    return f"{type(err).__name__}: {err}" if err is not None else "no response"


def _lines(r) -> Iterator[str]:
    """The lines of a streamed body as they arrive (``chunk_size=None``: each piece as the
    socket delivers it; a fixed size would wait until that many bytes came)."""
    import codecs
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may
    buffer = ""                                                        # span two chunks
    for chunk in r.iter_content(chunk_size=None):
        buffer += decoder.decode(chunk)
        while "\n" in buffer:
            line, buffer = buffer.split("\n", 1)
            yield line
    if buffer:
        yield buffer


# ---------------------------------------------------------------------------------------------
# deterministic text
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------


class MultiTurnChatUser(OpenAIUser):
    """A chat product's users: each user holds a conversation of ``--turns`` turns, then
    starts a new one. Users are in ``--groups`` groups; a group's users share a system prompt
    of ``--system-tokens`` tokens (a product's or a tenant's instructions), different per
    group. Every turn adds an MT-Bench question with ``--question-tokens`` tokens of context
    (a pasted document, earlier output) and the model's own answer (``--answer-tokens``
    tokens, ``ignore_eos`` so every answer has that length on vLLM), so the history grows by
    their sum each turn. A think time of ``--think-time`` seconds (uniform 0.5x-1.5x) passes
    between turns."""

    abstract = False
    _users = itertools.count()

    def on_start(self) -> None:
        o = self.options
        local = next(MultiTurnChatUser._users)
        runner = self.environment.runner
        if isinstance(runner, WorkerRunner):  # user k of worker i of n: user k*n + i overall
            n = max(int(getattr(o, "expect_workers", 1) or 1), 1)
            self.index = local * n + runner.worker_index
        else:
            self.index = local
        self.team = self.index % max(int(getattr(o, "groups", 4)), 1)
        self.rng = random.Random(f"user-{self.index}")
        self.conversations = 0
        self.messages: list[dict] | None = None  # begun at the first turn (once the
        # server's model card, and so its tokenizer, is known)

    def _new_conversation(self) -> None:
        o = self.options
        tokenizer = self.tokenizer()
        system = words_text(int(getattr(o, "system_tokens", 2000)),
                            f"system-{getattr(o, 'prompt_seed', 0)}-{self.team}", tokenizer)
        self.messages = [{"role": "system", "content":
                          f"You are the assistant of team {self.team}.{system}"}]
        self.turn = 0
        self.conversations += 1

    def wait_time(self) -> float:
        think = float(getattr(self.options, "think_time", 1.0))
        return think * (0.5 + self.rng.random())

    @task
    def turn_of_conversation(self) -> None:
        o = self.options
        self.model()  # before anything changes: it may give the task up (RescheduleTask)
        if self.messages is None:
            self._new_conversation()
        q = self.rng.choice(mt_bench_turns())
        context = words_text(int(getattr(o, "question_tokens", 100)),
                             f"ctx-{getattr(o, 'prompt_seed', 0)}-{self.index}-"
                             f"{self.conversations}-{self.turn}",
                             self.tokenizer())
        self.messages.append({"role": "user", "content": f"{q}\nContext:{context}"})
        extra = {"ignore_eos": True} if getattr(o, "ignore_eos", True) else {}
        s = self.chat(self.messages, int(getattr(o, "answer_tokens", 64)), name="chat",
                      meta={"session": f"t{self.team}-u{self.index}-c{self.conversations}",
                            "turn": self.turn}, temperature=0, **extra)
        if not s.ok:  # the conversation cannot go on without the answer
            self._new_conversation()
            return
        self.messages.append({"role": "assistant", "content": s.text})
        self.turn += 1
        if self.turn >= int(getattr(o, "turns", 8)):
            self._new_conversation()


class PacedChatUser(OpenAIUser):
    """Open-loop-like chat traffic for overload tests: every ``--pacing-s`` seconds each
    user sends one question (MT-Bench) after a system prompt of ``--system-tokens`` shared
    by all, asking for ``--answer-tokens`` tokens. ``-u U`` users offer ``U / pacing``
    requests per second while answers (and refusals) take less than the pacing. A 429 is
    recorded as the refusal it is: a failure in locust's table, ``status`` 429 in the
    samples."""

    abstract = False

    def wait_time(self) -> float:  # locust's constant_pacing: the task's start every P s
        pacing = float(getattr(self.options, "pacing_s", 2.0))
        last = getattr(self, "_last_start", None)
        return pacing if last is None else max(pacing - (time.monotonic() - last), 0.0)

    def on_start(self) -> None:
        self.rng = random.Random()
        self.system: str | None = None  # made at the first request (the tokenizer known)
        time.sleep(self.rng.random() * float(getattr(self.options, "pacing_s", 2.0)))

    @task
    def ask(self) -> None:
        self._last_start = time.monotonic()
        self.model()  # before anything changes: it may give the task up (RescheduleTask)
        if self.system is None:
            o = self.options
            self.system = words_text(int(getattr(o, "system_tokens", 2000)),
                                     f"paced-{getattr(o, 'prompt_seed', 0)}", self.tokenizer())
        q = self.rng.choice(mt_bench_turns())
        extra = {"ignore_eos": True} if getattr(self.options, "ignore_eos", True) else {}
        self.chat([{"role": "system", "content": self.system}, {"role": "user", "content": q}],
                  int(getattr(self.options, "answer_tokens", 64)), name="chat",
                  temperature=0, **extra)


class TraceReplayUser(OpenAIUser):
    """Replays a Mooncake-format trace (``--trace``, default the FAST'25 conversation
    trace) at its arrival times divided by ``--trace-speed``. Each row's ``hash_ids`` become
    text block by block (512 tokens a block, ``--trace-block-tokens``), the same text for the
    same id, so rows that share leading ids share a cached prefix; the last block is cut to
    the row's ``input_length``. Sent as ``/v1/completions`` (no chat template in front, so
    trace blocks stay aligned with the engine's blocks) with ``max_tokens`` = the row's
    ``output_length`` (at most ``--max-output-tokens``) and ``ignore_eos``.

    Users take rows in order from one schedule per process and wait for each row's time, so
    the replay keeps the trace's pace while enough users are free (``-u``: at least the
    trace's concurrency); a row is sent late, never dropped, when all are busy. With
    workers, worker ``i`` of ``--expect-workers`` replays rows ``i``, ``i + n``, ... .
    ``--trace-limit`` takes the first N rows, of which ``--trace-max-input-tokens`` leaves
    out the longer ones, and so are those that do not fit the served model's context
    (``max_model_len``, counted in the log). When the trace has been replayed the run
    ends (with workers, at ``-t``); a trace that cannot be read, or has no row left, ends
    it at once (exit code 2).
    """

    abstract = False
    _schedule_lock = threading.Lock()
    _schedule: dict[str, Any] | None = None

    def _rows(self) -> dict[str, Any]:
        with TraceReplayUser._schedule_lock:
            if TraceReplayUser._schedule is None:
                try:
                    rows = self._schedule_rows()
                except TraceError as exc:  # the run cannot go on: said once, then it ends
                    _abort(self.environment, str(exc))
                    TraceReplayUser._schedule = {"error": str(exc)}
                else:
                    if not rows:  # another worker's share holds them all
                        logger.info("no trace row falls to this worker: its users stop")
                    TraceReplayUser._schedule = {"rows": rows, "next": itertools.count(),
                                                 "done": 0, "t0": time.monotonic()}
            return TraceReplayUser._schedule

    def _schedule_rows(self) -> list[dict]:
        """This process's rows: ``trace_schedule``'s, without the rows that do not fit the
        served model's context (``max_model_len`` of its model card: prompt and capped
        output; the number left out is logged; unchecked, and said so, while the card is
        unknown), then this worker's share (empty when other workers hold every row).

        Raises:
            TraceError: as ``trace_schedule``, or no row fits the context.
        """
        o = self.options
        rows, why = trace_schedule(o)
        card = self.model_card()
        context = (card or {}).get("max_model_len")
        if isinstance(context, int) and context > 0:
            cap = int(getattr(o, "max_output_tokens", 512))
            fits = [r for r in rows
                    if r["input_length"] + max(min(r["output_length"], cap), 1) <= context]
            if len(fits) < len(rows):
                logger.info("%d trace rows left out: longer than the model's context, "
                            "max_model_len %d (prompt and output capped at %d tokens)",
                            len(rows) - len(fits), context, cap)
            if not fits:
                raise TraceError(f"no trace rows to replay after {', '.join(why)}"
                                 f"{', ' if why else ''}the model's max_model_len {context}")
            rows = fits
        elif card is None:
            logger.warning("the served model's context length is unknown (GET /v1/models "
                           "has not answered): trace rows are not checked against it")
        runner = self.environment.runner
        if isinstance(runner, WorkerRunner):
            n = max(int(getattr(o, "expect_workers", 1) or 1), 1)
            rows = rows[runner.worker_index % n::n]
        return rows

    @task
    def replay_next_row(self) -> None:
        self.model()  # before a row is taken: it may give the task up (RescheduleTask)
        sched = self._rows()
        if "error" in sched:
            self.stop()
            return
        i = next(sched["next"])
        if i >= len(sched["rows"]):
            self.stop()
            return
        row = sched["rows"][i]
        o = self.options
        speed = float(getattr(o, "trace_speed", 1.0))
        delay = sched["t0"] + row["timestamp"] / 1000.0 / speed - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # gevent-patched: yields to the other users
        prompt = trace_prompt(row["hash_ids"], row["input_length"],
                              int(getattr(o, "trace_block_tokens", 512)),
                              self.tokenizer(),
                              seed=str(getattr(o, "prompt_seed", "0")))
        try:
            self.complete(prompt, max(min(row["output_length"],
                                          int(getattr(o, "max_output_tokens", 512))), 1),
                          name="trace", temperature=0, ignore_eos=True)
        finally:
            sched["done"] += 1
            if sched["done"] == len(sched["rows"]) and \
                    not isinstance(self.environment.runner, WorkerRunner):
                logger.info("trace replayed: %d rows", sched["done"])
                import gevent
                gevent.spawn_later(0.2, self.environment.runner.quit)


class TraceError(ValueError):
    """A trace replay that cannot run: the message says why."""


@functools.lru_cache(maxsize=1)
def _read_trace(path: str) -> list[dict]:
    """The trace at ``path`` with its numbers as numbers, read once per process (the
    options' check at start and the schedule both need it; callers do not change it).

    Raises:
        TraceError: it cannot be read as a Mooncake-format trace.
    """
    try:
        rows = [{**r, "timestamp": float(r["timestamp"]),
                 "input_length": int(r["input_length"]),
                 "output_length": int(r["output_length"]),
                 "hash_ids": [int(h) for h in r["hash_ids"]]} for r in trace_rows(path)]
        if any(r["input_length"] < 0 or r["output_length"] < 0 for r in rows):
            raise ValueError("a negative length")
    except Exception as exc:  # noqa: BLE001 - whatever the file holds: one clear line
        raise TraceError(f"--trace {path}: not a readable Mooncake-format trace (JSON lines "
                         f"with timestamp, input_length, output_length, hash_ids): "
                         f"{type(exc).__name__}: {exc}") from None
    return rows


def trace_schedule(options) -> tuple[list[dict], list[str]]:
    """The rows ``TraceReplayUser`` replays by its options, before the served model's
    context and the workers' shares: the trace (``--trace``, default the Mooncake
    conversation trace), its first ``--trace-limit`` rows, without those longer than
    ``--trace-max-input-tokens``; rows with ``timestamp`` (ms), ``input_length`` and
    ``output_length`` as numbers and ``hash_ids`` a list. Returns (rows, the cuts applied,
    as words for a message).

    Raises:
        TraceError: ``--trace-speed`` is not above 0, the trace cannot be read as a
            Mooncake-format trace, or no row is left.
    """
    o = options
    speed = getattr(o, "trace_speed", 1.0)
    if not (isinstance(speed, (int, float)) and speed > 0):
        raise TraceError(f"--trace-speed must be above 0, not {speed}")
    path = str(getattr(o, "trace", None) or MOONCAKE_CONVERSATION)
    rows = _read_trace(path)
    why = []
    limit = int(getattr(o, "trace_limit", 0) or 0)
    if limit:
        rows = rows[:limit]
        why.append(f"--trace-limit {limit}")
    longest = int(getattr(o, "trace_max_input_tokens", 0) or 0)
    if longest:
        rows = [r for r in rows if r["input_length"] <= longest]
        why.append(f"--trace-max-input-tokens {longest}")
    if not rows:
        raise TraceError(f"no trace rows to replay from {path}"
                         + (f" after {', '.join(why)}" if why else ""))
    return rows, why


# ---------------------------------------------------------------------------------------------
# options, the web UI tab, reports
# ---------------------------------------------------------------------------------------------


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    g = parser.add_argument_group("prefix-router")
    g.add_argument("--model", default="", help="model name (default: the server's first)")
    g.add_argument("--api-key", default="",
                   help="sent as 'Authorization: Bearer' (default: $OPENAI_API_KEY; a router "
                        "with API keys on answers 401 without one)")
    g.add_argument("--routing-policy", default="",
                   help="sent as x-routing-policy; a response routed by another policy fails")
    g.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    g.add_argument("--tokenizer", default="",
                   help="model directory whose tokenizer.json makes prompt lengths exact")
    g.add_argument("--samples-jsonl", default="", help="append every request's figures here")
    g.add_argument("--prompt-seed", default="0",
                   help="seed of every generated prompt (a new seed: nothing cached from "
                        "an earlier run)")
    g.add_argument("--turns", type=int, default=8, help="MultiTurnChatUser: turns")
    g.add_argument("--groups", type=int, default=4,
                   help="MultiTurnChatUser: groups of users sharing a system prompt")
    g.add_argument("--system-tokens", type=int, default=2000,
                   help="MultiTurnChatUser: system prompt length")
    g.add_argument("--question-tokens", type=int, default=100,
                   help="MultiTurnChatUser: context tokens added to each question")
    g.add_argument("--answer-tokens", type=int, default=64,
                   help="MultiTurnChatUser: max_tokens of each answer")
    g.add_argument("--think-time", type=float, default=1.0,
                   help="MultiTurnChatUser: mean think time between turns (s)")
    g.add_argument("--pacing-s", type=float, default=2.0,
                   help="PacedChatUser: seconds between one user's requests")
    g.add_argument("--trace", default="", help="TraceReplayUser: Mooncake-format trace")
    g.add_argument("--trace-speed", type=float, default=1.0,
                   help="TraceReplayUser: arrival times are divided by this")
    g.add_argument("--trace-limit", type=int, default=0,
                   help="TraceReplayUser: replay the first N rows only (0: all)")
    g.add_argument("--trace-block-tokens", type=int, default=512,
                   help="TraceReplayUser: tokens per hash id")
    g.add_argument("--max-output-tokens", type=int, default=512,
                   help="TraceReplayUser: cap on each row's output_length")
    g.add_argument("--trace-max-input-tokens", type=int, default=0,
                   help="TraceReplayUser: leave out rows with longer prompts (0: none)")


ABORT_MESSAGE = "prefix_router_abort"  # a worker's message to its master: the run ends


def _abort(environment, message: str) -> None:
    """End the run on an error of its options: ``message`` logged once, exit code 2. A
    worker sends it to its master, which ends the whole run (``_on_abort``); in the web
    UI the test stops and the UI stays, for a corrected test."""
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        logger.error("%s: the run ends (the master is told)", message)
        runner.send_message(ABORT_MESSAGE, message)
        return
    logger.error("%s: the run ends", message)
    environment.process_exit_code = 2
    import gevent
    if runner is not None:
        headless = bool(getattr(environment.parsed_options, "headless", True))
        gevent.spawn_later(0.1, runner.quit if headless else runner.stop)


def _on_abort(environment, msg, **kw) -> None:
    """The master's side of ``_abort``: a worker's options error ends the run."""
    _abort(environment, f"a worker: {msg.data}")


@events.init.add_listener
def _check_options(environment, **kw) -> None:
    """Before any user starts: a ``--host`` that is not an ``http://`` or ``https://`` URL,
    or (with ``TraceReplayUser``) a trace it cannot replay (``trace_schedule``), ends
    locust with exit code 2; a ``--host`` ending in ``/v1`` is warned of (the kit adds
    ``/v1/...`` itself). A worker takes its host and options from its master, which
    checks them; the master hears of a worker's own errors (``_on_abort``)."""
    runner = environment.runner
    if isinstance(runner, MasterRunner):
        runner.register_message(ABORT_MESSAGE, _on_abort)
    if isinstance(runner, WorkerRunner):
        return
    host = environment.host or ""
    if host and urlparse(host).scheme not in ("http", "https"):
        logger.error("--host %r is not an http:// or https:// URL: locust ends", host)
        raise SystemExit(2)
    if host.rstrip("/").endswith("/v1"):
        logger.warning("--host %s ends in /v1: the kit adds /v1/... itself (give the "
                       "server's root)", host)
    if TraceReplayUser in (environment.user_classes or []) and environment.parsed_options:
        try:
            trace_schedule(environment.parsed_options)
        except TraceError as exc:
            logger.error("%s: locust ends", exc)
            raise SystemExit(2) from None


@events.test_start.add_listener
def _new_test(environment, **kw) -> None:
    """A new test (the web UI can start several): its own trace schedule and counts."""
    with TraceReplayUser._schedule_lock:
        TraceReplayUser._schedule = None
    _IN_FLIGHT_AT_STOP[0] = None
    _WORKERS_IN_FLIGHT.clear()  # the master's: the last test's counts, not the session's


@events.test_stopping.add_listener
def _stopping(environment, **kw) -> None:
    """The requests still in flight as the test stops (before its users are killed)."""
    _IN_FLIGHT_AT_STOP[0] = _IN_FLIGHT[0]


@events.report_to_master.add_listener
def _report(client_id, data, **kw) -> None:
    data["prefix_router_replicas"] = REPLICAS.take()
    # always sent (0 while the test runs), so that a count of an earlier test that reaches
    # the master after its new test started is replaced by the next report
    data["prefix_router_in_flight"] = _IN_FLIGHT_AT_STOP[0] or 0


_WORKERS_IN_FLIGHT: dict[str, int] = {}  # the master's: each worker's requests in flight at stop


@events.worker_report.add_listener
def _worker_report(client_id, data, **kw) -> None:
    REPLICAS.merge(data.get("prefix_router_replicas") or {})
    if "prefix_router_in_flight" in data:
        _WORKERS_IN_FLIGHT[client_id] = int(data["prefix_router_in_flight"])


@events.init.add_listener
def _init(environment, **kw) -> None:
    if environment.web_ui is None:
        return
    from flask import make_response, request

    web = environment.web_ui
    structure = [{"key": k, "title": k.replace("_", " ")} for k in
                 ("replica", "requests", "failures", "prompt_tokens", "cached_tokens",
                  "hit_rate", "predicted_cached_tokens", "exact_predictions")]
    web.template_args["extended_tabs"] = [{"title": "Replicas", "key": "replicas"}]
    web.template_args["extended_tables"] = [{"key": "replicas", "structure": structure}]
    web.template_args["extended_csv_files"] = [{"href": "/prefix-router/replicas.csv",
                                               "title": "Per-replica attribution CSV"}]

    @web.app.after_request
    def _extend_stats(response):
        if request.path != "/stats/requests" or not response.is_json:
            return response
        body = response.get_json()
        body["extended_stats"] = [{"key": "replicas", "data": REPLICAS.snapshot()}]
        response.set_data(json.dumps(body))
        return response

    @web.app.route("/prefix-router/replicas.csv")
    def _replicas_csv():
        resp = make_response(REPLICAS.csv())
        resp.headers["Content-Type"] = "text/csv"
        return resp


def summary(environment) -> dict[str, Any]:
    """The end-of-run summary: hit rate (engine-reported cached / prompt tokens), TTFT and
    ITL percentiles (ms, locust's own histograms), requests and failures per replica.
    ``requests`` and ``failures`` count the inference requests (POSTs), as the replicas'
    rows do; a user's ``GET /v1/models`` at its start is not one (its failures are
    ``other_failures``)."""
    stats = environment.stats
    rows = REPLICAS.snapshot()
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    exact = sum(r["predicted_exact"] for r in rows)
    predicted = sum(r["predicted_requests"] for r in rows)

    def pct(kind: str) -> dict[str, float | None]:
        entries = [e for (name, method), e in stats.entries.items() if method == kind]
        if not entries:
            return {}
        from locust.stats import StatsEntry
        total = StatsEntry(stats, kind, kind)
        for e in entries:
            total.extend(e)
        return {f"p{int(q * 100)}": total.get_response_time_percentile(q) if total.num_requests
                else None for q in (0.5, 0.9, 0.99)} | {"n": total.num_requests}

    return {"hit_rate": cached / prompt if prompt else 0.0, "prompt_tokens": prompt,
            "cached_tokens": cached,
            "exact_predictions": exact / predicted if predicted else None,
            "requests": sum(e.num_requests for (_, m), e in stats.entries.items()
                            if m == "POST"),
            "failures": sum(e.num_failures for (_, m), e in stats.entries.items()
                            if m == "POST"),
            "other_failures": sum(e.num_failures for (_, m), e in stats.entries.items()
                                  if m != "POST"),
            "ttft_ms": pct("TTFT"), "itl_ms": pct("ITL"), "tpot_ms": pct("TPOT"),
            "replicas": rows}


def _plot(summary_: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = summary_["replicas"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    names = [r["replica"][-10:] for r in reps]
    axes[0].bar(names, [r["requests"] for r in reps])
    axes[0].set_title("requests per replica")
    axes[1].bar(names, [r["hit_rate"] for r in reps])
    axes[1].set_ylim(0, 1)
    axes[1].set_title(f"hit rate per replica (all: {summary_['hit_rate']:.1%})")
    for kind, color in (("ttft_ms", "C0"), ("itl_ms", "C1")):
        p = summary_[kind]
        if p:
            axes[2].bar([f"{kind[:-3]} {q}" for q in ("p50", "p90", "p99")],
                        [p.get(q) or 0 for q in ("p50", "p90", "p99")], color=color)
    axes[2].set_yscale("log")
    axes[2].set_title("latency (ms)")
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@events.quitting.add_listener
def _at_end(environment, **kw) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return
    s = summary(environment)
    print("\nprefix-router summary: " + json.dumps({k: v for k, v in s.items()
                                                    if k != "replicas"}))
    in_flight = (_IN_FLIGHT_AT_STOP[0] or 0) + sum(_WORKERS_IN_FLIGHT.values())
    if in_flight:
        print(f"prefix-router: {in_flight} requests still in flight when the test stopped, "
              f"not counted (their answers had not ended)")
    if not s["requests"] and environment.process_exit_code is None:
        print("prefix-router: no inference request finished in this run")
        environment.process_exit_code = 1
    for r in s["replicas"]:
        print(f"  {r['replica']}: {r['requests']} requests, {r['failures']} failed, "
              f"hit rate {r['hit_rate']:.1%}, exact predictions {r['exact_predictions']}")
    prefix = environment.parsed_options.csv_prefix if environment.parsed_options else None
    if prefix:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        # locust rewrites its CSVs once a second: a run that ends sooner after its last
        # requests (a trace replayed to its end) would keep counts up to a second old
        import csv

        from locust.stats import PERCENTILES_TO_REPORT, StatsCSV
        writer = StatsCSV(environment, PERCENTILES_TO_REPORT)
        for kind in ("stats", "failures"):
            with open(f"{prefix}_{kind}.csv", "w", newline="") as f:
                getattr(writer, "requests_csv" if kind == "stats" else "failures_csv")(
                    csv.writer(f))
        Path(f"{prefix}_replicas.csv").write_text(REPLICAS.csv())
        Path(f"{prefix}_summary.json").write_text(json.dumps(s, indent=1))
        try:
            _plot(s, f"{prefix}_summary.png")
        except ImportError:
            logger.warning("matplotlib is not installed: no summary plot")


__all__ = ["OpenAIUser", "MultiTurnChatUser", "TraceReplayUser", "Sample", "read_stream",
           "summary", "trace_prompt", "trace_rows", "words_text", "REPLICAS", "MasterRunner"]


if __name__ == "__main__":  # the kit's own options (locust's --help prints before it reads them)
    import argparse

    _parser = argparse.ArgumentParser(
        prog="locust -f loadtest/locustfile.py",
        description="The prefix-router locust kit's options, given to locust with its own.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_options(_parser)
    _parser.print_help()
