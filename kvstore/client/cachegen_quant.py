"""CacheGen's quantization (kvstore/client/cachegen.py has the codec): the quality levels, the
anchor groups, and the quantizers of anchors and of the deltas from them.

A value x is rebuilt as anchor + q * step with step = max|delta| / C (C = (bins - 1) / 2, q in
[-C, C]), so |x - x'| <= step / 2 for every non-anchor value and <= anchor step / 2 for anchors:
the error bound of a level is its bins, per layer and channel."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class LevelSpec(NamedTuple):
    """One quality level: how many bins each kind of value is quantized to (odd: 2C+1, q in
    [-C, C]; the reference's "32 bins" are 31 of ours)."""

    key_bins: tuple[int, int, int]  # key deltas, for the first, second and last third of layers
    value_bins: tuple[int, int, int]  # value deltas, same thirds
    anchor_bins: int  # anchors (first token of each group), all layers


# 1 = smallest and lossiest .. 4 = largest and closest (every level has at least the bins of the
# one below it everywhere, so sizes grow and errors shrink with the level).
#
# The bins follow what SmolLM2-135M's perplexity is sensitive to (bench/cachegen_codec.py's
# method, 2048-token windows of Pride and Prejudice, chunks of 256 tokens, fp32 KV as reference):
# one third of the layers' keys or values at 5 bins, everything else at 31, costs x1.033 (keys,
# first third), x1.129 (keys, middle), x1.062 (keys, last), x1.043 (values, first), x1.009
# (values, middle), x1.009 (values, last). So the middle keys and the first values get the most
# bins: the reference's "early layers get more" holds for values, not for this model's keys.
# bench/cachegen_codec.py, 2 x 2048 tokens, 256-token chunks (perplexity against fp32 KV, size
# against int8 KV): level 1 x1.21 at 4.10x smaller, level 2 x1.035 at 3.17x, level 3 x1.006 at
# 2.24x, level 4 x0.9996 at 1.10x. With 1024-token chunks (scales and tables amortised over more
# tokens) level 2 is x1.047 at 3.57x. At 256-token chunks no allocation tried reached 3.5x within
# x1.05 (K 9/19/11, V 9/3/3, anchors 31 bins: x1.064 at 3.47x): deltas from an anchor are not
# small on this model (a delta's RMS is 1.2-1.4x that of the value around its channel's mean), so
# they cost more bits than the paper's models need.
LEVELS: dict[int, LevelSpec] = {
    1: LevelSpec(key_bins=(7, 11, 7), value_bins=(5, 3, 3), anchor_bins=63),
    2: LevelSpec(key_bins=(9, 15, 9), value_bins=(9, 5, 5), anchor_bins=63),
    3: LevelSpec(key_bins=(15, 31, 15), value_bins=(31, 9, 9), anchor_bins=255),
    4: LevelSpec(key_bins=(255, 255, 255), value_bins=(255, 255, 255), anchor_bins=255),
}
DEFAULT_LEVEL = 2

# G = 16: one group per 16-token block, the store's and the pool's block size, so a chunk of whole
# blocks holds whole groups and a group never straddles two blocks. The paper's 10 would split
# blocks. 8 would double the anchors, 14% of the stream at the default level (SmolLM2-135M, 256
# tokens), to buy deltas that are only a little smaller: a delta's RMS grows from 1.24 one token
# from its anchor to 1.53 at seven and 1.72 at fifteen (keys), so halving G saves ~0.1 bit of
# ~2.5 per delta and costs ~0.35 bit per number in anchors.
GROUP_SIZE = 16

FP16_MAX = 65504.0


def layer_bins(level: int, num_layers: int) -> np.ndarray:
    """uint8 [L, 2]: delta bins of each (layer, K/V) at `level`."""
    spec = LEVELS[level]
    third = np.minimum(np.arange(num_layers) * 3 // num_layers, 2)
    return np.stack(
        [np.asarray(spec.key_bins)[third], np.asarray(spec.value_bins)[third]], axis=1
    ).astype(np.uint8)


def _non_anchor_tokens(tokens: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the tokens that are not anchors, and the group (anchor) each belongs to."""
    pos = np.arange(tokens)
    pos = pos[pos % group_size != 0]
    return pos, pos // group_size


def _steps(max_abs: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
    """float16 steps max_abs / c, rounded up so that |x| / step <= c still holds after the cast
    (a float16 rounds by at most 2^-11 relative; the 2^-10 nudge covers it)."""
    if not bool(torch.isfinite(max_abs).all()):
        raise ValueError("KV holds NaN or infinite values")  # a NaN or inf makes its max one
    step = max_abs / c * (1.0 + 2.0**-10)
    if bool((step > FP16_MAX).any()):
        raise ValueError("KV values too large for float16 quantization steps (|x| > ~8e6)")
    return step.to(torch.float16)


def _quantize(x: torch.Tensor, step: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """round(x / step) in [-c, c] (0 where the step is 0: the whole channel is 0)."""
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round(x / safe)
    return torch.minimum(torch.maximum(q, -c), c)


def quantize_anchors(
    x: torch.Tensor, anchor_c: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Anchors (every GROUP_SIZE-th token of x [L, 2, T, C]) quantized with one step per
    (layer, K/V, channel): (float16 steps [L, 2, C], q [L, 2, groups, C], dequantized values)."""
    anchors = x[:, :, ::GROUP_SIZE]
    step = _steps(anchors.abs().amax(dim=2), float(anchor_c))
    step32 = step.float()[:, :, None]
    q = _quantize(anchors, step32, torch.tensor(float(anchor_c)))
    return step, q, q * step32


def quantize_deltas(
    x: torch.Tensor, anchor_values: torch.Tensor, delta_c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The other tokens' deltas from their group's dequantized anchor, quantized with one step
    per (layer, K/V, channel) and delta_c [L, 2]: (float16 steps [L, 2, C], q [L, 2, T', C])."""
    layers, _, tokens, channels = x.shape
    pos, group = _non_anchor_tokens(tokens, GROUP_SIZE)
    deltas = x[:, :, torch.from_numpy(pos)] - anchor_values[:, :, torch.from_numpy(group)]
    if pos.size:
        delta_max = deltas.abs().amax(dim=2)
    else:
        delta_max = torch.zeros(layers, 2, channels)
    step = _steps(delta_max, delta_c[:, :, None])
    q = _quantize(deltas, step.float()[:, :, None], delta_c[:, :, None, None])
    return step, q
