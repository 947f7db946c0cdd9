"""Prefill worker: prefix reuse, chunked and batched prefill, layer-wise write-out of full blocks.

Split as nano-vllm splits its engine: `PrefillWorker` (servicer.py) is gRPC only,
`PrefillScheduler` holds the queue and rounds, `PrefillRunner` the model, pool and KV connector."""

from prefill_node.config import PrefillConfig
from prefill_node.runner import PrefillRunner
from prefill_node.scheduler import PrefillScheduler
from prefill_node.servicer import PrefillWorker

__all__ = ["PrefillConfig", "PrefillRunner", "PrefillScheduler", "PrefillWorker"]
