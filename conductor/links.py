"""The transfer estimates that could not use a measured link: counted, and logged once a link.

A prefill worker reports the links its fetches have measured (WorkerLoad.links); until it has
fetched from a store node, the policy weighs a fetch from there at the configured default speed
(`transfer_mb_per_ms`), which may be far from the real link. That is worth seeing, not hiding.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

from conductor.policy_types import Decision

log = logging.getLogger(__name__)


class AssumedLinks:
    def __init__(self, registry: CollectorRegistry, default_mb_per_ms: float):
        self.default_mb_per_ms = default_mb_per_ms
        self.counter = Counter(
            "halfmoon_link_assumed",
            "Routing decisions that weighed a fetch over a link not measured yet (the default "
            "transfer_mb_per_ms), by prefill worker and source store node",
            ["worker", "node"],
            registry=registry,
        )
        self._logged: set[tuple[str, str]] = set()

    def note(self, d: Decision) -> None:
        if not d.assumed_link:
            return
        self.counter.labels(d.prefill, d.assumed_link).inc()
        pair = (d.prefill, d.assumed_link)
        if pair not in self._logged:
            self._logged.add(pair)
            log.info(
                "%s has not fetched from %s yet: its transfer estimate assumes %g GB/s "
                "(transfer_mb_per_ms) until a fetch measures the link",
                d.prefill,
                d.assumed_link,
                self.default_mb_per_ms,
            )
