"""Decode worker: block pull, continuous batching, paged decode, token streaming."""

from decode_node.config import DecodeConfig
from decode_node.worker import DecodeWorker

__all__ = ["DecodeConfig", "DecodeWorker"]
