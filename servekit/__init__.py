"""What every halfmoon server shares: the gRPC scaffold, config loading, sampling/dtype/device
conversions, request validation, the fitted time models and the role registry.

The neutral ground of the server packages: `conductor`, `prefill_node`, `decode_node` and `kvstore`
import it and never one another."""

import importlib

from servekit.blocks import blocks_needed, reusable_blocks
from servekit.call_limit import CONTROL_THREADS, CallLimit
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
from servekit.cpus import CpuTurns, check_cpu_turns, cpu_turns, parse_cpu_list, pin_process
from servekit.grpc_server import GrpcServer
from servekit.kv_cache import (
    DTYPE_NAMES,
    KIVI_WINDOW_DTYPES,
    KV_CACHE_DTYPES,
    check_kv_cache,
    is_kivi,
    kv_cache_layout,
    kv_cache_layout_id,
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
from servekit.request_guard import DecodeGuard
from servekit.roles import ROLES, Role, role_classes
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

# Names whose modules import torch (and the model), loaded on first use: the store node and the
# conductor import this package but hold no tensors, and torch alone costs a process ~170 MB.
_LAZY = {
    **dict.fromkeys(
        (
            "check_device",
            "check_dtype_device",
            "resolve_device",
            "sampling_params",
            "torch_dtype",
        ),
        "servekit.sampling",
    ),
    # the model's prompt rules (torch-free, but a store node imports no model)
    **dict.fromkeys(("prompt_ids_problem", "sampling_problem", "shown"), "servekit.validation"),
    "WorkerServer": "servekit.worker_server",
    "WorkerModel": "servekit.worker_model",
    "load_worker_model": "servekit.worker_model",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'servekit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # looked up once
    return value

__all__ = [
    "CONTROL_THREADS",
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
    "parse_cpu_list",
    "pin_process",
    "memory_usage",
    "resident_without_shared_memory",
    "release_freed_heap",
    "freeze_startup_objects",
    "tensor_bytes",
    "DTYPE_NAMES",
    "KIVI_WINDOW_DTYPES",
    "KV_CACHE_DTYPES",
    "ROLES",
    "DecodeTimeModel",
    "GrpcServer",
    "LinearTimeModel",
    "PrefillTimeModel",
    "Role",
    "WorkerModel",
    "WorkerServer",
    "blocks_needed",
    "check_device",
    "check_dtype_device",
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
    "kv_cache_layout",
    "kv_cache_layout_id",
    "load_worker_model",
    "predict",
    "prefill_features",
    "prompt_ids_problem",
    "resolve_device",
    "reusable_blocks",
    "role_classes",
    "sampling_params",
    "sampling_problem",
    "shown",
    "torch_dtype",
]
