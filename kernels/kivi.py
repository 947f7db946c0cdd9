"""KIVI 2/4/8-bit KV quantization (Liu et al., ICML 2024): packed format and the torch twin.

Keys are quantized per channel (groups run along the token axis), values per token (groups run
along the channel axis); both asymmetric: x ~= code * scale + zero, code in [0, 2**bits - 1].

Groups: an axis of length n with requested group size g is cut into ceil(n / g) groups of
ceil(n / count) elements (the last may be shorter), so a 16-token block with g=32 groups its keys
over all 16 tokens, and the group size can be recovered from the field shapes alone.

Scales and zero points are float16, rounded so that every group value lies in
[zero, zero + scale * (2**bits - 1)]: the round-trip error is at most scale / 2 (plus fp32
rounding). Inputs must lie within float16's range.

Serialised form (`kivi_to_bytes`): the fields' bytes in KiviPacked's field order, each C-contiguous
and little-endian, with the shapes given by `kivi_field_shapes`; float16 fields come first so each
field starts aligned to its element size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KiviPacked(NamedTuple):
    """One KIVI-quantized KV stretch; every field may carry extra leading dims (e.g. num_blocks)."""

    k_scale: torch.Tensor  # float16 [kg, kv_heads, head_dim]: key scale per (token group, channel)
    k_zero: torch.Tensor  # float16 [kg, kv_heads, head_dim]: key zero point (the group's minimum)
    v_scale: torch.Tensor  # float16 [tokens, kv_heads, vg]: value scale per (token, channel group)
    v_zero: torch.Tensor  # float16 [tokens, kv_heads, vg]: value zero point
    k_codes: (
        torch.Tensor
    )  # uint8 [tokens, kv_heads, head_dim*bits/8]: 8/bits channels a byte, low bits first
    v_codes: torch.Tensor  # uint8 [tokens, kv_heads, head_dim*bits/8]: same packing, values


KIVI_BITS = (2, 4, 8)
KIVI_FIELD_DTYPES = KiviPacked(
    torch.float16, torch.float16, torch.float16, torch.float16, torch.uint8, torch.uint8
)


def kivi_groups(n: int, group_size: int) -> tuple[int, int]:
    """(count, size) of the quantization groups along an axis of n elements."""
    count = -(-n // group_size)
    return count, -(-n // count)


def _check(tokens: int, kv_heads: int, head_dim: int, bits: int, group_size: int) -> None:
    if bits not in KIVI_BITS:
        raise ValueError(f"kivi bits must be one of {KIVI_BITS}, got {bits}")
    if group_size < 1 or tokens < 1 or kv_heads < 1:
        raise ValueError(
            f"kivi needs tokens, kv_heads, group_size >= 1, got {tokens}, {kv_heads}, {group_size}"
        )
    if head_dim < 1 or head_dim % (8 // bits):
        raise ValueError(f"kivi{bits} needs head_dim divisible by {8 // bits}, got {head_dim}")


def kivi_field_shapes(
    tokens: int, kv_heads: int, head_dim: int, bits: int, group_size: int = 32
) -> KiviPacked:
    """The shape of each KiviPacked field (a KiviPacked of tuples) for one stretch of tokens."""
    _check(tokens, kv_heads, head_dim, bits, group_size)
    kg, _ = kivi_groups(tokens, group_size)
    vg, _ = kivi_groups(head_dim, group_size)
    packed = head_dim * bits // 8
    return KiviPacked(
        (kg, kv_heads, head_dim),
        (kg, kv_heads, head_dim),
        (tokens, kv_heads, vg),
        (tokens, kv_heads, vg),
        (tokens, kv_heads, packed),
        (tokens, kv_heads, packed),
    )


def kivi_packed_nbytes(
    tokens: int, kv_heads: int, head_dim: int, bits: int, group_size: int = 32
) -> int:
    """Bytes of one serialised KiviPacked."""
    shapes = kivi_field_shapes(tokens, kv_heads, head_dim, bits, group_size)
    return sum(_numel(s) * d.itemsize for s, d in zip(shapes, KIVI_FIELD_DTYPES))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def kivi_to_bytes(p: KiviPacked) -> bytes:
    """Concatenated bytes of p's fields (see the module docstring)."""
    return b"".join(f.detach().contiguous().cpu().numpy().tobytes() for f in p)


def kivi_from_bytes(
    buf, tokens: int, kv_heads: int, head_dim: int, bits: int, group_size: int = 32
) -> KiviPacked:
    """Rebuild a KiviPacked (CPU tensors) from `kivi_to_bytes` output; ValueError on a wrong
    length."""
    shapes = kivi_field_shapes(tokens, kv_heads, head_dim, bits, group_size)
    want = kivi_packed_nbytes(tokens, kv_heads, head_dim, bits, group_size)
    if len(buf) != want:
        raise ValueError(f"kivi buffer holds {len(buf)} bytes, shape needs {want}")
    raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    fields, off = [], 0
    for shape, dtype in zip(shapes, KIVI_FIELD_DTYPES):
        n = _numel(shape) * dtype.itemsize
        fields.append(raw[off : off + n].view(dtype).view(shape))
        off += n
    return KiviPacked(*fields)


def kivi_layout(p: KiviPacked) -> tuple[int, int, int, int, int, int]:
    """(tokens, kv_heads, head_dim, bits, key group size, value group size) read from field
    shapes."""
    tokens, kv_heads, packed = p.k_codes.shape[-3:]
    kg, head_dim, vg = p.k_scale.shape[-3], p.k_scale.shape[-1], p.v_scale.shape[-1]
    bits = packed * 8 // head_dim
    if bits not in KIVI_BITS or packed * 8 != bits * head_dim:
        raise ValueError(f"kivi codes of {packed} bytes do not fit head_dim {head_dim}")
    gk, gv = -(-tokens // kg), -(-head_dim // vg)
    if -(-tokens // gk) != kg or -(-head_dim // gv) != vg:
        raise ValueError(
            f"kivi group counts {kg}, {vg} do not fit {tokens} tokens, head_dim {head_dim}"
        )
    return tokens, kv_heads, head_dim, bits, gk, gv


# Directed rounding to float16: zero is rounded down and scale up, by a margin larger than half a
# float16 ulp, so the float16 range still covers the group. The Triton kernels do the same sums.
_DOWN, _TINY = 2.0**-10, 2.0**-24


def _zero_scale(
    mn: torch.Tensor, mx: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    zero = (mn - mn.abs() * _DOWN - _TINY).to(torch.float16)
    scale = ((mx - zero.float()) / levels * (1.0 + _DOWN) + _TINY).to(torch.float16)
    return zero, scale


def _pad_edge(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Pad `dim` up to `size` by repeating the last element (min/max unchanged)."""
    pad = size - x.shape[dim]
    if pad == 0:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat(
        [x, last.expand(*[pad if d == dim % x.dim() else -1 for d in range(x.dim())])], dim=dim
    )


def _encode(x: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    return torch.floor((x - zero.float()) / scale.float() + 0.5).clamp_(0, levels).to(torch.uint8)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // per, per).to(torch.int32)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(dim=-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., n] -> float32 codes [..., n * 8/bits]."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    c = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per).float()


def _affine(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int, group: int
) -> torch.Tensor:
    """codes * scale + zero, scale/zero holding one entry per `group` elements along `dim` (in
    place)."""
    n, count = codes.shape[dim], scale.shape[dim]
    if count * group == n:  # whole groups: broadcast instead of materialising per-element scales
        shape = list(codes.shape)
        shape[dim : dim + 1] = [count, group]
        view = codes.view(shape)
        view.mul_(scale.float().unsqueeze(dim + 1)).add_(zero.float().unsqueeze(dim + 1))
        return codes
    s = scale.float().repeat_interleave(group, dim=dim).narrow(dim, 0, n)
    z = zero.float().repeat_interleave(group, dim=dim).narrow(dim, 0, n)
    return codes.mul_(s).add_(z)


def kivi_dequantize_keys(p: KiviPacked) -> torch.Tensor:
    """float32 keys [..., tokens, kv_heads, head_dim] of p."""
    _, _, _, bits, gk, _ = kivi_layout(p)
    return _affine(_unpack(p.k_codes, bits), p.k_scale, p.k_zero, p.k_codes.dim() - 3, gk)


def kivi_dequantize_values(p: KiviPacked) -> torch.Tensor:
    """float32 values [..., tokens, kv_heads, head_dim] of p."""
    _, _, _, bits, _, gv = kivi_layout(p)
    return _affine(_unpack(p.v_codes, bits), p.v_scale, p.v_zero, p.v_codes.dim() - 1, gv)


def kivi_quantize_torch(kv: torch.Tensor, bits: int, group_size: int = 32) -> KiviPacked:
    """Quantize kv [..., 2, tokens, kv_heads, head_dim] (any leading dims) to KIVI."""
    tokens, kv_heads, head_dim = kv.shape[-3:]
    _check(tokens, kv_heads, head_dim, bits, group_size)
    levels = (1 << bits) - 1
    x = kv.float()
    k, v = x[..., 0, :, :, :], x[..., 1, :, :, :]
    lead = k.shape[:-3]
    # Keys: per channel, groups along tokens.
    kg, gk = kivi_groups(tokens, group_size)
    kp = _pad_edge(k, -3, kg * gk).reshape(*lead, kg, gk, kv_heads, head_dim)
    k_zero, k_scale = _zero_scale(kp.amin(dim=-3), kp.amax(dim=-3), levels)
    k_codes = _encode(
        k,
        k_zero.repeat_interleave(gk, dim=-3)[..., :tokens, :, :],
        k_scale.repeat_interleave(gk, dim=-3)[..., :tokens, :, :],
        levels,
    )
    # Values: per token, groups along channels.
    vg, gv = kivi_groups(head_dim, group_size)
    vp = _pad_edge(v, -1, vg * gv).reshape(*lead, tokens, kv_heads, vg, gv)
    v_zero, v_scale = _zero_scale(vp.amin(dim=-1), vp.amax(dim=-1), levels)
    v_codes = _encode(
        v,
        v_zero.repeat_interleave(gv, dim=-1)[..., :head_dim],
        v_scale.repeat_interleave(gv, dim=-1)[..., :head_dim],
        levels,
    )
    return KiviPacked(k_scale, k_zero, v_scale, v_zero, _pack(k_codes, bits), _pack(v_codes, bits))


def kivi_dequantize_blocks_torch(p: KiviPacked, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize p (any leading dims) to [..., 2, tokens, kv_heads, head_dim]."""
    return torch.stack([kivi_dequantize_keys(p), kivi_dequantize_values(p)], dim=-4).to(dtype)
