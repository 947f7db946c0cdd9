"""DecodeConfig: one decode worker's settings (a dataclass the deploy package loads from YAML)."""

from __future__ import annotations

from dataclasses import dataclass, field

from servekit import (
    SecurityConfig,
    check_cpu_turns,
    check_dtype_device,
    check_kv_cache,
    parse_cpu_list,
    security_config,
)


@dataclass
class DecodeConfig:
    worker_id: str = "decode-0"
    model: str = "smollm2-135m"  # a load_model name or path
    dtype: str = "float32"  # float32 | bfloat16 | float16 (weights and KV pool)
    device: str = "auto"  # auto | cpu | cuda | cuda:N (auto: CUDA when present)
    # CPU: the linear weights' packed form (kernels/packed_linear.py; same values, faster matmuls),
    # panels | onednn | auto | none (panels: decode steps faster than oneDNN's); dtypes without
    # a packed path stay plain
    prepack_weights: str = "panels"
    host: str = "127.0.0.1"  # address the gRPC server binds and advertises
    port: int = 0  # 0 = a free port
    metrics_port: int = 0  # Prometheus exporter on this port; 0 = off
    num_blocks: int = 1024  # KV pool size in blocks: admission never exceeds it
    block_size: int = 16  # tokens per block; must match the store's and the prefill workers'
    # KV cache type: auto (full precision, the compute dtype) | fp16 | bf16 (full precision kept
    # in 16 bits) | int8 (pools in the compute dtype, blocks stored and moved as int8) | kivi4 |
    # kivi2 (KIVI-packed blocks, keys per channel, values per token, with the most recent
    # kivi_residual tokens kept in full precision)
    kv_cache_dtype: str = "auto"
    kivi_group_size: int = 32  # KIVI quantization group (tokens for keys, channels for values)
    kivi_residual: int = 32  # KIVI's full-precision window, a multiple of block_size
    kivi_window_dtype: str = "auto"  # that window's dtype: auto (the compute dtype) | fp16 | bf16
    # KV pool size in bytes (0 = num_blocks blocks): the same bytes hold more tokens packed
    kv_cache_bytes: int = 0
    max_batch: int = 64  # sequences decoding together at most
    # CUDA: each decode step replays a CUDA graph captured at start, one per batch size up to
    # max_batch (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, ...; a batch runs the next size up,
    # padded), where the model's step can be captured (not a DeepSeek model with routed
    # experts); off: eager
    cuda_graphs: bool = True
    # Tokens a stream sends at once (SGLang's --stream-interval): 1 sends each as it comes; more
    # send fewer messages (each token's time still rides with it), which leaves the host's cores
    # to the decode steps when many streams share them
    stream_interval: int = 1
    max_waiting: int = (
        1024  # sequences waiting for admission beyond this are refused (RESOURCE_EXHAUSTED)
    )
    store_address: str = (
        ""  # this host's store node (gRPC "HOST:PORT"); required (answers are published there)
    )
    store_node: str = ""  # that node's id in the index
    # Each store call of the KV connector (a lookup, a transfer) gives up after this many seconds:
    # a stalled store node costs a recomputation, never a hung request
    kv_timeout_s: float = 30.0
    publish: bool = (
        True  # publish the prompt + answer full blocks at the end (next turn starts warm)
    )
    pull_threads: int = 2  # background KV pulls and publishes
    torch_threads: int = 0  # torch intra-op threads; 0 = torch's default (or one per `cpus`)
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
    # Decode streams open at once (running, pulling or waiting for admission; each holds a
    # thread); the next is refused at once with RESOURCE_EXHAUSTED, and health and Load keep
    # threads of their own
    grpc_workers: int = 128
    # the global index: with security on, a handle's store must be a node registered there (or
    # this worker's own store, or one of trusted_stores)
    index_url: str = ""
    trusted_stores: list[str] = field(default_factory=list)  # more store addresses to pull from
    # TLS and tokens (the cluster's `security` section); every worker method is internal
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        self.security = security_config(self.security, "DecodeConfig.security")
        if self.block_size <= 0 or self.num_blocks <= 0 or self.max_batch <= 0:
            raise ValueError("DecodeConfig: block_size, num_blocks and max_batch must be positive")
        if self.kv_timeout_s <= 0:
            raise ValueError(
                f"DecodeConfig: kv_timeout_s must be positive, got {self.kv_timeout_s}"
            )
        if self.stream_interval <= 0:
            raise ValueError(
                f"DecodeConfig: stream_interval must be positive, got {self.stream_interval}"
            )
        check_dtype_device("DecodeConfig", self.dtype, self.device, self.prepack_weights)
        parse_cpu_list("DecodeConfig.cpus", self.cpus)
        check_cpu_turns("DecodeConfig", self)
        check_kv_cache("DecodeConfig", self)
