"""The conductor's Prometheus series (named as the dashboards and alerts know them) and the
running totals its Status reports."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ConductorMetrics:
    """Every series the conductor exports, registered on the server's own registry."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.requests = Counter(
            "halfmoon_requests", "Generate requests by finish reason", ["reason"], registry=r
        )
        self.rejected = Counter("halfmoon_rejections", "Requests refused", ["reason"], registry=r)
        self.ttft = Histogram(
            "halfmoon_ttft_seconds",
            "Time to first token (at the conductor)",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.tbt = Histogram(
            "halfmoon_tbt_seconds",
            "Time between tokens (at the conductor)",
            registry=r,
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
        )
        self.prompt = Counter("halfmoon_prompt_tokens", "Prompt tokens", registry=r)
        self.cached = Counter(
            "halfmoon_cached_tokens",
            "Prompt tokens served from a cache, by tier",
            ["tier"],
            registry=r,
        )
        self.generated = Counter("halfmoon_generated_tokens", "Tokens generated", registry=r)
        # goodput = rate(halfmoon_slo_requests_total{outcome="met"}); attainment = met / all
        self.slo = Counter(
            "halfmoon_slo_requests",
            "Requests by their objectives: met (TTFT and TBT within the request's objectives), "
            "missed (answered late), best_effort (served although predicted to miss, never "
            "counted as good), rejected (refused early: SLOs or a full worker queue; a full "
            "door counts in halfmoon_busy_refusals)",
            ["outcome"],
            registry=r,
        )
        self.mismatch = Counter(
            "halfmoon_worker_mismatch",
            "Load reports refused: the worker serves another model fingerprint",
            ["worker"],
            registry=r,
        )
        self.errors = Counter(
            "halfmoon_conductor_errors",
            "Failures the conductor worked around (index_lookup, index_skipped, store_status, "
            "worker_load, worker_memory, prefill_lost, decode_lost)",
            ["what"],
            registry=r,
        )
        # the runtime planner (role_switch.py)
        self.role_switches = Counter(
            "halfmoon_role_switches",
            "Workers the runtime planner moved between roles, by outcome: done (drained, "
            "switched, serving its new role), abandoned (not drained in drain_timeout_s: it kept "
            "its role), failed (the worker refused or did not come back as the new role)",
            ["from_role", "to_role", "outcome"],
            registry=r,
        )
        self.role_workers = Gauge(
            "halfmoon_role_workers", "Workers serving each role now", ["role"], registry=r
        )
        self.role_pressure = Gauge(
            "halfmoon_role_pressure",
            "Each role's load against its objective at the planner's last look (1 = at it): "
            "prefill, a new prompt's queue wait over the TTFT objective; decode, the step time "
            "over the TBT objective or the batch over its bound",
            ["role"],
            registry=r,
        )


@dataclass
class Totals:
    """Counts since start, for Status (the series above count the same by label). Request
    threads update them: under `lock`."""

    requests: int = 0  # requests routed, each counted once however often it is routed again
    rejected: int = 0  # refused after validation (SLOs, a full worker queue), never admitted
    prompt_tokens: int = 0  # prompt tokens of the requests that finished
    cached_tokens: int = 0  # of those, the tokens whose KV came from a cache tier
    slo_met: int = 0  # finished requests whose TTFT and TBT met their objectives
    slo_missed: int = 0  # finished requests that missed either (best-effort ones included)
    best_effort: int = 0  # finished requests served best-effort (admission: best_effort)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
