"""One OpenAI-compatible streamed answer, measured: the SSE parser of the load tests.

No load-tool import here (locust patches the process with gevent at import), so the parser
is tested on its own and shared by every client.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class Sample:
    """One request's figures (times in seconds, token counts from the engine's ``usage``).

    ``replica`` is the router's ``x-routed-replica`` header, or the server's address when
    it sends none; ``predicted_cached_tokens`` is -1 when the server made no prediction;
    ``session`` and ``turn`` place a multi-turn request in its conversation (``t_start`` is
    the wall-clock send time, s since the epoch).
    """

    route: str
    status: int
    ok: bool
    error: str = ""
    replica: str = ""
    policy: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_chunks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = -1
    routing_s: float | None = None
    text: str = ""
    t_start: float = 0.0
    session: str = ""
    turn: int = -1

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (s), or None with fewer than 2 tokens."""
        n = self.completion_tokens or self.output_chunks
        if self.ttft_s is None or n < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)


def _content_of(chunk: dict) -> str:
    out = []
    for ch in chunk.get("choices") or []:
        piece = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
        if piece:
            out.append(piece)
    return "".join(out)


def read_stream(lines: Iterable[str], sample: Sample, t0: float) -> None:
    """Consume an SSE stream of chat or completion chunks into ``sample``: content deltas'
    arrival times (TTFT from ``t0``, every gap between two), the text, the final ``usage``,
    and whether it ended with ``data: [DONE]``. An SSE ``error`` event or a stream without
    ``[DONE]`` makes the sample a failure; a broken connection raises to the caller."""
    last = None
    done = False
    text = []
    for line in lines:
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            sample.ok, sample.error = False, f"malformed SSE data: {data[:80]!r}"
            return
        if isinstance(chunk, dict) and "error" in chunk:
            err = chunk["error"]
            sample.ok = False
            sample.error = "SSE error event: " + (err.get("message", "") if isinstance(err, dict)
                                                  else str(err))[:200]
            return
        now = time.perf_counter()
        piece = _content_of(chunk)
        if piece:
            if last is None:
                sample.ttft_s = now - t0
            else:
                sample.itl_s.append(now - last)
            last = now
            sample.output_chunks += 1
            text.append(piece)
        if chunk.get("usage"):
            take_usage(sample, chunk["usage"])
    sample.text = "".join(text)
    if not done:
        sample.ok, sample.error = False, "stream ended without data: [DONE]"


def take_usage(sample: Sample, usage: dict) -> None:
    sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    sample.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    sample.cached_tokens = int(details.get("cached_tokens") or 0)


def failure_kind(error: str) -> str:
    """``error`` as one row of locust's failure table: in the body of an HTTP error
    (``HTTP <status>: <body>``) numbers of two digits or more read ``N`` (an engine's 400
    names the prompt's length, which would make a row per request); other errors as they
    are. The samples keep the whole message."""
    head, sep, rest = error.partition(": ")
    if not head.startswith("HTTP "):
        return error
    return head + sep + re.sub(r"\d{2,}", "N", rest)
