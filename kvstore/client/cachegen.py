"""CacheGen: a chunk of KV cache as a compact, entropy-coded bitstream, and back.

After CacheGen (Liu et al., SIGCOMM 2024, "CacheGen: KV Cache Compression and Streaming for Fast
Large Language Model Serving"), its three ideas:

1. Token locality. Tokens are cut into groups of GROUP_SIZE consecutive tokens. The first token of
   each group, the anchor, is quantized on its own (the level's anchor bins: 6 bits at the lower
   levels, 8 above; one max-abs scale per (layer, K/V, channel)); every other token is kept as
   its delta from the anchor's *dequantized* value, so the anchor's error never adds to the
   others'.
2. Layer-wise precision. Deltas are quantized with a scale per (layer, K/V, channel) (the max
   |delta| of that channel in the chunk) and a number of bins that depends on the level, on K or
   V, and on the layer: the layers are split into thirds of the model (the reference's 0-9 /
   10-19 / 20+ of 32 layers), each with its own bins for K and for V. Which third gets more bins
   is measured, not assumed (see LEVELS): on SmolLM2-135M the values of the first third and the
   keys of the middle third are the sensitive ones.
3. Arithmetic coding. The quantized symbols are range coded (`constriction`'s vectorised queue
   coder, one call per probability table) with probability tables built from the chunk itself and
   stored in the stream as 8-bit counts over the range of symbols used.

This module is the codec; its parts, one job each: cachegen_quant.py (the levels, the anchor
groups, the quantizers and their error bound), cachegen_format.py (the stream's layout, its header
and their checks), cachegen_coder.py (the probability tables and the range coder, and why a table
per head).

Nothing in the decoder trusts the stream: every length, count, range and scale is checked and a
problem raises CachegenCorrupt naming it. A flipped bit may still decode to different numbers
when the stream stays well-formed: integrity is the job of the block format's checksums.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvstore.client.cachegen_coder import (
    COUNT_MAX,
    Tables,
    counts_to_tables,
    decode_symbols,
    histograms,
    range_encode,
    read_tables,
)
from kvstore.client.cachegen_format import (
    HEADER_CRC,
    HEADER_FIELDS,
    HEADER_SIZE,
    MAGIC,
    MAX_NUMBERS,
    VERSION,
    CachegenCorrupt,
    CachegenInfo,
    Header,
    as_bytes,
    layout,
    pack_header,
    read_header,
)
from kvstore.client.cachegen_quant import (
    DEFAULT_LEVEL,
    FP16_MAX,
    GROUP_SIZE,
    LEVELS,
    LevelSpec,
    layer_bins,
    quantize_anchors,
    quantize_deltas,
)

# What callers import from here (the codec's whole public surface, wherever it is defined).
__all__ = [
    "COUNT_MAX",
    "DEFAULT_LEVEL",
    "FP16_MAX",
    "GROUP_SIZE",
    "HEADER_CRC",
    "HEADER_FIELDS",
    "HEADER_SIZE",
    "LEVELS",
    "MAGIC",
    "MAX_NUMBERS",
    "VERSION",
    "CachegenCorrupt",
    "CachegenInfo",
    "LevelSpec",
    "cachegen_decode",
    "cachegen_encode",
    "cachegen_info",
    "layer_bins",
]


# ---------------------------------------------------------------- encode


def cachegen_encode(kv: torch.Tensor, level: int = DEFAULT_LEVEL) -> bytes:
    """Encode kv [L, 2, T, H, D] (float32, float16 or bfloat16, any T >= 1) at `level`."""
    if level not in LEVELS:
        raise ValueError(f"unknown CacheGen level {level!r}; known: {sorted(LEVELS)}")
    if kv.dim() != 5 or kv.shape[1] != 2 or kv.numel() == 0:
        raise ValueError(
            f"CacheGen encodes a non-empty [L, 2, T, H, D] tensor, got {list(kv.shape)}"
        )
    if not kv.is_floating_point():
        raise ValueError(f"CacheGen encodes floating-point KV, got {kv.dtype}")
    layers, _, tokens, heads, head_dim = kv.shape
    if max(layers, heads, head_dim) > 0xFFFF or kv.numel() > MAX_NUMBERS:
        raise ValueError(f"KV shape {list(kv.shape)} exceeds the stream's field sizes")
    x = kv.detach().to("cpu", torch.float32).reshape(layers, 2, tokens, heads * head_dim)
    spec = LEVELS[level]
    anchor_c = (spec.anchor_bins - 1) // 2
    bins = layer_bins(level, layers)
    delta_c = torch.from_numpy((bins.astype(np.float32) - 1) / 2)  # [L, 2]

    anchor_step, qa, anchor_values = quantize_anchors(x, anchor_c)
    delta_step, qd = quantize_deltas(x, anchor_values, delta_c)

    # Symbols 0 .. 2C, each table's in one run: anchors K then V (all layers, [L, groups, H*D]),
    # then deltas per (layer, K/V, head) ([T', D] each).
    anchor_sym = (qa + anchor_c).to(torch.uint8).transpose(0, 1).reshape(2, -1).numpy()
    delta_sym = (qd + delta_c[:, :, None, None]).to(torch.uint8)
    delta_sym = delta_sym.reshape(layers, 2, -1, heads, head_dim).permute(0, 1, 3, 2, 4)
    delta_runs = delta_sym.reshape(layers * 2 * heads, -1).numpy()
    hist = np.concatenate([histograms(anchor_sym), histograms(delta_runs)])
    tables = counts_to_tables(hist)
    payload = range_encode([*anchor_sym, *delta_runs], tables)

    body = [
        bins.astype(np.uint8).tobytes(),
        anchor_step.numpy().astype("<f2").tobytes(),
        delta_step.numpy().astype("<f2").tobytes(),
        tables.lo.tobytes(),
        tables.width.tobytes(),
        tables.counts.tobytes(),
        payload.astype("<u4").tobytes(),
    ]
    total = HEADER_SIZE + sum(len(b) for b in body)
    if total > 0xFFFFFFFF:
        raise ValueError("CacheGen stream would exceed 4 GiB; encode smaller chunks")
    header = Header(
        level, GROUP_SIZE, anchor_c, layers, tokens, heads, head_dim, total, payload.size
    )
    return b"".join([pack_header(header), *body])


# ---------------------------------------------------------------- decode


def cachegen_info(data) -> CachegenInfo:
    """What the stream's header says, without decoding it (checks the header only)."""
    h = read_header(as_bytes(data))
    return CachegenInfo(
        (h.layers, 2, h.tokens, h.heads, h.head_dim), h.level, h.group_size, h.total_bytes
    )


class _Parsed(NamedTuple):
    """A stream's sections, checked."""

    header: Header  # its header
    delta_c: np.ndarray  # int64 [L, 2]: the delta quantizer's C of each (layer, K/V)
    anchor_step: np.ndarray  # float16 [L * 2 * H * D]
    delta_step: np.ndarray  # float16 [L * 2 * H * D]
    tables: Tables  # the probability tables
    words: np.ndarray  # uint32: the range-coded payload


def _parse(buf: memoryview) -> _Parsed:
    """Every section of the stream, its length and contents checked against the header."""
    h = read_header(buf)
    if h.total_bytes != len(buf):
        raise CachegenCorrupt(f"stream is {len(buf)} bytes, its header says {h.total_bytes}")
    lay = layout(h)
    if lay.table_counts > len(buf):
        raise CachegenCorrupt("stream too short for its scales and tables")
    bins = np.frombuffer(buf, np.uint8, h.layers * 2, lay.delta_bins).reshape(h.layers, 2)
    if not np.array_equal(bins, layer_bins(h.level, h.layers)):
        raise CachegenCorrupt(f"the layers' delta bins disagree with level {h.level}")
    delta_c = (bins.astype(np.int64) - 1) // 2
    n_scales = h.layers * 2 * h.heads * h.head_dim
    anchor_step = np.frombuffer(buf, "<f2", n_scales, lay.anchor_scales)
    delta_step = np.frombuffer(buf, "<f2", n_scales, lay.delta_scales)
    for name, s in (("anchor", anchor_step), ("delta", delta_step)):
        if not np.all(np.isfinite(s)) or np.any(np.signbit(s)):
            raise CachegenCorrupt(f"a {name} step is negative, infinite or NaN")
    tables = read_tables(buf, h, lay, delta_c)
    payload_at = lay.table_counts + int(tables.width.astype(np.int64).sum())
    if payload_at + 4 * h.payload_words != len(buf):
        raise CachegenCorrupt(
            f"payload of {h.payload_words} words does not end the {len(buf)}-byte stream"
        )
    words = np.frombuffer(buf, "<u4", h.payload_words, payload_at).astype(np.uint32)
    return _Parsed(h, delta_c, anchor_step, delta_step, tables, words)


def _dequantize(p: _Parsed, runs: list[np.ndarray]) -> torch.Tensor:
    """float32 [L, 2, T, H, D] from the decoded symbols: anchor + q * step."""
    h = p.header
    layers, heads, dim, g = h.layers, h.heads, h.head_dim, h.group_size
    groups = -(-h.tokens // g)
    # Anchors: coded K then V, each [L, groups, H*D]; one step per (layer, K/V, channel).
    qa = torch.from_numpy(np.concatenate(runs[:2])).float().sub_(h.anchor_c)
    a_step = torch.from_numpy(p.anchor_step.astype(np.float32)).reshape(layers, 2, 1, heads, dim)
    anchors = qa.reshape(2, layers, groups, heads, dim).transpose(0, 1) * a_step
    out = torch.empty(layers, 2, h.tokens, heads, dim, dtype=torch.float32)
    out[:, :, ::g] = anchors
    if h.tokens == groups:
        return out
    # Deltas as coded, [L, 2, H, T', D]: a table per (layer, K/V, head), steps per channel.
    dq = torch.from_numpy(np.concatenate(runs[2:])).float()
    dq = dq.reshape(layers, 2, heads, h.tokens - groups, dim)
    dq.sub_(torch.from_numpy(p.delta_c.astype(np.float32)).reshape(layers, 2, 1, 1, 1))
    dq.mul_(torch.from_numpy(p.delta_step.astype(np.float32)).reshape(layers, 2, heads, 1, dim))
    dq = dq.permute(0, 1, 3, 2, 4)  # [L, 2, T', H, D], a view
    # Whole groups through views (no index tensors); a last partial group on its own.
    full = h.tokens // g
    if full:
        body = out[:, :, : full * g].unflatten(2, (full, g))
        torch.add(
            dq[:, :, : full * (g - 1)].unflatten(2, (full, g - 1)),
            anchors[:, :, :full, None],
            out=body[:, :, :, 1:],
        )
    if h.tokens > full * g + 1:
        out[:, :, full * g + 1 :] = dq[:, :, full * (g - 1) :] + anchors[:, :, full, None]
    return out


def cachegen_decode(data, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a stream into kv [L, 2, T, H, D] of `dtype`; raises CachegenCorrupt on a bad one.
    `data`: bytes, bytearray, memoryview, or a flat uint8 numpy array or CPU tensor."""
    if not dtype.is_floating_point:
        raise ValueError(f"CacheGen decodes to a floating-point dtype, got {dtype}")
    parsed = _parse(as_bytes(data))
    runs = decode_symbols(parsed.header, parsed.words, parsed.tables)
    return _dequantize(parsed, runs).to(dtype)
