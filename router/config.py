"""The one settings object of prefix-router, read from a file and the environment.

Precedence (highest first): keyword arguments (for example the ``args:`` of a Ray Serve
config file), environment variables ``PREFIX_ROUTER_<FIELD>`` (nested fields with ``__``),
the YAML file named by ``PREFIX_ROUTER_CONFIG``, then the defaults below. Every field is
documented in ``docs/configuration.md``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from router.hashing import HashSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "tiny-qwen2"


class LoraAdapter(BaseModel):
    """A LoRA adapter the engines serve: ``model: <name>`` in a request selects it.

    Attributes:
        name: the model name clients send (vLLM's ``--lora-modules name=path``).
        path: the adapter's directory (PEFT format: ``adapter_config.json`` and
            ``adapter_model.safetensors``) as the engines' nodes see it. vLLM 0.32 mixes
            this string into every block hash (``("lora", name, path)``), so it is passed
            on exactly as given.
        replicas: on how many replicas it is loaded; None: on every one. Adapter ``i``
            (in list order) with ``k`` replicas is loaded by the replicas of Serve rank
            ``(i * k + j) mod world_size`` for ``j < k``, so adapters spread over the fleet.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    replicas: Optional[int] = Field(None, ge=1)

    def loaded_on(self, index: int, rank: int, world_size: int) -> bool:
        """Whether the replica of Serve rank ``rank`` (of ``world_size``) loads this
        adapter, the ``index``-th of the settings' list."""
        if self.replicas is None or self.replicas >= world_size:
            return True
        return (rank - index * self.replicas) % world_size < self.replicas


class ExternalEngine(BaseModel):
    """An engine that runs outside Ray (on Kubernetes, on other hosts) and that the router
    reaches by URL: a vLLM OpenAI server, or any OpenAI-compatible server in predicted mode.
    A bare string is taken as its ``url``.

    Attributes:
        url: its OpenAI server's base URL, ``http(s)://host:port``.
        kv_events_endpoint: its ZMQ publisher, as the router connects to it
            (``tcp://host:port``; vLLM's ``--kv-events-config`` ``endpoint`` bound as
            ``tcp://*:port``). None: it publishes no events, and routing for it uses the
            router's predicted entries only.
        kv_replay_endpoint: its replay socket (``tcp://host:port``), or None.
        name: the replica id it is routed and reported by; default ``ext-`` and a digest of
            its URL (the same in every router process).
    """

    model_config = ConfigDict(extra="forbid")

    url: str = Field(pattern=r"^https?://[^/\s]+/?$")
    kv_events_endpoint: Optional[str] = Field(None, pattern=r"^tcp://\S+:\d+$")
    kv_replay_endpoint: Optional[str] = Field(None, pattern=r"^tcp://\S+:\d+$")
    name: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9._-]{1,64}$")

    @model_validator(mode="before")
    @classmethod
    def _from_url(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value

    @property
    def replica_id(self) -> str:
        """The id the router routes it by (``name``, else ``ext-`` and 10 hex digits of
        the SHA-256 of its URL)."""
        import hashlib
        digest = hashlib.sha256(self.url.rstrip("/").encode()).hexdigest()
        return self.name or "ext-" + digest[:10]


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
        "auto", description="'auto' picks gpu when Ray gave the replica a GPU "
                       "(replica_num_gpus > 0), else cpu.")
    max_model_len: Optional[int] = Field(None, description="vLLM --max-model-len.")
    dtype: str = Field("auto", description="vLLM --dtype.")
    enforce_eager: bool = Field(True, description="vLLM --enforce-eager (faster start on CPU).")
    cpu_kvcache_space_gib: int = Field(
        1, description="VLLM_CPU_KVCACHE_SPACE per CPU engine (GiB). Without it each engine "
                       "reserves ~92 % of RAM and the second one fails.")
    cpu_omp_threads_bind: str = Field(
        "nobind", description="VLLM_CPU_OMP_THREADS_BIND per CPU engine.")
    gpu_memory_utilization: float = Field(0.9, description="vLLM --gpu-memory-utilization.")
    kv_cache_memory_gib: Optional[float] = Field(
        None, gt=0, description="GPU: each engine's KV cache in GiB (vLLM "
                                "--kv-cache-memory-bytes; it then skips its memory profiling). "
                                "Set it when several engines share a GPU: started together, "
                                "they miscount its free memory (one H200, 2 engines at 0.4 "
                                "each: 9.3 and 23.4 GiB of KV cache instead of about 40).")
    tool_call_parser: Optional[str] = Field(
        None, description="vLLM --tool-call-parser (e.g. 'hermes' for Qwen2.5), with "
                          "--enable-auto-tool-choice, so requests with tool_choice 'auto' "
                          "are served; without it vLLM answers them with a 400.")
    generate_model_shape: Optional[Literal["tiny", "qwen2.5-0.5b", "qwen2.5-7b"]] = Field(
        None, description="When the model directory lacks config.json, tokenizer.json or "
                          "tokenizer_config.json, generate a model "
                          "of this shape there first (config and tokenizer, as "
                          "deploy/make_model.py does; the engines load dummy weights): "
                          "tiny, qwen2.5-0.5b or qwen2.5-7b. The "
                          "default tiny model is always generated when missing.")
    max_num_seqs: Optional[int] = Field(None, description="vLLM --max-num-seqs.")
    extra_engine_args: list[str] = Field(default_factory=list,
                                         description="Further vLLM command-line arguments.")
    lora_adapters: list[LoraAdapter] = Field(
        default_factory=list,
        description="LoRA adapters (a list of {name, path, replicas}: replicas None loads it "
                    "on every replica). The engines that load any start with --enable-lora "
                    "and --lora-modules; a request whose model names one is hashed with "
                    "the adapter as vLLM hashes it and routed among the replicas that "
                    "load it.")
    max_lora_rank: int = Field(16, ge=1, description="vLLM --max-lora-rank: the largest rank "
                                                     "of the adapters.")
    engine_start_timeout_s: float = Field(600.0, description="Wait for an engine's /health.")
    engine_restarts: int = Field(2, description="Restarts of a dead engine before the replica "
                                                "reports itself unhealthy to Ray Serve.")

    # --- hashing (must equal every engine's) ------------------------------------------
    block_size: int = Field(32, description="KV block size in tokens (CPU: multiple of 32).")
    hash_algo: Literal["xxhash_cbor", "sha256_cbor"] = Field(
        "xxhash_cbor", description="--prefix-caching-hash-algo of every engine.")
    hash_seed: str = Field("0", description="PYTHONHASHSEED given to every engine; the root "
                                            "of the block-hash chain.")
    extra_key_encoding: Literal["vllm-0.32", "vllm-0.26"] = Field(
        "vllm-0.32", description="How the engines' vLLM encodes a block's extra keys "
        "(cache_salt, LoRA) in its hash: vllm-0.32 tags them, vllm-0.26 does not "
        "(docs/reference.md 3.2). Set it to the engines' version: the start-up hash probe "
        "is unsalted and does not see a difference, and salted or LoRA requests would then "
        "match predicted entries only.")

    # --- replicas on Ray Serve ----------------------------------------------------------
    num_replicas: int = Field(2, ge=0, description="Engine replicas.")
    replica_num_cpus: float = Field(0.5, ge=0, description="Ray logical CPUs per replica.")
    replica_num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (GPU machines).")
    autoscaling_config: Optional[dict[str, Any]] = Field(
        None, description="Ray Serve's autoscaling_config of the engine deployment (its own "
                          "keys: min_replicas, max_replicas, initial_replicas, "
                          "target_ongoing_requests, upscale_delay_s, downscale_delay_s, "
                          "...); replaces num_replicas. Unless it names a policy, the "
                          "load it scales on is the engines' own requests running and "
                          "waiting (router.serve.autoscaling), which every data path "
                          "fills. None: a fixed num_replicas.")
    drain_timeout_s: float = Field(
        60.0, ge=0, description="When Serve stops a replica (scale-in, redeploy, python -m "
                                "deploy.stop; also serve shutdown and Ctrl-C, though Serve "
                                "has cut the clients at its proxies by then), the replica "
                                "first lets its engine finish what it serves: it waits until "
                                "the engine has had no request running or waiting, and "
                                "finished none, for 2 s (the routers stop sending to a "
                                "stopping replica once Serve tells them), at most this long, "
                                "then stops it (0: no wait). Serve's "
                                "graceful_shutdown_timeout_s, which bounds the whole stop, is "
                                "this plus 30 s, for the ingress replicas (which finish the "
                                "requests they relay) too.")
    ingress_replicas: int = Field(1, ge=1, description="Ingress (router) processes.")
    ingress_num_cpus: float = Field(0.25, ge=0, description="Ray logical CPUs per ingress.")
    max_ongoing_requests: int = Field(
        1024, ge=1, description="Per replica, in Ray Serve. Serve's default of 5 would divert "
                                "traffic from the replica the router chose.")
    data_path: Literal["direct", "serve"] = Field(
        "direct", description="How a request's bytes travel once routed. 'direct': the ingress "
                              "decides and streams from the chosen engine's HTTP server over "
                              "pooled keep-alive connections (Ray Serve hosts, places, "
                              "health-checks and scales the replicas). 'serve': through a "
                              "Serve handle call to the replica actor, which proxies to its "
                              "engine (one more process hop per request and per streamed "
                              "chunk). docs/benchmarks.md measures both.")
    engine_host: str = Field(
        "127.0.0.1", description="Address each engine's HTTP server binds. Loopback keeps "
                                 "engines private to their node (KV events over ipc://); on a "
                                 "cluster of several nodes bind 0.0.0.0: the replica then "
                                 "advertises its node's IP, and its engine publishes KV "
                                 "events on TCP ports of every interface, so routers on any "
                                 "node reach both.")
    external_engines: list[ExternalEngine] = Field(
        default_factory=list,
        description="Engines outside Ray that the router reaches by URL, beside (or, with "
                    "num_replicas 0, instead of) the engine replicas Ray runs: each a URL, "
                    "or {url, kv_events_endpoint, kv_replay_endpoint, name}. Without an "
                    "events endpoint, routing for it uses predicted entries only. Direct data "
                    "path only.")
    external_engines_file: Optional[str] = Field(
        None, description="A YAML or JSON file holding a list like external_engines, read "
                          "again whenever it changes (checked every external_engines_poll_s): "
                          "engines added there join the fleet, engines removed leave it.")
    external_engines_poll_s: float = Field(
        2.0, gt=0, description="How often the external engines are health-checked and "
                               "scraped, and their file checked for changes (s).")
    max_replicas_per_node: Optional[int] = Field(
        None, ge=1, description="Serve's max_replicas_per_node for the engine deployment: at "
                                "most this many engine replicas on one node (1 spreads them "
                                "one per node). Default: no limit.")
    kv_events_dir: Optional[str] = Field(
        None, description="Directory of the engines' KV-event IPC socket files (one publisher "
                          "and one replay socket per engine); default: none, Linux's "
                          "abstract socket namespace (no file, nothing left behind).")

    # --- routing ------------------------------------------------------------------------
    policy: Literal["prefix_aware", "round_robin", "random", "least_loaded"] = Field(
        "prefix_aware", description="Routing policy by name.")
    load_factor: Optional[float] = Field(
        None, ge=1.0, description="An operator's cap on imbalance for prefix_aware, off by "
                                  "default: a replica whose in-flight requests would exceed "
                                  "max(load_factor x mean, mean + 2) is passed over while "
                                  "another is within it. The cost model spreads hot prefixes "
                                  "without it (docs/architecture.md, 'The cost model'); a cap "
                                  "recomputes prefixes on a second replica.")
    allow_policy_override: bool = Field(
        False, description="Honour an 'x-routing-policy' request header naming a policy, and "
                           "'x-data-path' (direct or serve): benchmarks and tests compare "
                           "them on the same replicas. Off: such a header gets a 400.")
    redis_url: Optional[str] = Field(
        None, description="Redis URL for the shared index and load; none = in-process index.")
    redis_timeout_s: float = Field(
        0.05, gt=0, description="Bound on one index round trip; beyond it that request is "
                                "routed without the index (by this router's own recent "
                                "decisions and load).")
    redis_warm_connections: int = Field(
        16, ge=0, description="Connections to Redis each ingress process opens at start-up "
                              "(and keeps: redis-py never closes an idle one), so that the "
                              "first burst of concurrent requests does not open one per "
                              "request on its critical path (a TCP connect and redis-py's "
                              "CLIENT SETINFO round trips). 0: opened on demand only.")
    index_namespace: str = Field("prefix-router", description="Prefix of every Redis key.")
    redis_cluster: bool = Field(
        False, description="redis_url is a node of a Redis Cluster: the router uses redis-py's "
                           "cluster client, and the index and load keys are laid out in "
                           "index_shard_groups shard groups (required with it), so that each "
                           "atomic decision is one round trip to one shard "
                           "(docs/scaling.md).")
    index_shard_groups: Optional[int] = Field(
        None, ge=1, le=16384,
        description="Shard groups of the index (the Redis Cluster mode): the replicas are "
                    "partitioned into this many groups by rendezvous hashing of their ids, "
                    "every key of a group carries the group's hash tag (one cluster slot), "
                    "and a decision picks a group in the router (the prefixes this router "
                    "sent there, else consistent hashing of the prompt's first block with "
                    "bounded loads), then the replica within it in one script. About one "
                    "group per 8-16 replicas, and at least one per cluster master. None: "
                    "one Redis, no groups (every replica is a candidate of every decision).")
    index_group_load_factor: float = Field(
        1.25, ge=1.0,
        description="With index_shard_groups: a group whose requests in flight per replica "
                    "would exceed max(factor x mean, mean + 2) is passed over by the choice "
                    "of the group while another is within it (consistent hashing with "
                    "bounded loads).")
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
                               "its counters showed it computed a whole prompt block is "
                               "reported as publishing no events.")
    prefill_tokens_per_s: float = Field(
        20000.0, gt=0, description="Initial prefill rate per replica for the cost model; "
                                   "replaced by the measured rate once requests complete.")
    decode_step_s: float = Field(
        7.85e-6, ge=0, description="Step time one more decoding sequence adds (s): the cost "
                                   "model's decode terms (its prefill waits on the running "
                                   "decodes; its decode slows theirs). Default: the H200 "
                                   "profile of a 7B model (replicas/sim/profiles/"
                                   "h200-qwen2.5-7b.json, c_s_per_seq); other hardware: "
                                   "measure it (docs/benchmarks.md, calibration).")
    tie_tolerance_s: float = Field(
        0.002, ge=0, description="prefix_aware: costs within this (or within 5 %) of the "
                                 "lowest are near-ties, which go to the replica with the most "
                                 "cached tokens, then the lowest expected time to first token, "
                                 "then the fewest requests in flight, then the oldest last "
                                 "assignment.")
    shadow_policies: list[Literal["prefix_aware", "round_robin", "random", "least_loaded"]] = \
        Field(["round_robin", "least_loaded"],
              description="Policies evaluated beside the live one on sampled decisions, "
                          "without acting on them (router_shadow_* metrics); the live "
                          "policy is always evaluated too, as a copy.")
    shadow_sample_rate: float = Field(
        0.01, ge=0, le=1, description="Fraction of cache-aware decisions the shadow policies "
                                      "evaluate (0: off). Each sampled one costs one more "
                                      "load read (one Redis round trip with Redis) and the "
                                      "shadow choices (docs/benchmarks.md, 'Shadow "
                                      "evaluation').")

    # --- warm-up and re-homing ----------------------------------------------------------
    warmup_enabled: bool = Field(
        False, description="Warm a replica that joins with the fleet's hottest prefixes, and "
                           "re-home the hot prefixes that only a leaving (or drained) "
                           "replica held on the survivors: prefill-only requests (max_tokens "
                           "1) of the prefixes' token ids, bounded by warmup_tokens_per_s "
                           "and warmup_concurrency (docs/architecture.md, 'Warm-up and "
                           "re-homing'). Off by default: it spends engine prefill the "
                           "clients did not ask for, and without Redis every ingress "
                           "process warms on its own.")
    warmup_top_prefixes: int = Field(
        64, ge=1, description="The most prefixes one join warms, and one leave re-homes.")
    warmup_tokens_per_s: float = Field(
        8192.0, gt=0, description="Prefill tokens per second that one ingress process's "
                                  "warm-up requests may ask of the engines (a token bucket "
                                  "of one second's worth).")
    warmup_concurrency: int = Field(
        2, ge=1, description="Warm-up requests one ingress process has in flight at most.")
    warmup_half_life_s: float = Field(
        60.0, gt=0, description="Half-life of a prefix's decayed request count (s): how "
                                "fast a prefix stops being hot once its requests stop.")
    warmup_record_tokens: int = Field(
        2_000_000, ge=1024, description="Bound on the token ids of recent prefixes one ingress "
                                        "process keeps for warm-up (in memory only, 8 bytes "
                                        "each; never in Redis); the coldest go first.")

    # --- ingress ------------------------------------------------------------------------
    max_body_bytes: int = Field(100 * 1024 * 1024, gt=0,
                                description="Largest request body accepted (413 beyond).")
    max_header_bytes: int = Field(
        64 * 1024, gt=0, description="Most bytes of header names and values a request may "
        "carry (431 beyond). Enforced in Ray Serve's HTTP proxy by router.serve.header_guard, "
        "which reads it from the proxy's environment only: set it as "
        "PREFIX_ROUTER_MAX_HEADER_BYTES where the Ray nodes start (deploy/run.sh's "
        "environment), not in a config file's args. Not enforced in HAProxy mode.")
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
    render_threads: int | None = Field(
        None, ge=0, description="Threads of each ingress process that render, tokenize and "
                                "hash request bodies over 16 KiB, in arrival order (the "
                                "tokenizer runs without the GIL, so a burst of long prompts "
                                "uses several cores while the event loop serves I/O). None: "
                                "half the cores this process may run on, at most 4, and none "
                                "below 4 cores (the cores counted against a cgroup CPU "
                                "quota too). 0: render on the event loop, one request at a "
                                "time (bodies over 16 KiB on asyncio's default threads; "
                                "under prefix_aware with a long prompt split into a head, "
                                "only those over 1 MiB).")
    gc_freeze_at_start: bool = Field(
        True, description="Once an ingress process has started (its imports, tokenizer and "
                          "clients made), move every object it holds to Python's permanent "
                          "GC generation (gc.freeze, as vLLM's API server does after its "
                          "start-up): a full collection then walks only what was made since, "
                          "instead of the 0.6 M objects of the imports (about 300 ms on the "
                          "2-core VM, every request of the process stalled meanwhile).")
    request_timeout_s: float = Field(
        1800.0, gt=0, description="Upper bound of one request to an engine.")
    tenant_max_inflight: Optional[int] = Field(
        None, ge=1, description="Requests of one tenant (API keys on) that an ingress process "
                                "receives and prepares at once (from authentication to the end "
                                "of the rate-limit check: the body and its rendering, not the "
                                "wait for admission or the answer); more are answered 429. "
                                "Default: half of "
                                "the process's own bound (max_ongoing_requests x the most "
                                "engine replicas), so no one tenant can hold every request "
                                "slot with bodies that trickle in.")
    body_idle_timeout_s: float = Field(
        60.0, gt=0, description="A request body that stops arriving for this long (s) is "
                                "answered 408 and its connection freed (nginx's "
                                "client_body_timeout, 60 s by default): a client that "
                                "declares a body and stalls holds no request open.")

    # --- admission and priorities -------------------------------------------------------
    max_inflight_per_replica: Optional[int] = Field(
        None, ge=1, description="Admission bound: while every usable replica has this many "
                                "requests in flight (every router's), a new request waits in "
                                "the router's queue (by priority, then arrival) for at most "
                                "queue_timeout_s, then gets a 429 with Retry-After. None: "
                                "no bound, requests queue in the engines.")
    queue_timeout_s: float = Field(
        2.0, gt=0, description="Longest wait of a request in the router's admission queue "
                               "before its 429 (s). A request that finds no slot waits only "
                               "when a slot is at least 0.9 likely to free for it within this "
                               "time (from the ages of the requests in flight and recent hold "
                               "times); otherwise its 429 comes at once. A longer timeout "
                               "lets more requests wait.")
    retry_after_s: int = Field(
        1, ge=1, description="Retry-After of the admission 429 (s).")
    overloaded_queue_timeout_s: float = Field(
        0.005, gt=0, description="Longest wait (s) of a request that joins an admission queue "
                                 "that has not been empty for queue_timeout_s (a standing "
                                 "queue: sustained overload, not a burst), so that its 429 "
                                 "comes at once. The controlled-delay rule of B. Maurer, "
                                 "'Fail at Scale', ACM Queue 2015 (5 ms there). While the "
                                 "last 10 s brought over 1.5 x more arrivals than slots "
                                 "handed out, a request that finds no slot is refused "
                                 "without waiting, and before its body is rendered "
                                 "(Google's adaptive throttling, SRE book ch. 21).")
    sse_keepalive_s: Optional[float] = Field(
        15.0, gt=0, description="A streaming request that has no answer to send yet after "
                                "this long (waiting in the admission queue, or for its "
                                "engine's first byte) gets its 200 and an SSE comment "
                                "(': keep-alive') every sse_keepalive_s, so that proxies "
                                "with idle timeouts (nginx and AWS ALB: 60 s) keep the "
                                "connection; a refusal or error after that arrives as an "
                                "SSE error event. None: never (the status waits for the "
                                "answer).")
    priority_header: str = Field(
        "x-priority", description="Request header of a request's priority (an integer; lower "
                                  "is served first, as vLLM's priority field). With API keys, "
                                  "a request cannot go ahead of its tenant's priority.")
    engine_priority_scheduling: bool = Field(
        False, description="Start the engines with vLLM's --scheduling-policy priority and "
                           "send each request's priority in its body (vLLM refuses the "
                           "field otherwise).")

    # --- sessions ------------------------------------------------------------------------
    session_header: str = Field(
        "x-session-id", description="Request header naming a conversation (matched without "
                                    "regard to case or to '-' versus '_'); without it, "
                                    "OpenAI's 'user' field does (session_from_user). A "
                                    "session stays on its replica while that replica is "
                                    "usable and not overloaded, for every router (the pins "
                                    "are in Redis when redis_url is set).")
    session_from_user: bool = Field(
        True, description="Use the request's 'user' field as its session when it has no "
                          "session header.")
    session_ttl_s: float = Field(
        1800.0, gt=0, description="A session's pin lives this long after its last request (s).")
    session_overload_factor: float = Field(
        2.0, ge=1.0, description="A session leaves its replica (and is pinned anew) when that "
                                 "replica has more than this times the fleet's mean requests "
                                 "in flight plus one while another has fewer, or is at "
                                 "max_inflight_per_replica.")

    # --- tenants and security ------------------------------------------------------------
    api_keys_file: Optional[str] = Field(
        None, description="JSON file of API keys, stored as SHA-256 hashes, each mapped to a "
                          "tenant (router/serve/auth.py; make keys with python -m "
                          "router.serve.auth new-key). Set: every request needs "
                          "'Authorization: Bearer <key>' (401 otherwise) and the operator "
                          "endpoints an admin key (403); the file is re-read when it "
                          "changes. Unset (and no api_keys): no keys are checked.")
    api_keys: Optional[str] = Field(
        None, description="The same JSON document as api_keys_file, given whole (for keys "
                          "injected as an environment variable); both may be set.")
    tenant_cache_isolation: bool = Field(
        True, description="With API keys: give each tenant's requests its own vLLM "
                          "cache_salt, so no tenant's prompt reuses (or, by timing, "
                          "reveals) another tenant's cached blocks; tenants that share a "
                          "cache_group in the keys file share their cache.")
    cache_salt_secret: Optional[str] = Field(
        None, description="HMAC key of the tenants' cache salts: with it, whoever reaches an "
                          "engine directly cannot compute a tenant's salt. Every router "
                          "process must have the same one.")
    redis_tls_ca_file: Optional[str] = Field(
        None, description="CA certificate(s) that sign the Redis server's certificate, for a "
                          "rediss:// redis_url (default: the system's CAs).")
    redis_tls_cert_file: Optional[str] = Field(
        None, description="Client certificate for Redis servers that require one (mutual "
                          "TLS, tls-auth-clients yes).")
    redis_tls_key_file: Optional[str] = Field(
        None, description="Private key of redis_tls_cert_file.")

    # --- traces ---------------------------------------------------------------------------
    otlp_traces_endpoint: Optional[str] = Field(
        None, description="OTLP/HTTP traces endpoint, a full URL (e.g. "
                          "http://otel-collector:4318/v1/traces): each request's spans are "
                          "exported there, and the engines are started with vLLM's "
                          "--otlp-traces-endpoint (OTLP/HTTP) so that their spans join the "
                          "router's traces. None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT when "
                          "set, else tracing is off (docs/operations.md, 'Traces').")
    traces_sample_rate: float = Field(
        1.0, ge=0.0, le=1.0, description="Fraction of the traces the router starts that are "
                                         "recorded; a request with a traceparent follows "
                                         "its caller's sampling decision.")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings,
                                                     _UnknownVariables(settings_cls)]
        path = os.environ.get("PREFIX_ROUTER_CONFIG")
        if path:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)

    @field_validator("max_model_len", "kv_cache_memory_gib", "max_num_seqs",
                     "max_replicas_per_node", "load_factor", "index_shard_groups",
                     "max_inflight_per_replica", "sse_keepalive_s", "render_threads",
                     "tenant_max_inflight", mode="before")
    @classmethod
    def _none_spelled_out(cls, v: Any) -> Any:
        """An optional number's None as an environment variable can write it: ``none``,
        ``null`` (any case) or empty (a variable holds text only)."""
        if isinstance(v, str) and v.strip().lower() in ("", "none", "null"):
            return None
        return v

    @field_validator("block_size")
    @classmethod
    def _block_size_positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("block_size must be positive")
        return v

    @field_validator("autoscaling_config", mode="before")
    @classmethod
    def _autoscaling_values_from_text(cls, v: Any) -> Any:
        """Values given one per variable (``PREFIX_ROUTER_AUTOSCALING_CONFIG__<KEY>``) come
        as text: each is read as JSON where it parses (``4``, ``0.5``, ``true``)."""
        if not isinstance(v, dict):
            return v
        out = {}
        for key, value in v.items():
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    pass  # text it is (a policy's import path)
            out[key] = value
        return out

    @field_validator("autoscaling_config")
    @classmethod
    def _autoscaling_config_valid(cls, v: Optional[dict[str, Any]]):
        if v is not None:  # Serve's own model: its error names the bad key
            from router.serve.autoscaling import engine_autoscaling_config
            parsed = engine_autoscaling_config(v)
            # the values as Serve parsed them (a variable's "2" is 2), the policy as given
            v = {k: (x if k == "policy" else getattr(parsed, k)) for k, x in v.items()}
        return v

    @property
    def configured_replicas(self) -> int:
        """The replicas the service is ready with: ``num_replicas``, or with autoscaling
        its ``min_replicas`` (at least 1, ``engine_autoscaling_config`` checks it)."""
        if self.autoscaling_config is None:
            return self.num_replicas
        return max(int(self.autoscaling_config.get("min_replicas", 1)), 1)

    @property
    def engines_in_ray(self) -> bool:
        """Whether Ray runs engine replicas: False with ``num_replicas`` 0, the engines all
        reached by URL (``external_engines``; ``router.app.engine_deployment`` then pins the
        engine deployment at zero). With autoscaling, True (``min_replicas`` is at least 1,
        and ``num_replicas`` cannot be given beside it)."""
        return self.autoscaling_config is not None or self.num_replicas > 0

    @property
    def ingress_max_ongoing(self) -> int:
        """Requests Serve lets one ingress process hold at once (``max_ongoing_requests``
        times the most engine replicas, at least 100)."""
        return max(self.max_ongoing_requests * max(self.most_replicas, 1), 100)

    @property
    def tenant_inflight_limit(self) -> int:
        """``tenant_max_inflight``, or half of ``ingress_max_ongoing``."""
        return self.tenant_max_inflight or max(self.ingress_max_ongoing // 2, 1)

    @property
    def most_replicas(self) -> int:
        """The most engine replicas there can be: ``num_replicas``, or ``max_replicas``."""
        if self.autoscaling_config is None:
            return self.num_replicas
        return int(self.autoscaling_config.get("max_replicas", 1))

    @model_validator(mode="after")
    def _defaults_from_model(self) -> "Settings":
        # A relative directory is the caller's (serve run's working directory): made absolute
        # here, so the replicas' processes, started elsewhere, find the same one. A name that
        # is no local path (a model hub id) is left as it is, unless it is to be generated.
        for name in ("model", "tokenizer", "api_keys_file", "external_engines_file",
                     "redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file"):
            value = getattr(self, name)
            if value and not Path(value).is_absolute() and (
                    Path(value).exists() or (name == "model" and self.generate_model_shape)):
                setattr(self, name, str(Path(value).resolve()))
        if self.served_model_name is None:
            self.served_model_name = Path(self.model).name
        names = [a.name for a in self.lora_adapters]
        if len(set(names)) != len(names) or self.served_model_name in names:
            raise ValueError("lora_adapters need names of their own, unlike each other and "
                             f"the served model's {self.served_model_name!r}: {names}")
        if self.lora_adapters and self.engine != "vllm":
            raise ValueError("lora_adapters are served by engine 'vllm' only")
        for a in self.lora_adapters:  # as the engines get it: absolute when it exists here
            if not Path(a.path).is_absolute() and Path(a.path).exists():
                a.path = str(Path(a.path).resolve())
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.redis_cluster and not (self.redis_url and self.index_shard_groups):
            raise ValueError("redis_cluster needs redis_url (a node of the cluster) and "
                             "index_shard_groups (the keys of a decision must lie in one "
                             "slot)")
        if self.index_shard_groups and ("{" in self.index_namespace
                                        or "}" in self.index_namespace):
            raise ValueError("with index_shard_groups, index_namespace may hold no brace: "
                             "the first {...} of every key must be its group's hash tag")
        if (self.external_engines or self.external_engines_file) and self.data_path != "direct":
            raise ValueError("external_engines are reached on the direct data path only: a "
                             "Serve handle reaches only the engine replicas Ray runs")
        ids = [e.replica_id for e in self.external_engines]
        if len(set(ids)) != len(ids):
            raise ValueError(f"external_engines need URLs and names of their own: {ids}")
        if self.autoscaling_config is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("give num_replicas or autoscaling_config, not both: with "
                             "autoscaling, min_replicas and max_replicas bound the fleet")
        target = None if self.autoscaling_config is None else \
            self.autoscaling_config.get("target_ongoing_requests", 2)  # Serve's default
        if self.max_inflight_per_replica is not None and target is not None \
                and target >= self.max_inflight_per_replica:
            raise ValueError(
                f"autoscaling_config's target_ongoing_requests ({target}) must be below "
                f"max_inflight_per_replica ({self.max_inflight_per_replica}): admission keeps "
                "each engine at that bound, so the autoscaler would never see more and never "
                "scale out while requests wait")
        return self

    @property
    def engine_serves_other_nodes(self) -> bool:
        """Whether engines bind beyond loopback (``engine_host``), and so publish their KV
        events on TCP for routers on other nodes (``replicas.engine.EnginePorts``)."""
        import ipaddress
        host = self.engine_host.strip("[]")
        if host == "localhost":
            return False
        try:
            return not ipaddress.ip_address(host).is_loopback
        except ValueError:  # a host name: reached from elsewhere
            return True

    @property
    def hash_settings(self) -> HashSettings:
        return HashSettings(block_size=self.block_size, hash_algo=self.hash_algo,
                            seed=self.hash_seed, extra_key_encoding=self.extra_key_encoding)

    def adapter(self, model: Any) -> LoraAdapter | None:
        """The LoRA adapter a request's ``model`` names, or None (the base model)."""
        return next((a for a in self.lora_adapters if a.name == model), None) \
            if isinstance(model, str) else None

    def adapters_for(self, rank: int, world_size: int) -> list[LoraAdapter]:
        """The adapters the replica of Serve rank ``rank`` (of ``world_size``) loads."""
        return [a for i, a in enumerate(self.lora_adapters)
                if a.loaded_on(i, rank, max(world_size, 1))]

    def policy_for(self, requested: str | None) -> str:
        """The policy a request runs: its own (``x-routing-policy``) when
        ``allow_policy_override`` and it asks for one, else the configured ``policy``."""
        return requested if requested and self.allow_policy_override else self.policy

    def policy_kwargs(self, policy: str) -> dict[str, Any]:
        """Keyword arguments of ``router.policy.make_policy`` for ``policy`` from these
        settings (only ``prefix_aware`` takes any: its ``load_factor``, ``tie_abs_s`` and
        ``max_inflight``, the admission bound)."""
        return {"load_factor": self.load_factor, "tie_abs_s": self.tie_tolerance_s,
                "max_inflight": self.max_inflight_per_replica} \
            if policy == "prefix_aware" else {}

    @classmethod
    def given_twice(cls, args: dict[str, Any]) -> list[str]:
        """The settings in ``args`` (a Serve config's ``args:``) that a ``PREFIX_ROUTER_*``
        variable or the ``PREFIX_ROUTER_CONFIG`` file also sets, to another value: one line
        each, naming both sources and values. Empty when nothing conflicts.

        Raises:
            pydantic.ValidationError: a value in ``args`` or in the environment is invalid.
        """
        import yaml
        path = os.environ.get("PREFIX_ROUTER_CONFIG")
        from_file = yaml.safe_load(Path(path).read_text()) or {} if path else {}
        out = []
        for name, value in args.items():
            env = f"PREFIX_ROUTER_{name.upper()}"
            others = [(f"the environment variable {env}", _env_value(os.environ[env]))] \
                if env in os.environ else []
            if name in from_file:
                others.append((f"the config file {path}", from_file[name]))
            mine = getattr(cls(**{name: value}), name)
            for where, other in others:
                theirs = getattr(cls(**{name: other}), name)
                if theirs != mine:
                    out.append(f"{name} is {mine!r} in the application's args and {theirs!r} "
                               f"in {where}")
        return out

    def dump(self) -> dict[str, Any]:
        """JSON-serialisable dict of every field (to pass to other processes); with
        autoscaling, without ``num_replicas`` (it does not apply, and given back it would be
        refused beside ``autoscaling_config``)."""
        exclude = {"num_replicas"} if self.autoscaling_config is not None else None
        return self.model_dump(mode="json", exclude=exclude)

    def redacted(self) -> dict[str, Any]:
        """``dump()`` with secrets masked, for logs and the operator endpoints: the
        password of ``redis_url``, ``api_keys`` and ``cache_salt_secret``."""
        out = self.dump()
        if out.get("redis_url"):
            out["redis_url"] = redact_url(out["redis_url"])
        for name in ("api_keys", "cache_salt_secret"):
            if out.get(name):
                out[name] = "***"
        return out

    def redis_connection_kwargs(self) -> dict[str, Any]:
        """TLS keyword arguments of ``redis.asyncio.Redis.from_url`` for a ``rediss://``
        ``redis_url`` (redis-py reads none of them from the URL); empty otherwise."""
        if not (self.redis_url or "").startswith("rediss://"):
            return {}
        out: dict[str, Any] = {}
        for name, kw in (("redis_tls_ca_file", "ssl_ca_certs"),
                         ("redis_tls_cert_file", "ssl_certfile"),
                         ("redis_tls_key_file", "ssl_keyfile")):
            if getattr(self, name):
                out[kw] = getattr(self, name)
        return out


class _UnknownVariables(PydanticBaseSettingsSource):
    """``PREFIX_ROUTER_*`` environment variables that name no setting, given to the model
    under their own names so that ``extra="forbid"`` refuses them (pydantic-settings'
    environment source skips such names without a word: a misspelt
    ``PREFIX_ROUTER_NUM_REPLICA=3`` would run with the default). Known: a field's name,
    ``PREFIX_ROUTER_CONFIG``, and a nested key (``<FIELD>__<KEY>``) of a field that takes
    nested values (a dict, a list or a model: pydantic-settings reads ``__`` keys for such
    fields only, and drops them for the others)."""

    def get_field_value(self, field, field_name):  # every value comes from __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        prefix = "PREFIX_ROUTER_"
        fields = self.settings_cls.model_fields
        known = {name.upper() for name in fields} | {"CONFIG"}
        nested = {name.upper() for name, f in fields.items() if _takes_nested(f.annotation)}

        def unknown(name: str) -> bool:
            if not name.upper().startswith(prefix):
                return False
            head, sep, _ = name[len(prefix):].upper().partition("__")
            return head not in (nested if sep else known)
        return {name: value for name, value in os.environ.items() if unknown(name)}


def _takes_nested(annotation: Any) -> bool:
    """Whether a field of this type takes nested values (``Optional`` and ``Union``
    unwrapped): a dict, list, tuple or set, or a pydantic model."""
    import types
    import typing
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(_takes_nested(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _takes_nested(typing.get_args(annotation)[0])
    kind = origin or annotation
    return kind in (dict, list, tuple, set) or (
        isinstance(kind, type) and issubclass(kind, BaseModel))


def redact_url(url: str) -> str:
    """``url`` with the password of its user-info replaced by ``***``
    (``redis://user:secret@host`` → ``redis://user:***@host``)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _env_value(raw: str) -> Any:
    """A ``PREFIX_ROUTER_*`` value as pydantic-settings reads it: JSON for a list or a dict
    (``autoscaling_config``, ``lora_adapters``...), else the string itself."""
    import json
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, (dict, list)) else raw


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
