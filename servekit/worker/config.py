"""WorkerConfig: the settings every worker (prefill and decode) shares; PrefillConfig and
DecodeConfig extend it with their own. A dataclass the deploy package loads from YAML."""

from __future__ import annotations

from dataclasses import dataclass, field

from servekit.cpus import check_cpu_turns, parse_cpu_list
from servekit.kv_cache import check_kv_cache
from servekit.security import SecurityConfig, security_config
from servekit.worker.sampling import check_dtype_device


@dataclass
class WorkerConfig:
    worker_id: str = "worker-0"
    model: str = "smollm2-135m"  # a load_model name or path
    dtype: str = "float32"  # float32 | bfloat16 | float16 (weights and KV pool)
    device: str = "auto"  # auto | cpu | cuda | cuda:N (auto: CUDA when present)
    # CPU: the linear weights' packed form (kernels/packed_linear.py; same values, faster matmuls),
    # panels | onednn | auto | none; dtypes without a packed path stay plain. Each role picks the
    # form that is faster at its sizes.
    prepack_weights: str = "auto"
    host: str = "127.0.0.1"  # address the gRPC server binds and advertises
    port: int = 0  # 0 = a free port
    metrics_port: int = 0  # Prometheus exporter on this port; 0 = off
    num_blocks: int = 1024  # KV pool size in blocks
    block_size: int = 16  # tokens per block; must match the store's and the other workers'
    # KV cache type: auto (full precision, the compute dtype) | fp16 | bf16 (full precision kept
    # in 16 bits) | int8 (pools in the compute dtype, blocks stored and moved as int8) | kivi4 |
    # kivi2 (KIVI-packed blocks, keys per channel, values per token, with the most recent
    # kivi_residual tokens kept in full precision)
    kv_cache_dtype: str = "auto"
    kivi_group_size: int = 32  # KIVI quantization group (tokens for keys, channels for values)
    kivi_residual: int = 32  # KIVI's full-precision window, a multiple of block_size
    kivi_window_dtype: str = "auto"  # that window's dtype: auto (the compute dtype) | fp16 | bf16
    store_address: str = ""  # this host's store node (gRPC "HOST:PORT"); required
    store_node: str = ""  # that node's id in the index (the conductor matches prefixes by it)
    # Redis URL of the global index ("" = none): to reach other hosts' store nodes, and with
    # security on, the registry a handle's store must be in
    index_url: str = ""
    # Each store call of the KV connector (a lookup, a transfer) gives up after this many seconds:
    # a stalled store node costs a recomputation, never a hung request
    kv_timeout_s: float = 30.0
    torch_threads: int = 0  # torch intra-op threads; 0 = one per core it may run on (`cpus`)
    # CPUs this worker's process runs on, e.g. "0-3" or "0,2" ("" = any): a prefill and a decode
    # worker on one host each keep to their own cores instead of thrashing each other's threads
    cpus: str = ""
    # Forwards take turns at the CPUs with the host's other workers on the same CPU set (a lock
    # file in /dev/shm; servekit.CpuTurns): "auto" when this worker's torch threads are more than
    # half of those CPUs (two such workers computing at once oversubscribe them), "on", "off".
    # A turn not had within cpu_turn_timeout_s is skipped (counted, logged): a hung neighbour
    # never stops this worker.
    cpu_turns: str = "auto"
    cpu_turn_timeout_s: float = 5.0
    # A forward that has held its turn this long hands it, between layers, to a worker waiting
    # for one (a decode step), then takes it back: the host's decode streams wait at most about
    # this plus a layer for their next token while a long prompt prefills. 0: never.
    cpu_turn_slice_ms: float = 50.0
    # Calls held at once (each holds a thread); the next is refused at once with
    # RESOURCE_EXHAUSTED, and health and Load keep threads of their own
    grpc_workers: int = 32
    # TLS and tokens (the cluster's `security` section); every worker method is internal
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        self.security = security_config(self.security, f"{owner}.security")
        if self.block_size <= 0 or self.num_blocks <= 0:
            raise ValueError(f"{owner}: block_size and num_blocks must be positive")
        if self.kv_timeout_s <= 0:
            raise ValueError(f"{owner}: kv_timeout_s must be positive, got {self.kv_timeout_s}")
        check_dtype_device(owner, self.dtype, self.device, self.prepack_weights)
        parse_cpu_list(f"{owner}.cpus", self.cpus)
        check_cpu_turns(owner, self)
        check_kv_cache(owner, self)
