"""Decode worker: block pull, continuous batching, paged decode, token streaming.

Split as nano-vllm splits its engine: `DecodeWorker` (servicer.py) is gRPC only,
`DecodeScheduler` holds admission and the step loop, `DecodeRunner` the model, pool and KV
connector."""

from decode_node.config import DecodeConfig
from decode_node.runner import DecodeRunner
from decode_node.scheduler import DecodeScheduler
from decode_node.servicer import DecodeWorker

__all__ = ["DecodeConfig", "DecodeRunner", "DecodeScheduler", "DecodeWorker"]
