"""What both workers build first: the model on its device, and the layout their blocks are
stored in (which names the fingerprint)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import KVLayout
from model import LoadedModel, kv_fingerprint, load_model
from servekit.kv_cache import kv_cache_layout
from servekit.worker.sampling import resolve_device, torch_dtype


class WorkerModel(NamedTuple):
    device: torch.device  # where the model and the pool live (from the config's device)
    dtype: torch.dtype  # the model's and the full-precision KV's dtype
    lm: LoadedModel  # the model, in that dtype
    layout: KVLayout  # the layout blocks are stored in (the config's KV cache type)
    fingerprint: str  # the block keys' model part: weights + that layout


def load_worker_model(config, lm: LoadedModel | None = None) -> WorkerModel:
    """The model (loaded unless `lm` is given, e.g. shared in tests) from a worker config's
    model, dtype and device, and its storage layout from block_size and the KV cache type."""
    device = resolve_device(config.device)
    dtype = torch_dtype(config.dtype)
    if device.type == "cuda":  # Triton launches and CUDA graphs go to the current device
        torch.cuda.set_device(device)
    if lm is None:
        lm = load_model(config.model, dtype, str(device), prepack=config.prepack_weights)
    layout = kv_cache_layout(lm.config, config, dtype)
    return WorkerModel(device, dtype, lm, layout, kv_fingerprint(lm.weights_id, layout))
