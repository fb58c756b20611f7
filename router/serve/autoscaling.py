"""Autoscaling the engine deployment with Ray Serve's own autoscaler, on the engines' load.

Serve's default policy scales on the requests its handles and replicas count (Ray Serve
docs, "Ray Serve Autoscaling"). The direct data path sends requests to the engines' own
HTTP servers, so Serve counts none of them there. Each engine replica therefore reports its
engine's own load through Serve's custom-metrics hook (``record_autoscaling_stats``, Ray
Serve >= 2.51, "Custom metrics"): ``ENGINE_REQUESTS``, vLLM's ``num_requests_running +
num_requests_waiting`` scraped when Serve asks. ``engine_load_policy`` is Serve's default
rule on that figure (desired replicas = total requests / ``target_ongoing_requests``), and
Serve applies the config's bounds, delays and scaling factors around it as it does for any
custom policy (``ray.serve.autoscaling_policy._apply_autoscaling_config``). The figure is
the same on both data paths, so the fleet scales alike whichever path serves.
"""

from __future__ import annotations

from typing import Any

ENGINE_REQUESTS = "engine_requests"
POLICY_PATH = "router.serve.autoscaling:engine_load_policy"


def engine_load_policy(ctx) -> tuple[float, dict[str, Any]]:
    """Serve's autoscaling policy on the engines' load.

    Args:
        ctx: Serve's ``AutoscalingContext``; ``aggregated_metrics[ENGINE_REQUESTS]`` is the
            look-back mean (Serve's aggregation) of each running replica's engine requests.
    Returns:
        (desired replicas, possibly fractional: Serve rounds and bounds it; policy state).
        Before any replica has reported, Serve's own ongoing-request count stands in.
    """
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    per_replica = (ctx.aggregated_metrics or {}).get(ENGINE_REQUESTS) or {}
    total = sum(per_replica.values()) if per_replica else ctx.total_num_requests
    return total / ctx.config.get_target_ongoing_requests(), {}


def engine_autoscaling_config(config: dict[str, Any]):
    """Serve's ``AutoscalingConfig`` for ``Settings.autoscaling_config``: the operator's
    keys, with ``engine_load_policy`` unless a ``policy`` is named.

    Raises:
        ValueError: a key Serve does not know, or a value it refuses (pydantic's message).
    """
    from ray.serve.config import AutoscalingConfig

    unknown = sorted(set(config) - set(AutoscalingConfig.model_fields))
    if unknown:  # Serve's model ignores them: a typo would pass in silence
        raise ValueError(f"autoscaling_config: unknown keys {unknown}; Serve's are "
                         f"{sorted(AutoscalingConfig.model_fields)}")
    if "target_ongoing_requests" in config and config["target_ongoing_requests"] is None:
        raise ValueError("autoscaling_config: target_ongoing_requests must be a number")
    merged = dict(config)
    merged.setdefault("policy", {"policy_function": POLICY_PATH})
    try:
        out = AutoscalingConfig(**merged)
    except Exception as exc:  # pydantic v1 or v2 ValidationError, TypeError
        raise ValueError(f"autoscaling_config: {exc}") from None
    if out.min_replicas < 1:  # Serve's parsed value (a variable's text is read as a number)
        # a fleet at zero never wakes: the ingress answers 503 with no replica and sends no
        # request through Serve's handle, so Serve's cold start never sees demand
        raise ValueError("autoscaling_config: min_replicas must be at least 1")
    return out
