"""What every halfmoon server shares: the gRPC scaffold, TLS and tokens, config loading, the
fitted time models, CPU pinning and turns, memory reports and the role registry.

The neutral ground of the server packages: `conductor`, `prefill_node`, `decode_node` and the
store node import it and never one another. It imports neither torch nor the model, so the store
node and the conductor stay small (59 and 51 MiB resident after import; torch alone is ~180).
Two parts that do are imported by name where they are used:
- `servekit.worker`: what both workers share (their config, model loading, the worker server,
  the request-to-sampling conversions); imports torch;
- `servekit.validation`: request checks against the model's prompt rules (the conductor and the
  workers); imports the torch-free half of `model`, which a store node never loads."""

from servekit.blocks import blocks_needed, reusable_blocks
from servekit.call_limit import CONTROL_THREADS, RETRY_AFTER_KEY, CallLimit
from servekit.config import (
    ConfigError,
    config_from_dict,
    config_from_yaml,
    field_names,
    located,
    merge_config,
    parse_overrides,
    read_yaml,
)
from servekit.cpus import (
    CpuTurns,
    check_cpu_turns,
    cpu_turns,
    decode_slack_ms,
    parse_cpu_list,
    pin_process,
    set_omp_spin_count,
)
from servekit.grpc_server import GrpcServer
from servekit.kv_cache import (
    DTYPE_BYTES,
    DTYPE_NAMES,
    KIVI_WINDOW_DTYPES,
    KV_CACHE_DTYPES,
    check_kv_cache,
    is_kivi,
    kv_block_bytes,
    kv_cache_layout,
    kv_cache_layout_id,
)
from servekit.logs import LOG_LEVEL_ENV, configure_server_logging
from servekit.machine import (
    DTYPE_AUTO,
    MachineMemory,
    cpu_flags,
    machine_memory,
    native_dtype,
    resolve_dtype,
)
from servekit.memory import (
    IDLE_TRIM_S,
    MemoryUsage,
    freeze_startup_objects,
    memory_usage,
    release_freed_heap,
    resident_without_shared_memory,
    tensor_bytes,
)
from servekit.memory_sizing import (
    MemoryPlan,
    PoolSpec,
    SizingError,
    plan_memory,
    sizes_said,
    split_kv_bytes,
)
from servekit.request_guard import DecodeGuard
from servekit.roles import (
    ROLES,
    WORKER_ROLES,
    Role,
    SwitchableConfig,
    role_classes,
    server_class,
    work_left,
)
from servekit.security import (
    AuthInterceptor,
    Caller,
    CertPaths,
    SecurityConfig,
    Tokens,
    add_port,
    caller_of,
    make_certs,
    open_channel,
    security_config,
    server_interceptors,
    ssl_client_context,
    ssl_server_context,
    tenant_salt,
    token_matches,
)
from servekit.timing import (
    DecodeTimeModel,
    LinearTimeModel,
    PrefillTimeModel,
    decode_features,
    predict,
    prefill_features,
)

__all__ = [
    "DTYPE_AUTO",
    "cpu_flags",
    "native_dtype",
    "resolve_dtype",
    "MachineMemory",
    "machine_memory",
    "MemoryPlan",
    "PoolSpec",
    "SizingError",
    "plan_memory",
    "sizes_said",
    "split_kv_bytes",
    "CONTROL_THREADS",
    "RETRY_AFTER_KEY",
    "CallLimit",
    "DecodeGuard",
    "AuthInterceptor",
    "Caller",
    "CertPaths",
    "SecurityConfig",
    "add_port",
    "caller_of",
    "make_certs",
    "open_channel",
    "security_config",
    "server_interceptors",
    "ssl_client_context",
    "ssl_server_context",
    "tenant_salt",
    "token_matches",
    "Tokens",
    "IDLE_TRIM_S",
    "MemoryUsage",
    "CpuTurns",
    "check_cpu_turns",
    "cpu_turns",
    "decode_slack_ms",
    "parse_cpu_list",
    "pin_process",
    "set_omp_spin_count",
    "memory_usage",
    "resident_without_shared_memory",
    "release_freed_heap",
    "freeze_startup_objects",
    "tensor_bytes",
    "DTYPE_BYTES",
    "DTYPE_NAMES",
    "KIVI_WINDOW_DTYPES",
    "KV_CACHE_DTYPES",
    "ROLES",
    "DecodeTimeModel",
    "GrpcServer",
    "LinearTimeModel",
    "PrefillTimeModel",
    "Role",
    "SwitchableConfig",
    "WORKER_ROLES",
    "blocks_needed",
    "check_kv_cache",
    "ConfigError",
    "config_from_dict",
    "config_from_yaml",
    "located",
    "merge_config",
    "parse_overrides",
    "read_yaml",
    "decode_features",
    "field_names",
    "is_kivi",
    "kv_block_bytes",
    "kv_cache_layout",
    "kv_cache_layout_id",
    "predict",
    "prefill_features",
    "reusable_blocks",
    "role_classes",
    "server_class",
    "LOG_LEVEL_ENV",
    "configure_server_logging",
    "work_left",
]
