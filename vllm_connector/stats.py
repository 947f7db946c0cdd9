"""The connector's counts in vLLM's own stats: logged with its throughput lines and exported on
its /metrics as `vllm:halfmoon_<counter>_total` (one series per engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_connector.worker import COUNTERS

_HELP = {
    "loaded_blocks": "KV blocks loaded from halfmoon's store into vLLM's pool",
    "failed_blocks": "KV blocks a load planned that the store did not give (missing or "
    "corrupt): their tokens were recomputed",
    "saved_blocks": "KV blocks the store holds after a save",
    "dropped_blocks": "KV blocks not saved (save queue full, store full or unreachable)",
}


@dataclass
class HalfmoonStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> HalfmoonStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data.get(k, 0) for k in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in COUNTERS)


class HalfmoonPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:halfmoon_{name}", documentation=_HELP[name], labelnames=labelnames
            )
            for name in COUNTERS
        }
        self._bound = {
            (engine, name): c.labels(*values)
            for engine, values in per_engine_labelvalues.items()
            for name, c in self._counters.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in COUNTERS:
            n = transfer_stats_data.get(name, 0)
            if n and (engine_idx, name) in self._bound:
                self._bound[(engine_idx, name)].inc(n)
