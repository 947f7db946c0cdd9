"""PrefillConfig: one prefill worker's settings (a dataclass the deploy package loads from YAML)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.client import CACHEGEN_LEVELS
from servekit import (
    SecurityConfig,
    check_cpu_turns,
    check_dtype_device,
    check_kv_cache,
    parse_cpu_list,
    security_config,
)


@dataclass
class PrefillConfig:
    worker_id: str = "prefill-0"
    model: str = "smollm2-135m"  # a load_model name or path
    dtype: str = "float32"  # float32 | bfloat16 | float16 (weights and KV pool)
    device: str = "auto"  # auto | cpu | cuda | cuda:N (auto: CUDA when present)
    # CPU: the linear weights' packed form (kernels/packed_linear.py; same values, faster matmuls),
    # panels | onednn | auto | none (auto: the faster at prefill sizes, bf16 panels where the
    # CPU has AVX-512 BF16, else oneDNN's); dtypes without a packed path stay plain
    prepack_weights: str = "auto"
    host: str = "127.0.0.1"  # address the gRPC server binds and advertises
    port: int = 0  # 0 = a free port
    metrics_port: int = 0  # Prometheus exporter on this port; 0 = off
    num_blocks: int = 1024  # KV pool size in blocks (the device tier lives in it too)
    block_size: int = 16  # tokens per block; must match the store's and the decode workers'
    # KV cache type: auto (full precision, the compute dtype) | fp16 | bf16 (full precision kept
    # in 16 bits) | int8 (pools in the compute dtype, blocks stored and moved as int8) | kivi4 |
    # kivi2 (KIVI-packed blocks, keys per channel, values per token, with the most recent
    # kivi_residual tokens kept in full precision)
    kv_cache_dtype: str = "auto"
    kivi_group_size: int = 32  # KIVI quantization group (tokens for keys, channels for values)
    kivi_residual: int = 32  # KIVI's full-precision window, a multiple of block_size
    kivi_window_dtype: str = "auto"  # that window's dtype: auto (the compute dtype) | fp16 | bf16
    # most tokens of one request per prefill forward (chunked prefill); a multiple of block_size
    chunk_size: int = 512
    max_batch_tokens: int = 8192  # tokens one scheduling round takes from the queue
    # A round starts once no request has arrived for this long (ms), at most 10x this after the
    # first: a burst of requests (a client's concurrent calls reach the worker a few ms apart)
    # is prefilled in one batch instead of one request, then the rest, while a lone request
    # waits only this long. 0 = take only what is queued already
    batch_gather_ms: float = 8.0
    # ...but only while the round holds fewer prompt tokens than this: a forward of a few rows
    # reads every weight for little arithmetic, and one more request rides along nearly free;
    # from here on a forward is bound by its arithmetic, a companion only lengthens the round,
    # and waiting for one is latency the round's requests pay (8 ms of a 60 ms warm TTFT).
    # 0 = gather whatever the round holds.
    batch_gather_tokens: int = 256
    store_address: str = ""  # this host's store node (gRPC "HOST:PORT"); required
    store_node: str = ""  # that node's id in the index (the conductor matches prefixes by it)
    index_url: str = (
        ""  # Redis URL of the global index, to reach other hosts' store nodes; "" = none
    )
    # Each store call of the KV connector (a lookup, a transfer) gives up after this many seconds:
    # a stalled store node costs a recomputation, never a hung request
    kv_timeout_s: float = 30.0
    device_cache: bool = True  # keep computed blocks resident in the pool as the top cache tier
    layerwise: bool = True  # publish each layer of new full blocks while later layers compute
    # CacheGen (kvstore/cachegen.py): encode each whole chunk of a prompt at these levels and
    # store them beside its blocks (e.g. [1, 2, 3]; [] = off), and fetch another node's prefix
    # as chunks, each at the level the measured throughput and the TTFT budget allow
    cachegen_levels: list[int] = field(default_factory=list)
    cachegen_fetch: bool = False
    # blocks per CacheGen chunk: 64 = 1024 tokens (CacheGen's chunks are 1-1.5K tokens; shorter
    # ones pay ~10% more for their scales and tables)
    cachegen_chunk_blocks: int = 64
    cachegen_prior_gbps: float = 1.0  # assumed link throughput until one is measured
    max_queue: int = 256  # queued requests beyond this are refused (RESOURCE_EXHAUSTED)
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
    # Prefill calls held at once (queued or computing; each holds a thread); the next is refused
    # at once with RESOURCE_EXHAUSTED (as is one beyond max_queue), and health and Load keep
    # threads of their own
    grpc_workers: int = 32
    # TLS and tokens (the cluster's `security` section); every worker method is internal
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        self.security = security_config(self.security, "PrefillConfig.security")
        if self.block_size <= 0 or self.num_blocks <= 0:
            raise ValueError("PrefillConfig: block_size and num_blocks must be positive")
        if self.kv_timeout_s <= 0:
            raise ValueError(
                f"PrefillConfig: kv_timeout_s must be positive, got {self.kv_timeout_s}"
            )
        if self.batch_gather_ms < 0:
            raise ValueError(
                f"PrefillConfig: batch_gather_ms must be >= 0, got {self.batch_gather_ms}"
            )
        if self.batch_gather_tokens < 0:
            raise ValueError(
                f"PrefillConfig: batch_gather_tokens must be >= 0, got {self.batch_gather_tokens}"
            )
        if self.chunk_size <= 0 or self.chunk_size % self.block_size:
            raise ValueError(
                f"PrefillConfig: chunk_size ({self.chunk_size}) must be a positive multiple of "
                f"block_size ({self.block_size})"
            )
        check_dtype_device("PrefillConfig", self.dtype, self.device, self.prepack_weights)
        parse_cpu_list("PrefillConfig.cpus", self.cpus)
        check_cpu_turns("PrefillConfig", self)
        check_kv_cache("PrefillConfig", self)
        bad = [lv for lv in self.cachegen_levels if lv not in CACHEGEN_LEVELS]
        if bad:
            raise ValueError(
                f"PrefillConfig: cachegen_levels {bad} unknown; levels are {list(CACHEGEN_LEVELS)}"
            )
        if self.cachegen_chunk_blocks < 1 or self.cachegen_prior_gbps <= 0:
            raise ValueError(
                "PrefillConfig: cachegen_chunk_blocks and cachegen_prior_gbps must be positive"
            )
