"""The prefill worker's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class PrefillMetrics:
    """Every metric the prefill worker exports, labelled with its worker id."""

    def __init__(self, registry: CollectorRegistry, worker: str):
        r, lab = registry, {"worker": worker}
        self.worker = worker
        self.requests = Counter(
            "halfmoon_prefill_requests",
            "Prefill requests by outcome",
            ["worker", "outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "halfmoon_prefill_rejections",
            "Prefill requests refused",
            ["worker", "reason"],
            registry=r,
        )
        self.cached = Counter(
            "halfmoon_prefill_cached_tokens",
            "Prompt tokens reused, by tier",
            ["worker", "tier"],
            registry=r,
        )
        self.computed = Counter(
            "halfmoon_prefill_computed_tokens", "Prompt tokens computed", ["worker"], registry=r
        ).labels(**lab)
        self.prefill = Histogram(
            "halfmoon_prefill_seconds",
            "Prefill time (compute) per request",
            ["worker"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        ).labels(**lab)
        self.queue = Histogram(
            "halfmoon_prefill_queue_seconds", "Time queued before compute", ["worker"], registry=r
        ).labels(**lab)
        self.queued = Gauge(
            "halfmoon_prefill_queued_requests", "Requests waiting", ["worker"], registry=r
        ).labels(**lab)
        self.free = Gauge(
            "halfmoon_prefill_free_blocks", "KV pool blocks free", ["worker"], registry=r
        ).labels(**lab)
