"""DecodeConfig: one decode worker's settings, the shared WorkerConfig's and its own (a
dataclass the deploy package loads from YAML)."""

from __future__ import annotations

from dataclasses import dataclass, field

from servekit.worker import WorkerConfig

PACINGS = ("gap", "mean")  # DecodeConfig.tbt_pacing


@dataclass
class DecodeConfig(WorkerConfig):
    worker_id: str = "decode-0"
    # panels: decode steps faster than oneDNN's
    prepack_weights: str = "panels"
    # KV pool size in bytes (0 = num_blocks blocks): the same bytes hold more tokens packed;
    # admission never exceeds the pool
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
    # sequences waiting for admission beyond this are refused (RESOURCE_EXHAUSTED)
    max_waiting: int = 1024
    # publish the prompt + answer full blocks at the end (next turn starts warm)
    publish: bool = True
    pull_threads: int = 2  # background KV pulls and publishes
    # Decode streams open at once (running, pulling or waiting for admission)
    grpc_workers: int = 128
    trusted_stores: list[str] = field(default_factory=list)  # more store addresses to pull from
    # The part of its streams' shortest TBT objective a step may take, with the wait for the
    # CPUs a prefill on the same CPUs holds: the rest of that fraction, less the step, is
    # offered to the prefill as slack (servekit.CpuTurns.offer); the remainder is margin for a
    # step that runs long
    tbt_pace_fraction: float = 0.8
    # How a stream's objective bounds its gaps: "gap" holds every gap within it (Mooncake's TBT,
    # the mean of the slowest 10%), "mean" only its answer's mean gap so far (vLLM's TPOT: a
    # stream ahead of its objective banks the difference, and a prefill on the same CPUs may
    # spend it in one long gap, as vLLM's chunked prefill stalls its decodes)
    tbt_pacing: str = "gap"
    # A prompt prefilled here (the conductor's local_prefill_tokens) is computed this many
    # tokens a forward at most: each chunk takes its turn at the CPUs like a step
    prefill_chunk_tokens: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_batch <= 0:
            raise ValueError("DecodeConfig: max_batch must be positive")
        if not 0 < self.tbt_pace_fraction <= 1:
            raise ValueError(
                "DecodeConfig.tbt_pace_fraction: a fraction in (0, 1], got "
                f"{self.tbt_pace_fraction}"
            )
        if self.tbt_pacing not in PACINGS:
            raise ValueError(
                f"DecodeConfig.tbt_pacing: one of {', '.join(PACINGS)}, got {self.tbt_pacing!r}"
            )
        if self.prefill_chunk_tokens <= 0:
            raise ValueError(
                "DecodeConfig.prefill_chunk_tokens: must be positive, got "
                f"{self.prefill_chunk_tokens}"
            )
        if self.stream_interval <= 0:
            raise ValueError(
                f"DecodeConfig: stream_interval must be positive, got {self.stream_interval}"
            )
