"""What both workers build first: the model on its device and a paged KV pool beside it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from model import KVPool, LoadedModel, kv_fingerprint, load_model
from servekit.sampling import resolve_device, torch_dtype


class WorkerModel(NamedTuple):
    device: torch.device  # where the model and the pool live (from the config's device)
    lm: LoadedModel  # the model, in the config's dtype
    pool: KVPool  # the paged KV pool on that device
    fingerprint: str  # the block keys' model part: weights + the pool's KV layout


def load_worker_model(config, lm: LoadedModel | None = None) -> WorkerModel:
    """The model (loaded unless `lm` is given, e.g. shared in tests) and a pool of
    config.num_blocks blocks, from a worker config's model, dtype, device and block_size."""
    device = resolve_device(config.device)
    dtype = torch_dtype(config.dtype)
    if lm is None:
        lm = load_model(config.model, dtype=dtype, device=str(device))
    pool = KVPool(lm.config, config.num_blocks, config.block_size, dtype, device=device)
    return WorkerModel(device, lm, pool, kv_fingerprint(lm.weights_id, pool.layout))
