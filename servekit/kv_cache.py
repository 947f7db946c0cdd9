"""The KV cache type a cluster runs (vLLM's `--kv-cache-dtype`): full precision, or KIVI-packed
with a full-precision residual window. It picks the layout blocks are stored in, and so the
fingerprint their keys chain from: blocks of different types never share keys."""

from __future__ import annotations

import torch

from kernels import FullKVLayout, KiviKVLayout, KVLayout

KV_CACHE_DTYPES = {"auto": 0, "kivi4": 4, "kivi2": 2}  # name -> KIVI bits (0 = full precision)


def check_kv_cache(
    owner: str, kv_cache_dtype: str, group_size: int, residual: int, block_size: int
) -> None:
    """ValueError naming `owner` unless the KV cache settings are usable."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"{owner}: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
            f"got {kv_cache_dtype!r}"
        )
    if group_size < 1:
        raise ValueError(f"{owner}: kivi_group_size must be >= 1, got {group_size}")
    if residual < 0 or residual % block_size:
        raise ValueError(
            f"{owner}: kivi_residual ({residual}) must be a multiple of block_size ({block_size})"
        )


def kv_cache_layout(model_config, config, dtype: torch.dtype) -> KVLayout:
    """The layout a server's blocks are stored in, from its config's block_size, kv_cache_dtype,
    kivi_group_size and kivi_residual: full precision in `dtype`, or KIVI-packed whose window
    holds `dtype`."""
    bits = KV_CACHE_DTYPES[config.kv_cache_dtype]
    c = model_config
    if not bits:
        return FullKVLayout(c.num_layers, c.num_kv_heads, c.head_dim, config.block_size, dtype)
    return KiviKVLayout(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        config.block_size,
        bits,
        config.kivi_group_size,
        config.kivi_residual,
        dtype,
    )
