"""Prefill worker: prefix reuse, chunked prefill, write-out of full blocks."""

from prefill_node.config import PrefillConfig
from prefill_node.device_cache import DevicePrefixCache
from prefill_node.sampling import sampling_params, torch_dtype
from prefill_node.worker import PrefillWorker

__all__ = ["DevicePrefixCache", "PrefillConfig", "PrefillWorker", "sampling_params", "torch_dtype"]
