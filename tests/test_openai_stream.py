"""The load tests' SSE parser: what counts as a streamed answer, and what as a failure."""

from __future__ import annotations

import json
import time

from loadtest.openai_stream import Sample, read_stream


def _events(*chunks, done=True):
    lines = [f"data: {json.dumps(c)}" for c in chunks]
    return lines + (["data: [DONE]"] if done else [])


def _delta(text):
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def test_a_whole_stream_gives_ttft_one_gap_per_delta_and_the_usage():
    s = Sample("chat", 200, True)
    usage = {"prompt_tokens": 40, "completion_tokens": 3,
             "prompt_tokens_details": {"cached_tokens": 32}}
    read_stream(_events(_delta("a"), _delta("b"), _delta("c"), {"choices": [], "usage": usage}),
                s, time.perf_counter())
    assert s.ok and s.text == "abc" and s.ttft_s is not None
    assert len(s.itl_s) == 2 and s.output_chunks == 3
    assert (s.prompt_tokens, s.cached_tokens, s.completion_tokens) == (40, 32, 3)


def test_completion_chunks_count_as_content():
    s = Sample("completions", 200, True)
    read_stream(_events({"choices": [{"index": 0, "text": "x"}]}), s, time.perf_counter())
    assert s.ok and s.text == "x" and s.output_chunks == 1


def test_an_sse_error_event_is_a_failure_not_a_short_answer():
    s = Sample("chat", 200, True)
    read_stream(_events(_delta("a"), {"error": {"message": "engine stream interrupted"}}),
                s, time.perf_counter())
    assert not s.ok and "engine stream interrupted" in s.error


def test_a_stream_without_done_is_a_failure():
    s = Sample("chat", 200, True)
    read_stream(_events(_delta("a"), _delta("b"), done=False), s, time.perf_counter())
    assert not s.ok and "[DONE]" in s.error


def test_keep_alive_comments_are_not_content_and_do_not_start_the_ttft():
    """The router's SSE comments while a stream waits (``: keep-alive``) are skipped: the
    time to first token is the first content delta's."""
    s = Sample("chat", 200, True)
    t0 = time.perf_counter()

    def lines():
        yield ": keep-alive"
        yield ""
        time.sleep(0.05)
        yield from _events(_delta("a"))

    read_stream(lines(), s, t0)
    assert s.ok and s.text == "a" and s.output_chunks == 1 and s.ttft_s >= 0.05
