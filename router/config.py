"""The one settings object of prefix-router, read from a file and the environment.

Precedence (highest first): keyword arguments (for example the ``args:`` of a Ray Serve
config file), environment variables ``PREFIX_ROUTER_<FIELD>`` (nested fields with ``__``),
the YAML file named by ``PREFIX_ROUTER_CONFIG``, then the defaults below. Every field is
documented in ``docs/configuration.md``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator
from pydantic_settings import (BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict,
                               YamlConfigSettingsSource)

from router.hashing import HashSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "tiny-qwen2"
POLICY_NAMES = ("prefix_aware", "round_robin", "random", "least_loaded")


class Settings(BaseSettings):
    """All settings of the router, the ingress and the replicas.

    Units are in the field names (``_s`` seconds, ``_gib`` GiB, ``_tokens`` tokens).
    """

    model_config = SettingsConfigDict(env_prefix="PREFIX_ROUTER_", env_nested_delimiter="__",
                                      extra="forbid", validate_default=True)

    # --- model and engine -------------------------------------------------------------
    model: str = Field(str(DEFAULT_MODEL_DIR),
                       description="Local model directory served by every replica (config + "
                                   "tokenizer). The default is the generated tiny model.")
    served_model_name: Optional[str] = Field(
        None, description="Model name clients send; default: the directory's name.")
    tokenizer: Optional[str] = Field(None, description="Tokenizer directory; default: model.")
    engine: Literal["vllm", "sim"] = Field(
        "vllm", description="'vllm': vLLM's OpenAI server; 'sim': the simulated engine.")
    load_format: Optional[str] = Field(
        None, description="vLLM --load-format; default 'dummy' when the model directory has "
                          "no weight files.")
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="'auto' picks gpu when CUDA is visible to the replica.")
    max_model_len: Optional[int] = Field(None, description="vLLM --max-model-len.")
    dtype: str = Field("auto", description="vLLM --dtype.")
    enforce_eager: bool = Field(True, description="vLLM --enforce-eager (faster start on CPU).")
    cpu_kvcache_space_gib: int = Field(
        1, description="VLLM_CPU_KVCACHE_SPACE per CPU engine (GiB). Without it each engine "
                       "reserves ~92 % of RAM and the second one fails.")
    cpu_omp_threads_bind: str = Field(
        "nobind", description="VLLM_CPU_OMP_THREADS_BIND per CPU engine.")
    gpu_memory_utilization: float = Field(0.9, description="vLLM --gpu-memory-utilization.")
    max_num_seqs: Optional[int] = Field(None, description="vLLM --max-num-seqs.")
    extra_engine_args: list[str] = Field(default_factory=list,
                                         description="Further vLLM command-line arguments.")
    engine_start_timeout_s: float = Field(600.0, description="Wait for an engine's /health.")
    engine_restarts: int = Field(2, description="Restarts of a dead engine before the replica "
                                                "reports itself unhealthy to Ray Serve.")

    # --- hashing (must equal every engine's) ------------------------------------------
    block_size: int = Field(32, description="KV block size in tokens (CPU: multiple of 32).")
    hash_algo: Literal["xxhash_cbor", "sha256_cbor"] = Field(
        "xxhash_cbor", description="--prefix-caching-hash-algo of every engine.")
    hash_seed: str = Field("0", description="PYTHONHASHSEED given to every engine; the root "
                                            "of the block-hash chain.")

    # --- replicas on Ray Serve ----------------------------------------------------------
    num_replicas: int = Field(2, ge=0, description="Engine replicas.")
    replica_num_cpus: float = Field(0.5, ge=0, description="Ray logical CPUs per replica.")
    replica_num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (GPU machines).")
    ingress_replicas: int = Field(1, ge=1, description="Ingress (router) processes.")
    ingress_num_cpus: float = Field(0.25, ge=0, description="Ray logical CPUs per ingress.")
    max_ongoing_requests: int = Field(
        1024, ge=1, description="Per replica, in Ray Serve. Serve's default of 5 would divert "
                                "traffic from the replica the router chose.")
    kv_events_dir: Optional[str] = Field(
        None, description="Directory of the engines' KV-event IPC sockets (one publisher and "
                          "one replay socket per engine); default: the system temp dir.")

    # --- routing ------------------------------------------------------------------------
    policy: Literal["prefix_aware", "round_robin", "random", "least_loaded"] = Field(
        "prefix_aware", description="Routing policy by name.")
    load_factor: float = Field(
        1.35, ge=1.0, description="prefix_aware's load bound: a replica whose in-flight "
                                  "requests would exceed max(load_factor x mean, mean + 2) is "
                                  "passed over while another is within it. Lower: less "
                                  "imbalance, more prefixes recomputed on a second replica; "
                                  "the trade-off is measured in docs/benchmarks.md.")
    allow_policy_override: bool = Field(
        False, description="Honour an 'x-routing-policy' request header naming a policy "
                           "(benchmarks and tests compare policies on the same replicas).")
    redis_url: Optional[str] = Field(
        None, description="Redis URL for the shared index and load; none = in-process index.")
    redis_timeout_s: float = Field(
        0.05, gt=0, description="Bound on one index round trip; beyond it routing falls back to "
                                "load alone for that request.")
    index_namespace: str = Field("prefix-router", description="Prefix of every Redis key.")
    predicted_ttl_s: float = Field(
        600.0, gt=0, description="Lifetime of predicted index entries for a replica whose "
                                 "engine publishes no KV events (approximate mode): minutes, "
                                 "so a conversation's pauses do not lose its replica.")
    predicted_ttl_with_events_s: float = Field(
        15.0, gt=0, description="Lifetime of predicted entries for a replica whose KV events "
                                "flow: long enough for a burst of siblings to land together "
                                "before the first BlockStored arrives.")
    kv_events_grace_s: float = Field(
        5.0, gt=0, description="A replica whose engine sent no KV-event batch this long after "
                               "a request with a full prompt block completed is reported as "
                               "publishing no events.")
    prefill_tokens_per_s: float = Field(
        20000.0, gt=0, description="Initial prefill rate per replica for the cost model; "
                                   "replaced by the measured rate once requests complete.")
    decode_step_s: float = Field(
        0.005, ge=0, description="Initial cost of one decode step per running sequence batch, "
                                 "for the decode-pressure term (s).")
    tie_tolerance_s: float = Field(
        0.002, ge=0, description="Costs within this of the minimum count as ties; ties go to "
                                 "the replica that waited longest since its last assignment.")

    # --- ingress ------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="HTTP bind address of Ray Serve's proxy.")
    port: int = Field(8000, description="HTTP port of Ray Serve's proxy.")
    max_body_bytes: int = Field(100 * 1024 * 1024, gt=0,
                                description="Largest request body accepted (413 beyond).")
    route_tokenize_max_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="Request bodies larger than this are routed by "
                                           "load without rendering or tokenizing the prompt "
                                           "(a 20 MB prompt took 25 s to tokenize; the engine "
                                           "gives the authoritative answer).")
    route_head_chars: int = Field(
        2048, ge=0, description="Under prefix_aware, a prompt longer than this (characters) "
                                "is tokenized up to about here first, and the rest only if a "
                                "replica holds every block of that head (no replica can "
                                "match further otherwise); a long new prompt then costs the "
                                "router a head's tokenization, not the whole prompt's. "
                                "0: always tokenize whole.")
    request_timeout_s: float = Field(
        1800.0, gt=0, description="Upper bound of one request to an engine.")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get("PREFIX_ROUTER_CONFIG")
        if path:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)

    @field_validator("block_size")
    @classmethod
    def _block_size_positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("block_size must be positive")
        return v

    @model_validator(mode="after")
    def _defaults_from_model(self) -> "Settings":
        if self.served_model_name is None:
            self.served_model_name = Path(self.model).name
        if self.tokenizer is None:
            self.tokenizer = self.model
        return self

    @property
    def hash_settings(self) -> HashSettings:
        return HashSettings(block_size=self.block_size, hash_algo=self.hash_algo,
                            seed=self.hash_seed)

    def policy_for(self, requested: str | None) -> str:
        """The policy a request runs: its own (``x-routing-policy``) when
        ``allow_policy_override`` and it asks for one, else the configured ``policy``."""
        return requested if requested and self.allow_policy_override else self.policy

    def policy_kwargs(self, policy: str) -> dict[str, Any]:
        """Keyword arguments of ``router.policies.make_policy`` for ``policy`` from these
        settings (only ``prefix_aware`` takes any: its ``load_factor``)."""
        return {"load_factor": self.load_factor} if policy == "prefix_aware" else {}

    def dump(self) -> dict[str, Any]:
        """JSON-serialisable dict of every field (to pass to other processes)."""
        return self.model_dump(mode="json")


def settings_markdown() -> str:
    """The configuration reference (docs/configuration.md) generated from the fields."""
    rows = ["| setting | environment variable | default | description |", "|---|---|---|---|"]
    for name, f in Settings.model_fields.items():
        default = f.default_factory() if f.default_factory else f.default
        if name == "model":
            default = "models/tiny-qwen2 (generated)"
        rows.append(f"| `{name}` | `PREFIX_ROUTER_{name.upper()}` | `{default!r}` | "
                    f"{(f.description or '').replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(settings_markdown())
