"""The ids KV layouts go into block keys by, from names and numbers alone (no torch).

A layout's id (`KVLayout.fingerprint_id`) names everything that changes the bytes of a block. It
is spelled here, once, so that a process that only computes block keys (the conductor) gets the
same id as the workers' layout objects without importing torch."""

from __future__ import annotations


def _codec_tag(codec: str) -> str:
    """An id's codec part: nothing for raw blocks (the ids they always had)."""
    if codec not in ("raw", "int8"):
        raise ValueError(f"a full-precision layout stores blocks raw or int8, not {codec!r}")
    return "" if codec == "raw" else f"/{codec}"


def full_layout_id(
    dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, codec: str
) -> str:
    """Per-head K and V in `dtype` (a torch dtype's name: float32, bfloat16, float16)."""
    return (
        f"full/{dtype}/L{num_layers}/H{num_kv_heads}/D{head_dim}/B{block_size}{_codec_tag(codec)}"
    )


def kivi_layout_id(
    bits: int,
    group_size: int,
    residual: int,
    window_dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> str:
    """KIVI-packed K and V, with a full-precision window of `residual` tokens in
    `window_dtype`."""
    return (
        f"kivi{bits}/g{group_size}/r{residual}/{window_dtype}"
        f"/L{num_layers}/H{num_kv_heads}/D{head_dim}/B{block_size}"
    )


def mla_layout_id(
    dtype: str, num_layers: int, kv_lora_rank: int, rope_dim: int, block_size: int, codec: str
) -> str:
    """MLA latent rows (kv_lora_rank + rope_dim wide) in `dtype`."""
    return (
        f"mla/{dtype}/L{num_layers}/R{kv_lora_rank}/P{rope_dim}/B{block_size}{_codec_tag(codec)}"
    )


def dtype_name(dtype) -> str:
    """A torch dtype's name without the module (torch.bfloat16 -> bfloat16); a name as it is."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
