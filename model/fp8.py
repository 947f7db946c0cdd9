"""FP8 checkpoints with block scales (DeepSeek-V3's published format): each quantized weight is
float8_e4m3fn beside `<name>_scale_inv`, one fp32 factor per block of `weight_block_size`
([128, 128]) rows x columns, so that weight = fp8 value x its block's factor. config.json says so
in `quantization_config` (quant_method "fp8"; read by `model.checkpoint.fp8_block_size`). Loaded
by dequantizing to the compute dtype."""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def dequantize_fp8(sd: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """`sd` with every FP8 weight multiplied out by its block scales, as fp32, and the scale
    tensors gone. An FP8 weight without its scales, or scales of the wrong shape, is a
    ValueError naming the tensor."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith(SCALE_SUFFIX):
            if name[: -len(SCALE_SUFFIX)] not in sd:
                raise ValueError(f"{name}: scales of a weight the checkpoint does not hold")
            continue
        if t.dtype not in FP8_DTYPES:
            out[name] = t
            continue
        scale = sd.get(name + SCALE_SUFFIX)
        if scale is None:
            raise ValueError(f"{name}: an FP8 weight without {name + SCALE_SUFFIX}")
        out[name] = _multiply_out(name, t, scale.float(), block)
    return out


def _multiply_out(
    name: str, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(f"{name}: an FP8 weight of {w.dim()} dimensions (2 expected)")
    rows, cols = w.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"{name}{SCALE_SUFFIX}: shape {tuple(scale.shape)}, expected {want} for a "
            f"{rows}x{cols} weight in {block[0]}x{block[1]} blocks"
        )
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return w.float() * full
