"""Which store nodes hold a prompt's leading blocks, as the global block index answers. The index
is advisory: when it cannot answer, requests are routed without cache knowledge."""

from __future__ import annotations

import logging
import time

from conductor.config import ConductorConfig
from conductor.metrics import ConductorMetrics
from kvstore import Index

log = logging.getLogger(__name__)


class PrefixIndex:
    """Lookups in the index (Redis), with an outage logged once and skipped for index_retry_s."""

    def __init__(self, config: ConductorConfig, metrics: ConductorMetrics):
        self.config = config
        self._index = (
            Index(config.index_url, timeout_s=config.index_timeout_s) if config.index_url else None
        )
        self._metrics = metrics
        self._down = False  # the last lookup failed (logged once per outage)
        self._retry_at = 0.0  # while down, lookups skip the index until then (monotonic)

    def matches(self, keys: list[bytes]) -> dict[str, int]:
        """The index's answer: node id -> leading blocks of these keys it holds. An unreachable
        index means routing without cache knowledge, logged once per outage and counted."""
        if self._index is None or not keys:
            return {}
        if self._down and time.monotonic() < self._retry_at:
            # a down (or hung) Redis costs one timeout per index_retry_s, not one per request
            self._metrics.errors.labels("index_skipped").inc()
            return {}
        try:
            found = self._index.longest_prefix(keys)
            matches = {
                node: int(f[0] if isinstance(f, tuple) else f.num_blocks)
                for node, f in found.items()
            }
        except Exception as exc:  # noqa: BLE001 - any index failure: route blind, say so
            self._metrics.errors.labels("index_lookup").inc()
            if not self._down:
                log.warning("index lookup failed, routing without cache hits: %r", exc)
            self._down = True
            self._retry_at = time.monotonic() + self.config.index_retry_s
            return {}
        if self._down:
            log.info("index lookups answer again")
            self._down = False
        return matches

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
