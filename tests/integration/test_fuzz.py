"""Fuzzing the router's OpenAPI document with schemathesis (``loadtest.fuzz``): bodies
generated from the schemas of the chat, completions and models endpoints, valid ones and
ones that break them, must never get a 5xx, and every answer must match the document
(status, content type, the OpenAI error shape). Bounded here; docs/benchmarks.md has a
longer run."""

from __future__ import annotations

import os

import pytest

from loadtest.fuzz import fuzz
from tests.conftest import run_app

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("ROUTER_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def fuzzed(serve_http_port, model_dir):
    svc = run_app(serve_http_port, "fuzz", "/fuzz", model=str(model_dir), engine="sim",
                  num_replicas=1, replica_num_cpus=0.1, ingress_num_cpus=0.1)
    yield svc
    from ray import serve
    serve.delete("fuzz")


def test_no_fuzzed_request_gets_a_5xx_or_an_answer_outside_the_document(fuzzed):
    out = fuzz(fuzzed.url, EXAMPLES)
    assert out["requests"] >= 3 * 2 * min(EXAMPLES, 5)
    assert not out["failures"], "\n".join(out["failures"][:10])
