"""The KV cache type a cluster runs (vLLM's `--kv-cache-dtype`): full precision, or KIVI-packed
with a full-precision residual window. It picks the layout blocks are stored in, and so the
fingerprint their keys chain from: blocks of different types never share keys."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

from kernels import dtype_name, kivi_layout_id

if TYPE_CHECKING:
    import torch

    from kernels import KVLayout

# The compute dtypes a worker runs in (and so a full-precision KV cache's own dtype), by name.
DTYPE_NAMES = ("float32", "bfloat16", "float16")


class KVCacheType(NamedTuple):
    """What one kv_cache_dtype keeps in blocks."""

    dtype: str | None  # full precision kept in this 16-bit type; None = the compute dtype
    store_codec: str  # the kvstore codec blocks travel and rest in: raw, or int8 (one scale per
    # token and head, or per latent row for MLA) with the pools in the compute dtype
    kivi_bits: int  # KIVI-packed at this many bits (its window: kivi_window_dtype); 0 = not KIVI


# kv_cache_dtype name -> what blocks hold (fp16/bf16: computing in fp32 on a CPU whose fast dtype
# is fp32, with the memory of a 16-bit cache)
KV_CACHE_DTYPES: dict[str, KVCacheType] = {
    "auto": KVCacheType(None, "raw", 0),
    "fp16": KVCacheType("float16", "raw", 0),
    "bf16": KVCacheType("bfloat16", "raw", 0),
    "int8": KVCacheType(None, "int8", 0),
    "kivi4": KVCacheType(None, "raw", 4),
    "kivi2": KVCacheType(None, "raw", 2),
}
# kivi_window_dtype name -> the dtype of KIVI's full-precision window (None = the compute dtype)
KIVI_WINDOW_DTYPES: dict[str, str | None] = {"auto": None, "fp16": "float16", "bf16": "bfloat16"}


def is_kivi(kv_cache_dtype: str) -> bool:
    """True for the KIVI-packed cache types."""
    return KV_CACHE_DTYPES[kv_cache_dtype].kivi_bits > 0


def check_kv_cache(owner: str, config) -> None:
    """ValueError naming `owner` unless config's KV cache settings (kv_cache_dtype,
    kivi_group_size, kivi_residual, kivi_window_dtype, block_size) are usable."""
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"{owner}: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
            f"got {config.kv_cache_dtype!r}"
        )
    if config.kivi_window_dtype not in KIVI_WINDOW_DTYPES:
        raise ValueError(
            f"{owner}: kivi_window_dtype must be one of {', '.join(KIVI_WINDOW_DTYPES)}, "
            f"got {config.kivi_window_dtype!r}"
        )
    if config.kivi_group_size < 1:
        raise ValueError(f"{owner}: kivi_group_size must be >= 1, got {config.kivi_group_size}")
    if config.kivi_residual < 0 or config.kivi_residual % config.block_size:
        raise ValueError(
            f"{owner}: kivi_residual ({config.kivi_residual}) must be a multiple of block_size "
            f"({config.block_size})"
        )


def _stored_dtype(model_config, config, dtype: str) -> tuple[KVCacheType, str]:
    """config's KV cache type and the name of the dtype its full-precision values are kept in
    (the blocks', or KIVI's window's), for compute dtype `dtype`."""
    kind = KV_CACHE_DTYPES[config.kv_cache_dtype]
    if not kind.kivi_bits:
        return kind, kind.dtype or dtype
    if model_config.is_mla:
        # one latent row per token: keys-per-channel / values-per-token has no meaning there
        raise ValueError(
            f"kv_cache_dtype {config.kv_cache_dtype} (KIVI) does not apply to an MLA model's "
            "latent cache; use auto, fp16, bf16 or int8"
        )
    return kind, KIVI_WINDOW_DTYPES[config.kivi_window_dtype] or dtype


def kv_cache_layout_id(model_config, config, dtype: str) -> str:
    """kv_cache_layout(model_config, config, <dtype>).fingerprint_id from the compute dtype's
    name (float32, bfloat16, float16), without building the layout: what a process that only
    computes block keys (the conductor) needs, and no torch."""
    kind, stored = _stored_dtype(model_config, config, dtype)
    c = model_config
    if not kind.kivi_bits:
        return c.kv_layout_id(config.block_size, stored, kind.store_codec)
    return kivi_layout_id(
        kind.kivi_bits,
        config.kivi_group_size,
        config.kivi_residual,
        stored,
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        config.block_size,
    )


# bytes of one value of each compute or full-precision KV dtype (DTYPE_NAMES), without torch
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_block_bytes(model_config, config, dtype: str) -> int:
    """kv_cache_layout(model_config, config, <dtype>).block_bytes from the compute dtype's name:
    one block of a worker's pool, what its num_blocks multiplies. Without torch for full
    precision and MLA (the launcher sizes `num_blocks: auto` pools with it and holds no
    tensors); KIVI's packed fields are sized by the kernels' own layout (imports torch)."""
    kind, stored = _stored_dtype(model_config, config, dtype)
    c = model_config
    if kind.kivi_bits:
        import torch

        return kv_cache_layout(model_config, config, getattr(torch, dtype)).block_bytes
    # the layouts' block shapes (kernels/layout.py): [layers, 2 (k|v), block_size, kv_heads,
    # head_dim], or MLA's [layers, block_size, kv_lora_rank + rope dims]
    width = c.kv_lora_rank + c.qk_rope_head_dim if c.is_mla else 2 * c.num_kv_heads * c.head_dim
    return c.num_layers * config.block_size * width * DTYPE_BYTES[stored]


def kv_cache_layout(model_config, config, dtype: torch.dtype) -> KVLayout:
    """The layout a server's blocks are stored in, from its config's block_size, kv_cache_dtype,
    kivi_group_size, kivi_residual and kivi_window_dtype: full precision (in `dtype`, the compute
    dtype, or the 16-bit type named), or KIVI-packed with a window in `dtype` or the type
    named."""
    import torch  # here: the conductor imports this module, computes ids and holds no tensors

    from kernels import KiviKVLayout

    kind, stored = _stored_dtype(model_config, config, dtype_name(dtype))
    c = model_config
    if not kind.kivi_bits:
        # the architecture's own layout (per-head K/V, or an MLA latent row), stored raw or in
        # the codec named
        layout = c.kv_layout(config.block_size, getattr(torch, stored))
        if kind.store_codec == "raw":
            return layout
        return dataclasses.replace(layout, store_codec=kind.store_codec)
    return KiviKVLayout(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        config.block_size,
        kind.kivi_bits,
        config.kivi_group_size,
        config.kivi_residual,
        getattr(torch, stored),
    )
