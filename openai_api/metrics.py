"""The HTTP server's Prometheus metrics (its own registry, served on its own /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# the routes counted by name; anything else is "other" (a label per stray path would grow forever)
ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
)


class HttpMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "halfmoon_http_requests",
            "HTTP API answers by route and status",
            ["route", "status"],
            registry=r,
        )
        # The same buckets as the conductor's halfmoon_ttft_seconds, so the two compare bucket by
        # bucket: the difference is what the HTTP layer adds.
        self.ttft = Histogram(
            "halfmoon_http_ttft_seconds",
            "Time to first token at the HTTP server (request read -> first text sent)",
            ["route"],
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.open_streams = Gauge(
            "halfmoon_http_open_streams", "Server-sent event streams in progress", registry=r
        )
        self.disconnects = Counter(
            "halfmoon_http_disconnects",
            "Requests whose client went away before the end (cancelled downstream)",
            registry=r,
        )
        self.conductor_errors = Counter(
            "halfmoon_http_conductor_errors",
            "Generate calls the conductor ended with an error, by gRPC status",
            ["code"],
            registry=r,
        )

    def route(self, path: str) -> str:
        return path if path in ROUTES else "other"
