"""ConductorConfig: the front door's settings (a dataclass the deploy package loads from YAML)."""

from __future__ import annotations

from dataclasses import dataclass, field

from conductor.planner import PlannerConfig
from servekit import (
    DTYPE_NAMES,
    SecurityConfig,
    check_kv_cache,
    config_from_dict,
    security_config,
)

ADMISSION_MODES = ("reject", "best_effort")


@dataclass
class ConductorConfig:
    model: str = "smollm2-135m"  # the cluster's model (its tokenizer and chat template load here)
    host: str = "127.0.0.1"  # address the gRPC server binds and advertises
    port: int = 0  # 0 = a free port
    metrics_port: int = 0  # Prometheus exporter on this port; 0 = off
    prefill_workers: list[str] = field(default_factory=list)  # prefill workers' gRPC addresses
    decode_workers: list[str] = field(default_factory=list)  # decode workers' gRPC addresses
    store_addresses: list[str] = field(default_factory=list)  # store nodes' addresses (Status)
    index_url: str = ""  # Redis URL of the global block index; "" = route without cache hits
    # The index is advisory: a lookup gives up after index_timeout_s (routing without cache
    # hits), and after a failure the next lookups skip it for index_retry_s
    index_timeout_s: float = 0.25
    index_retry_s: float = 1.0
    block_size: int = 16  # tokens per block; must match the workers'
    # KV cache type: auto (full precision, the compute dtype) | fp16 | bf16 (full precision kept
    # in 16 bits) | int8 (pools in the compute dtype, blocks stored and moved as int8) | kivi4 |
    # kivi2 (KIVI-packed blocks, keys per channel, values per token, with the most recent
    # kivi_residual tokens kept in full precision)
    kv_cache_dtype: str = "auto"
    kivi_group_size: int = 32  # KIVI quantization group (tokens for keys, channels for values)
    kivi_residual: int = 32  # KIVI's full-precision window, a multiple of block_size
    kivi_window_dtype: str = "auto"  # that window's dtype: auto (the compute dtype) | fp16 | bf16
    # The workers' KV dtype: part of the model fingerprint, so it must match theirs (the cluster
    # config's top-level dtype fills it).
    dtype: str = "float32"
    policy: str = (
        "mooncake"  # default routing policy (mooncake | load_balance | random | cache_off)
    )
    # mooncake: fetch a longer prefix held elsewhere only beyond this x the worker's own match
    kvcache_balancing_threshold: float = 1.5
    # mooncake: KV transfer speed assumed of a link until a prefill worker's fetches measure it
    # (1.0 = 1 GB/s); measured links replace it (logged and counted: halfmoon_link_assumed)
    transfer_mb_per_ms: float = 1.0
    # mooncake: a prompt with at most this many tokens left to compute after its decode host's
    # stored prefix is prefilled on the decode worker itself, between its steps, where that is
    # predicted no slower than on a prefill worker (conditional disaggregation); 0 = never
    local_prefill_tokens: int = 0
    random_seed: int = 0  # the random policy's seed
    ttft_slo_ms: float = 30_000.0  # default time-to-first-token objective (requests may set theirs)
    # default time-between-tokens objective (the mean of a request's slowest 10% of gaps); 0 = TBT
    # not judged (a cluster judged by TPOT alone)
    tbt_slo_ms: float = 2_000.0
    # default time-per-output-token objective (the mean gap, vLLM's benchmark's TPOT); 0 = not
    # judged. A request meets its objectives when each one set is met.
    tpot_slo_ms: float = 0.0
    # A request no pair is predicted to serve within its objectives: "reject" refuses it at once
    # (RESOURCE_EXHAUSTED with a retry-after, HTTP 429 with Retry-After); "best_effort" serves
    # it on the pair the policy would pick without objectives, never counted as good
    admission: str = "reject"
    max_tokens_limit: int = 4096  # the most new tokens one request may ask for
    # requests kept as a trace for RecentTrace (`halfmoon plan --conductor`); 0 = none kept
    recent_requests: int = 4096
    # workers' loads are refreshed when a request is routed or finishes, then at most every
    # load_poll_s while that goes on, and every load_idle_poll_s otherwise (fleet.py: LoadPoller)
    load_poll_s: float = 0.1
    load_idle_poll_s: float = 1.0
    load_timeout_s: float = 2.0  # deadline of a Load RPC
    prefill_timeout_s: float = 120.0  # deadline of a Prefill RPC
    decode_timeout_s: float = 900.0  # deadline of a Decode stream
    # Generate streams served at once (each holds a thread); the next is refused at once with
    # RESOURCE_EXHAUSTED, and health and Status keep threads of their own
    grpc_workers: int = 128
    # TLS and tokens (the cluster's `security` section): Generate and Status take an API token
    # (its tenant chooses the cache salt), ClearCache the cluster token
    security: SecurityConfig = field(default_factory=SecurityConfig)
    # The runtime planner (conductor/role_switch.py): watches attainment and each role's load
    # against the objectives and moves a worker from the lighter role to the bottleneck one,
    # drained first, its weights kept. The workers start switchable (servekit.SwitchableConfig).
    role_switching: bool = False
    planner: PlannerConfig = field(default_factory=PlannerConfig)  # its rule's settings

    def __post_init__(self) -> None:
        self.security = security_config(self.security, "ConductorConfig.security")
        if not isinstance(self.planner, PlannerConfig):
            self.planner = config_from_dict(PlannerConfig, self.planner, "conductor.planner")
        if self.block_size <= 0 or self.max_tokens_limit <= 0:
            raise ValueError("ConductorConfig: block_size and max_tokens_limit must be positive")
        if self.dtype not in DTYPE_NAMES:
            known = ", ".join(DTYPE_NAMES)
            raise ValueError(f"ConductorConfig: dtype must be one of {known}, got {self.dtype!r}")
        if not self.ttft_slo_ms > 0:
            raise ValueError(
                f"ConductorConfig.ttft_slo_ms: must be positive (ms), got {self.ttft_slo_ms}"
            )
        for name in ("tbt_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if not value >= 0:  # nan too
                raise ValueError(
                    f"ConductorConfig.{name}: must be >= 0 (ms; 0 = not judged), got {value}"
                )
        if self.recent_requests < 0:
            raise ValueError(
                "ConductorConfig.recent_requests: 0 (none kept) or a number of requests, got "
                f"{self.recent_requests}"
            )
        if self.local_prefill_tokens < 0:
            raise ValueError(
                "ConductorConfig.local_prefill_tokens: 0 (never) or a number of tokens, got "
                f"{self.local_prefill_tokens}"
            )
        if self.admission not in ADMISSION_MODES:
            raise ValueError(
                f"ConductorConfig.admission: one of {', '.join(ADMISSION_MODES)}, "
                f"got {self.admission!r}"
            )
        if self.load_poll_s <= 0 or self.load_idle_poll_s <= 0:
            raise ValueError("ConductorConfig: load_poll_s and load_idle_poll_s must be positive")
        check_kv_cache("ConductorConfig", self)
