"""The decode worker's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class DecodeMetrics:
    """Every metric the decode worker exports, labelled with its worker id."""

    def __init__(self, registry: CollectorRegistry, worker: str):
        r, lab = registry, {"worker": worker}
        self.worker = worker
        self.requests = Counter(
            "halfmoon_decode_requests",
            "Decode requests by finish reason",
            ["worker", "reason"],
            registry=r,
        )
        self.rejected = Counter(
            "halfmoon_decode_rejections",
            "Decode requests refused",
            ["worker", "reason"],
            registry=r,
        )
        self.tokens = Counter(
            "halfmoon_decode_tokens", "Tokens generated", ["worker"], registry=r
        ).labels(**lab)
        self.step = Histogram(
            "halfmoon_decode_step_seconds",
            "One decode step (the time between tokens of every running sequence)",
            ["worker"],
            registry=r,
            buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
        ).labels(**lab)
        self.batch = Histogram(
            "halfmoon_decode_batch_size",
            "Sequences per decode step",
            ["worker"],
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        ).labels(**lab)
        self.running = Gauge(
            "halfmoon_decode_running", "Sequences in the running batch", ["worker"], registry=r
        ).labels(**lab)
        self.free = Gauge(
            "halfmoon_decode_free_blocks", "KV pool blocks free", ["worker"], registry=r
        ).labels(**lab)
        self.pull = Histogram(
            "halfmoon_decode_pull_seconds", "KV pull time per sequence", ["worker"], registry=r
        ).labels(**lab)
        self.fused_attention = Gauge(
            "halfmoon_decode_fused_attention",
            "1 when CPU decode attention runs the fused C kernels (kernels/native.py); 0 when "
            "they could not be built and the torch path runs instead (the reason is logged)",
            ["worker"],
            registry=r,
        ).labels(**lab)
        self.graph_sizes = Gauge(
            "halfmoon_decode_cuda_graph_sizes",
            "Batch sizes whose decode step replays a CUDA graph (0: eager steps)",
            ["worker"],
            registry=r,
        ).labels(**lab)
        self.graph_fallbacks = Counter(
            "halfmoon_decode_cuda_graph_fallbacks",
            "Decode steps run eagerly where a CUDA graph was meant to run, by reason (capture: "
            "the step could not be captured; batch: larger than the largest graph; width: a "
            "block table wider than the graphs')",
            ["worker", "reason"],
            registry=r,
        )
        self.recomputed = Counter(
            "halfmoon_decode_recomputed_tokens",
            "Prompt tokens recomputed because their KV could not be pulled",
            ["worker"],
            registry=r,
        ).labels(**lab)
        self.prefilled_here = Counter(
            "halfmoon_decode_prefilled_tokens",
            "Prompt tokens computed here because the conductor routed their prefill here "
            "(conditional disaggregation; a planned block that could not be loaded counts in "
            "halfmoon_decode_recomputed_tokens too)",
            ["worker"],
            registry=r,
        ).labels(**lab)
