"""The KV cache type a cluster runs (vLLM's `--kv-cache-dtype`): full precision, or KIVI-packed
with a full-precision residual window. It picks the layout blocks are stored in, and so the
fingerprint their keys chain from: blocks of different types never share keys."""

from __future__ import annotations

import dataclasses

import torch

from kernels import KiviKVLayout, KVLayout

# kv_cache_dtype name -> what blocks hold: None = the compute dtype; a torch dtype = full
# precision stored in that 16-bit type (computing in fp32 on a CPU whose fast dtype is fp32, with
# the memory of a 16-bit cache); a str = the compute dtype in the pools, blocks stored and moved
# in that store codec (int8: one scale per token and head, or per latent row for MLA); an int =
# KIVI bits.
KV_CACHE_DTYPES: dict[str, torch.dtype | int | str | None] = {
    "auto": None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": "int8",
    "kivi4": 4,
    "kivi2": 2,
}
# kivi_window_dtype name -> the dtype of KIVI's full-precision window (None = the compute dtype)
KIVI_WINDOW_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def is_kivi(kv_cache_dtype: str) -> bool:
    """True for the KIVI-packed cache types."""
    return isinstance(KV_CACHE_DTYPES[kv_cache_dtype], int)


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


def kv_cache_layout(model_config, config, dtype: torch.dtype) -> KVLayout:
    """The layout a server's blocks are stored in, from its config's block_size, kv_cache_dtype,
    kivi_group_size, kivi_residual and kivi_window_dtype: full precision (in `dtype`, the compute
    dtype, or the 16-bit type named), or KIVI-packed with a window in `dtype` or the type
    named."""
    kind = KV_CACHE_DTYPES[config.kv_cache_dtype]
    c = model_config
    if not isinstance(kind, int):
        # the architecture's own layout (per-head K/V, or an MLA latent row), in the compute
        # dtype or the 16-bit one named, stored raw or in the codec named
        layout = c.kv_layout(config.block_size, kind if isinstance(kind, torch.dtype) else dtype)
        return dataclasses.replace(layout, store_codec=kind) if isinstance(kind, str) else layout
    if c.is_mla:
        # one latent row per token: keys-per-channel / values-per-token has no meaning there
        raise ValueError(
            f"kv_cache_dtype {config.kv_cache_dtype} (KIVI) does not apply to an MLA model's "
            "latent cache; use auto, fp16, bf16 or int8"
        )
    window = KIVI_WINDOW_DTYPES[config.kivi_window_dtype]
    return KiviKVLayout(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        config.block_size,
        kind,
        config.kivi_group_size,
        config.kivi_residual,
        dtype if window is None else window,
    )
