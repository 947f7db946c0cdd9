"""PrefillConfig: one prefill worker's settings, the shared WorkerConfig's and its own (a
dataclass the deploy package loads from YAML)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.client import CACHEGEN_LEVELS
from servekit.worker import WorkerConfig


@dataclass
class PrefillConfig(WorkerConfig):
    worker_id: str = "prefill-0"
    # auto: the faster at prefill sizes, bf16 panels where the CPU has AVX-512 BF16, else oneDNN's
    prepack_weights: str = "auto"
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
    device_cache: bool = True  # keep computed blocks resident in the pool as the top cache tier
    layerwise: bool = True  # publish each layer of new full blocks while later layers compute
    # CacheGen (kvstore/client/cachegen.py): encode each whole chunk of a prompt at these levels
    # and store them beside its blocks (e.g. [1, 2, 3]; [] = off), and fetch another node's
    # prefix as chunks, each at the level the measured throughput and the TTFT budget allow
    cachegen_levels: list[int] = field(default_factory=list)
    cachegen_fetch: bool = False
    # blocks per CacheGen chunk: 64 = 1024 tokens (CacheGen's chunks are 1-1.5K tokens; shorter
    # ones pay ~10% more for their scales and tables)
    cachegen_chunk_blocks: int = 64
    cachegen_prior_gbps: float = 1.0  # assumed link throughput until one is measured
    max_queue: int = 256  # queued requests beyond this are refused (RESOURCE_EXHAUSTED)
    # Prefill calls held at once (queued or computing), beyond max_queue's bound
    grpc_workers: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
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
        bad = [lv for lv in self.cachegen_levels if lv not in CACHEGEN_LEVELS]
        if bad:
            raise ValueError(
                f"PrefillConfig: cachegen_levels {bad} unknown; levels are {list(CACHEGEN_LEVELS)}"
            )
        if self.cachegen_chunk_blocks < 1 or self.cachegen_prior_gbps <= 0:
            raise ValueError(
                "PrefillConfig: cachegen_chunk_blocks and cachegen_prior_gbps must be positive"
            )
