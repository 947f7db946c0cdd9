"""ClusterConfig: the servers' own config dataclasses composed with Ray and placement settings,
from YAML."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy.sizing import resolve_memory, take_auto
from servekit import (
    DTYPE_AUTO,
    ROLES,
    ConfigError,
    SecurityConfig,
    config_from_dict,
    cpu_flags,
    field_names,
    located,
    merge_config,
    parse_overrides,
    read_yaml,
    resolve_dtype,
    role_classes,
    security_config,
)

if TYPE_CHECKING:
    from openai_api import HttpConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "local.yaml"


def _http_config(**values: Any) -> HttpConfig:
    # openai_api is imported here, not with this module: what a cluster's servers are forked from
    # imports deploy (deploy/preload.py), and openai_api's FastAPI and pydantic, ~18 MiB resident,
    # were in every server process though none but the HTTP one uses them
    from openai_api import HttpConfig

    return HttpConfig(**values)


# cluster-wide values copied into every section that has such a field and does not set it itself
SHARED_KEYS = (
    "model",
    "dtype",
    "block_size",
    "host",
    "kv_cache_dtype",
    "kivi_group_size",
    "kivi_residual",
    "kivi_window_dtype",
)


@dataclass
class RayConfig:
    address: str = ""  # "" = start a local Ray instance; "auto" or "HOST:PORT" = join that cluster
    num_cpus: int = 0  # CPUs a local instance advertises; 0 = this machine's count
    object_store_mb: int = (
        128  # a local instance's object store (servers move KV over gRPC/shm, not Ray)
    )
    namespace: str = "halfmoon"
    # The nice value of the server processes a local instance starts (RAY_worker_niceness;
    # one already in the environment wins). Ray's own 15 put the servers below every ordinary
    # process on the host: Ray's daemons and the client preempted their OpenMP threads at once,
    # and the barriers waited (an 800-token prefill alone: 680-1,330 ms at 15, 430-580 at 0).
    worker_niceness: int = 0


@dataclass
class PlacementConfig:
    prefill_resource: str = (
        "prefill"  # workers go to nodes advertising this custom resource, if any do
    )
    decode_resource: str = "decode"
    resource_amount: float = (
        0.01  # of that resource each worker takes (so several can share a node)
    )
    gpus_per_worker: float = 1.0  # asked for only on nodes that have GPUs
    worker_num_cpus: float = (
        0.0  # Ray CPU accounting per worker/store/conductor actor (0 = no reservation)
    )


@dataclass
class SloConfig:
    """The objectives the cluster serves: the conductor admits each request against them (a
    request may set its own) and counts every answer as met or missed."""

    ttft_ms: float = 30_000.0  # time to first token
    # time between tokens (the mean of a request's slowest 10% of gaps); 0 = not judged
    tbt_ms: float = 2_000.0
    # time per output token (the mean gap: vLLM's benchmark's TPOT); 0 = not judged
    tpot_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.ttft_ms > 0:
            raise ConfigError(f"slo.ttft_ms must be a positive number of ms, got {self.ttft_ms}",
                              ("slo", "ttft_ms"))  # fmt: skip
        for name in ("tbt_ms", "tpot_ms"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(
                    f"slo.{name} must be a number of ms >= 0 (0 = not judged), got {value}",
                    ("slo", name),
                )


@dataclass
class ClusterConfig:
    model: str = "smollm2-135m"  # load_model name or path, for every server that loads the model
    # float32 | bfloat16 | float16 | auto: the fastest this CPU computes natively (bfloat16 with
    # AVX-512 BF16 or AMX, else float32), decided here, once for the whole cluster (the KV blocks'
    # fingerprint includes the dtype: every server must agree), and said at start
    dtype: str = DTYPE_AUTO
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto|fp16|bf16|int8|kivi4|kivi2 (see the workers' configs)
    kivi_group_size: int = 32
    kivi_residual: int = 32
    kivi_window_dtype: str = "auto"
    host: str = "127.0.0.1"  # every server binds and advertises this
    redis_url: str = ""  # global index; "" = $REDIS_URL, else an embedded Redis the launcher starts
    prefill_workers: int = 1
    decode_workers: int = 1
    metrics_base_port: int = (
        0  # servers export Prometheus metrics on consecutive ports from here; 0 = off
    )
    health_timeout_s: float = (
        300.0  # for every server to answer its health check (model loading included)
    )
    # the OpenAI-compatible HTTP server in front of the conductor (the Ray launcher starts it
    # beside the conductor); 0 = none
    http_port: int = 0
    # GOMP_SPINCOUNT of the servers' processes: the pauses an idle OpenMP thread spins before it
    # sleeps (libgomp's 300,000 spun on the cores a neighbour computed on: docs/operations.md).
    # 0 = libgomp's default; one already in the environment wins; on a Ray cluster this
    # launcher joins, it belongs in `ray start`'s environment.
    omp_spin_count: int = 1000
    ray: RayConfig = field(default_factory=RayConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    # templates of the servers' own configs; per-instance fields (ids, ports, addresses) are filled
    # at launch
    store: Any = None
    prefill: Any = None
    decode: Any = None
    conductor: Any = None
    http: HttpConfig = field(default_factory=_http_config)  # its template (port: http_port)
    # the objectives, given to the conductor (its own ttft_slo_ms / tbt_slo_ms / tpot_slo_ms
    # override them)
    slo: SloConfig = field(default_factory=SloConfig)
    # TLS, tokens and tenants, given to every server (a server's own `security` key overrides)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    # not a key: how the loader sized the `auto` KV tiers (deploy.sizing; None when none was)
    memory_plan: Any = field(default=None, init=False, repr=False, compare=False)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def cluster_config_from_dict(data: dict) -> ClusterConfig:
    """Validate and build; the servers' sections are checked against their own dataclasses."""
    data = dict(data or {})
    top = {f.name for f in dataclasses.fields(ClusterConfig) if f.init}
    unknown = sorted(set(data) - top)
    if unknown:
        known = ", ".join(sorted(top))
        raise ConfigError(
            f"cluster config: unknown key(s) {', '.join(unknown)} (known: {known})", (unknown[0],)
        )
    sections = {
        k: data.pop(k, None) or {}
        for k in (*ROLES, "ray", "placement", "http", "security", "slo")
    }
    for k, v in sections.items():
        if not isinstance(v, dict):
            raise ConfigError(f"cluster config: section {k!r} must be a mapping, got {v!r}", (k,))
    cfg = config_from_dict(ClusterConfig, data, "")
    cfg.ray = config_from_dict(RayConfig, sections["ray"], "ray")
    cfg.placement = config_from_dict(PlacementConfig, sections["placement"], "placement")
    cfg.slo = config_from_dict(SloConfig, sections["slo"], "slo")
    sections["conductor"] = {
        "ttft_slo_ms": cfg.slo.ttft_ms,
        "tbt_slo_ms": cfg.slo.tbt_ms,
        "tpot_slo_ms": cfg.slo.tpot_ms,
        **sections["conductor"],
    }
    try:
        cfg.security = security_config(sections["security"])
    except ValueError as exc:
        raise ConfigError(str(exc), getattr(exc, "keys", ()) or ("security",)) from None
    if not 0 <= cfg.http_port <= 65535:
        raise ConfigError(
            f"cluster config: http_port must be in [0, 65535], got {cfg.http_port}", ("http_port",)
        )
    if not 0 <= cfg.ray.worker_niceness <= 19:
        raise ConfigError(
            f"cluster config: ray.worker_niceness must be in [0, 19], got "
            f"{cfg.ray.worker_niceness}",
            ("ray", "worker_niceness"),
        )
    if cfg.omp_spin_count < 0:
        raise ConfigError(
            f"cluster config: omp_spin_count must be >= 0 (0 = libgomp's default), got "
            f"{cfg.omp_spin_count}",
            ("omp_spin_count",),
        )
    http = dict(sections["http"])
    if "port" in http:
        raise ConfigError(
            "cluster config: set the HTTP server's port with http_port, not http.port",
            ("http", "port"),
        )
    http.setdefault("host", cfg.host)
    http.setdefault("security", cfg.security)
    from openai_api import HttpConfig  # here, not at the top: see _http_config

    cfg.http = config_from_dict(HttpConfig, http, "http")
    auto: dict[str, bool] = {}  # section -> its KV tier's size said `auto`
    for role in ROLES:
        config_cls, _ = role_classes(role)  # imports the role's package
        section = dict(sections[role])
        names = field_names(config_cls)
        for k in SHARED_KEYS:
            if k in names and k not in section:
                section[k] = getattr(cfg, k)
        if "dtype" in section:
            section["dtype"] = resolve_dtype(section["dtype"])  # auto: this CPU's native dtype
        if "security" in names and "security" not in section:
            section["security"] = cfg.security
        auto[role] = take_auto(role, section)  # sized below, once every section is checked
        setattr(cfg, role, config_from_dict(config_cls, section, role))
    if cfg.prefill_workers < 1 or cfg.decode_workers < 1:
        worst = "prefill_workers" if cfg.prefill_workers < 1 else "decode_workers"
        raise ConfigError(
            "cluster config: prefill_workers and decode_workers must be >= 1", (worst,)
        )
    cfg.memory_plan = resolve_memory(cfg, auto)  # the `auto` sizes, from this machine's memory
    return cfg


def load_cluster_config(
    path: str | Path | None = None, overrides: list[str] = (), ray_address: str | None = None
) -> ClusterConfig:
    """The YAML at `path` (default: deploy/configs/local.yaml) with `--set` overrides applied. An
    error in the file names its line; one in an override names the override."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"no cluster config at {path}")
    data, lines = read_yaml(path)
    data = data or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}:1: expected a mapping at the top level")
    overridden = parse_overrides(list(overrides))
    data = merge_config(data, overridden)
    if ray_address is not None:
        data = merge_config(data, {"ray": {"address": ray_address}})
    try:
        return cluster_config_from_dict(data)
    except ConfigError as exc:
        if _in(overridden, exc.keys):
            raise ValueError(f"--set: {exc}") from None
        raise located(path, lines, exc) from None


def _in(tree: dict, keys: tuple[str, ...]) -> bool:
    """Whether the key path (or a section above it) is set in the nested mapping `tree`."""
    node: Any = tree
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return bool(keys)


def dtype_said(cfg: ClusterConfig) -> str:
    """The cluster's compute dtype as its start says it: "dtype bfloat16 (auto: ...)"."""
    dtype = cfg.conductor.dtype if cfg.conductor is not None else cfg.dtype
    if cfg.dtype != DTYPE_AUTO:
        return f"dtype {dtype}"
    flags = cpu_flags()
    named = (("AVX-512 BF16", "avx512_bf16"), ("AMX", "amx"))
    has = [name for name, key in named if flags.get(key)]
    why = f"this CPU has {' and '.join(has)}" if has else "this CPU has no native bf16"
    return f"dtype {dtype} (auto: {why})"
