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

A value x is rebuilt as anchor + q * step with step = max|delta| / C (C = (bins - 1) / 2, q in
[-C, C]), so |x - x'| <= step / 2 for every non-anchor value and <= anchor step / 2 for anchors:
the error bound of a level is its bins, per layer and channel.

Stream layout (little-endian):
    header        HEADER_FIELDS (magic, version, level, group size, anchor C, L, T, H, D,
                  total bytes, payload words), then a CRC-32 of those: the header sizes
                  everything the decoder allocates, so a damaged one must not pass for another
    delta bins    uint8 [L, 2]: the delta quantizer's bins (2C + 1) for each (layer, K/V), as
                  the level says (checked: a mismatch is corruption)
    scales        float16 [L, 2, H*D] anchor steps, then float16 [L, 2, H*D] delta steps
    tables        uint8 lo[n], uint8 width[n], then uint8 counts (width of each, concatenated):
                  table i codes symbols lo .. lo+width-1 with probabilities proportional to its
                  counts. n = 2 anchor tables (K, V over all layers) + L*2*H delta tables
    payload       uint32 words of one range-coded stream: the anchor tables' symbols, then the
                  delta tables', each table's symbols in one run (tables of width 1 take no bits)

Why tables per (layer, K/V, head) and not per (layer, K/V, channel): measured on SmolLM2-135M's KV
(L=30, H=3, D=64; chunks of 256 tokens, so 240 delta symbols per channel), in bits per delta
symbol, tables included (2 + width bytes each):
    bins                    31            15            7
    per channel             5.21 (1.01)   3.69 (0.52)   2.32 (0.28)    (of which tables)
    per head (64 channels)  4.37 (0.02)   3.28 (0.01)   2.10 (0.005)
    per (layer, K/V)        4.36          3.27          2.10
A channel's own table saves 0.15-0.2 bits of data but its 8-bit counts cost 0.3-1 bit per symbol
at T=256: channels already share a shape once each is scaled by its own step, so a head's 64
channels share one table. Anchors (255 symbols, 16 per channel per chunk) likewise: 9.5 bits a
symbol with a table per (layer, K/V, head), 8.3 per (layer, K/V), 7.7 with one table for all keys
and one for all values, which is what the stream holds.

Nothing in the decoder trusts the stream: every length, count, range and scale is checked and a
problem raises CachegenCorrupt naming it. A flipped bit may still decode to different numbers
when the stream stays well-formed: integrity is the job of the block format's checksums.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

import constriction
import numpy as np
import torch


class CachegenCorrupt(ValueError):
    """A stream that is malformed, truncated or inconsistent."""


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

MAGIC = b"CGKV"
VERSION = 1
# magic, version, level, group size, anchor C, layers, tokens, kv heads, head dim, total bytes of
# the stream, payload words; then HEADER_CRC, the CRC-32 of those bytes
HEADER_FIELDS = struct.Struct("<4sBBBBHIHHII")
HEADER_CRC = struct.Struct("<I")
HEADER_SIZE = HEADER_FIELDS.size + HEADER_CRC.size
MAX_NUMBERS = 1 << 31  # L*2*T*H*D a stream may hold: no header makes the decoder allocate more
FP16_MAX = 65504.0
COUNT_MAX = 255  # table counts are scaled so that the largest is this


class CachegenInfo(NamedTuple):
    """What a stream's header says."""

    shape: tuple[int, int, int, int, int]  # [L, 2, T, H, D] of the encoded KV
    level: int  # the level it was encoded at (a key of LEVELS)
    group_size: int  # tokens per anchor group
    bytes: int  # the whole stream's length, header included


class _Header(NamedTuple):
    level: int
    group_size: int
    anchor_c: int  # anchors are quantized to q in [-anchor_c, anchor_c]
    layers: int
    tokens: int
    heads: int
    head_dim: int
    total_bytes: int
    payload_words: int


class _Layout(NamedTuple):
    """Where each section starts, from the header alone (the tables' counts are variable)."""

    delta_bins: int  # offset of uint8 [L, 2]
    anchor_scales: int  # offset of float16 [L, 2, C]
    delta_scales: int
    table_lo: int  # offset of uint8 lo[n]
    table_width: int
    table_counts: int  # offset of the concatenated counts
    num_tables: int


class _Tables(NamedTuple):
    lo: np.ndarray  # uint8 [n]: first symbol of each table
    width: np.ndarray  # uint8 [n]: symbols lo .. lo+width-1 (0: the table codes no symbols)
    counts: np.ndarray  # uint8 [sum(width)]: concatenated counts, each table's from lo


# ---------------------------------------------------------------- levels and layout


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


def _layout(h: _Header) -> _Layout:
    channels = h.heads * h.head_dim
    delta_bins = HEADER_SIZE
    anchor_scales = delta_bins + h.layers * 2
    delta_scales = anchor_scales + h.layers * 2 * channels * 2
    table_lo = delta_scales + h.layers * 2 * channels * 2
    num_tables = 2 + h.layers * 2 * h.heads
    return _Layout(
        delta_bins,
        anchor_scales,
        delta_scales,
        table_lo,
        table_lo + num_tables,
        table_lo + 2 * num_tables,
        num_tables,
    )


# ---------------------------------------------------------------- quantization


def _steps(max_abs: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
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


def _quantize_anchors(x: torch.Tensor, anchor_c: int):
    """Anchors (every GROUP_SIZE-th token of x [L, 2, T, C]) quantized with one step per
    (layer, K/V, channel): (float16 steps [L, 2, C], q [L, 2, groups, C], dequantized values)."""
    anchors = x[:, :, ::GROUP_SIZE]
    step = _steps(anchors.abs().amax(dim=2), float(anchor_c))
    step32 = step.float()[:, :, None]
    q = _quantize(anchors, step32, torch.tensor(float(anchor_c)))
    return step, q, q * step32


def _quantize_deltas(x: torch.Tensor, anchor_values: torch.Tensor, delta_c: torch.Tensor):
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


def _counts_to_tables(hist: np.ndarray) -> _Tables:
    """Tables from histograms [n, symbols]: the used range of each, counts scaled to max 255
    (ceil keeps every used symbol's count >= 1)."""
    used = hist > 0
    any_used = used.any(axis=1)
    lo = np.where(any_used, used.argmax(axis=1), 0)
    hi = np.where(any_used, hist.shape[1] - 1 - used[:, ::-1].argmax(axis=1), -1)
    width = hi - lo + 1
    peak = np.maximum(hist.max(axis=1, keepdims=True), 1)
    # min(): hist * (255 / peak) can land a hair above 255 at the peak, and 256 wraps to 0.
    scaled = np.minimum(np.ceil(hist * (COUNT_MAX / peak)), COUNT_MAX).astype(np.uint8)
    cols = np.arange(hist.shape[1])
    inside = (cols >= lo[:, None]) & (cols <= hi[:, None])
    return _Tables(lo.astype(np.uint8), width.astype(np.uint8), scaled[inside])


def _histograms(runs: np.ndarray) -> np.ndarray:
    """Counts [n, 256] of the uint8 symbols of each row of runs [n, symbols]."""
    n = runs.shape[0]
    offset = np.arange(n, dtype=np.int32)[:, None] * 256
    return np.bincount((runs + offset).reshape(-1), minlength=n * 256).reshape(n, 256)


def _model(counts: np.ndarray):
    return constriction.stream.model.Categorical(counts.astype(np.float64), perfect=False)


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

    anchor_step, qa, anchor_values = _quantize_anchors(x, anchor_c)
    delta_step, qd = _quantize_deltas(x, anchor_values, delta_c)

    # Symbols 0 .. 2C, each table's in one run: anchors K then V (all layers, [L, groups, H*D]),
    # then deltas per (layer, K/V, head) ([T', D] each).
    anchor_sym = (qa + anchor_c).to(torch.uint8).transpose(0, 1).reshape(2, -1).numpy()
    delta_sym = (qd + delta_c[:, :, None, None]).to(torch.uint8)
    delta_sym = delta_sym.reshape(layers, 2, -1, heads, head_dim).permute(0, 1, 3, 2, 4)
    delta_sym = delta_sym.reshape(layers * 2 * heads, -1).numpy()
    hist = np.concatenate([_histograms(anchor_sym), _histograms(delta_sym)])
    tables = _counts_to_tables(hist)
    payload = _range_encode([*anchor_sym, *delta_sym], tables)

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
    header = HEADER_FIELDS.pack(
        MAGIC,
        VERSION,
        level,
        GROUP_SIZE,
        anchor_c,
        layers,
        tokens,
        heads,
        head_dim,
        total,
        payload.size,
    )
    return b"".join([header, HEADER_CRC.pack(zlib.crc32(header)), *body])


def _range_encode(runs: list[np.ndarray], tables: _Tables) -> np.ndarray:
    """One range-coded stream of every run with its table (width-1 tables take no bits)."""
    encoder = constriction.stream.queue.RangeEncoder()
    start = np.concatenate([[0], np.cumsum(tables.width.astype(np.int64))])
    for i, run in enumerate(runs):
        width = int(tables.width[i])
        if width < 2:
            continue
        counts = tables.counts[start[i] : start[i] + width]
        encoder.encode((run - int(tables.lo[i])).astype(np.int32), _model(counts))
    return encoder.get_compressed()


# ---------------------------------------------------------------- decode


def _as_bytes(data) -> memoryview:
    """bytes, bytearray, memoryview, a uint8 numpy array or a uint8 CPU tensor, as bytes."""
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise TypeError(f"a CacheGen stream tensor must be flat uint8, got {data.dtype}")
        data = data.cpu().numpy()
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise TypeError(f"a CacheGen stream array must be uint8, got {data.dtype}")
        data = np.ascontiguousarray(data).reshape(-1)
    try:
        return memoryview(data).cast("B")
    except TypeError:
        raise TypeError(
            f"a CacheGen stream must be bytes-like, got {type(data).__name__}"
        ) from None


def _read_header(buf: memoryview) -> _Header:
    if len(buf) < HEADER_SIZE:
        raise CachegenCorrupt(f"stream of {len(buf)} bytes is shorter than its header")
    magic, version, *fields = HEADER_FIELDS.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CachegenCorrupt(f"bad magic {bytes(magic)!r}, not a CacheGen stream")
    if version != VERSION:
        raise CachegenCorrupt(f"unsupported CacheGen stream version {version}")
    (crc,) = HEADER_CRC.unpack_from(buf, HEADER_FIELDS.size)
    if crc != zlib.crc32(buf[: HEADER_FIELDS.size]):
        raise CachegenCorrupt("header checksum mismatch")
    h = _Header(*fields)
    if h.level not in LEVELS:
        raise CachegenCorrupt(f"unknown level {h.level}")
    if h.group_size != GROUP_SIZE:
        raise CachegenCorrupt(f"group size {h.group_size}, this decoder knows {GROUP_SIZE}")
    if h.anchor_c != (LEVELS[h.level].anchor_bins - 1) // 2:
        raise CachegenCorrupt(f"anchor range {h.anchor_c} disagrees with level {h.level}")
    shape = [h.layers, 2, h.tokens, h.heads, h.head_dim]
    if min(shape) < 1:
        raise CachegenCorrupt(f"empty shape {shape}")
    if h.layers * 2 * h.tokens * h.heads * h.head_dim > MAX_NUMBERS:
        raise CachegenCorrupt(f"shape {shape} exceeds {MAX_NUMBERS} numbers")
    return h


def cachegen_info(data) -> CachegenInfo:
    """What the stream's header says, without decoding it (checks the header only)."""
    h = _read_header(_as_bytes(data))
    return CachegenInfo(
        (h.layers, 2, h.tokens, h.heads, h.head_dim), h.level, h.group_size, h.total_bytes
    )


def _read_tables(buf: memoryview, h: _Header, lay: _Layout, delta_c: np.ndarray) -> _Tables:
    """The tables, checked against the symbol range and the number of symbols each codes."""
    n = lay.num_tables
    lo = np.frombuffer(buf, np.uint8, n, lay.table_lo)
    width = np.frombuffer(buf, np.uint8, n, lay.table_width)
    total = int(width.astype(np.int64).sum())
    if lay.table_counts + total > len(buf):
        raise CachegenCorrupt("tables run past the end of the stream")
    counts = np.frombuffer(buf, np.uint8, total, lay.table_counts)
    # The largest symbol each table may hold: 2C of its quantizer.
    top = np.concatenate([[2 * h.anchor_c] * 2, np.repeat(2 * delta_c.reshape(-1), h.heads)])
    has_symbols = np.ones(n, dtype=bool)
    if h.tokens <= (h.tokens + h.group_size - 1) // h.group_size:  # every token is an anchor
        has_symbols[2:] = False
    if np.any(width[has_symbols] == 0):
        raise CachegenCorrupt("a table that codes symbols is empty")
    if np.any(width[~has_symbols] != 0):
        raise CachegenCorrupt("a table that codes no symbols is not empty")
    if np.any(lo.astype(np.int64) + width - 1 > top):
        raise CachegenCorrupt("a table's symbols exceed its quantizer's range")
    start = np.concatenate([[0], np.cumsum(width.astype(np.int64))[:-1]])
    last = start + width.astype(np.int64) - 1
    nonempty = width > 0
    # The encoder trims each table to its used range: both ends are used, so count > 0.
    if np.any(counts[start[nonempty]] == 0) or np.any(counts[last[nonempty]] == 0):
        raise CachegenCorrupt("a table's first or last count is zero")
    return _Tables(lo, width, counts)


def _range_decode(words: np.ndarray, tables: _Tables, run_lengths: list[int]) -> list[np.ndarray]:
    decoder = constriction.stream.queue.RangeDecoder(words)
    start = np.concatenate([[0], np.cumsum(tables.width.astype(np.int64))])
    runs = []
    for i, n in enumerate(run_lengths):
        width, lo = int(tables.width[i]), int(tables.lo[i])
        if width < 2:
            runs.append(np.full(n, lo, dtype=np.int32))
            continue
        counts = tables.counts[start[i] : start[i] + width]
        runs.append(decoder.decode(_model(counts), n) + lo)
    if not decoder.maybe_exhausted():
        raise CachegenCorrupt("payload holds more data than its symbols need")
    return runs


class _Parsed(NamedTuple):
    """A stream's sections, checked."""

    header: _Header
    delta_c: np.ndarray  # int64 [L, 2]: the delta quantizer's C of each (layer, K/V)
    anchor_step: np.ndarray  # float16 [L * 2 * H * D]
    delta_step: np.ndarray  # float16 [L * 2 * H * D]
    tables: _Tables
    words: np.ndarray  # uint32: the range-coded payload


def _parse(buf: memoryview) -> _Parsed:
    """Every section of the stream, its length and contents checked against the header."""
    h = _read_header(buf)
    if h.total_bytes != len(buf):
        raise CachegenCorrupt(f"stream is {len(buf)} bytes, its header says {h.total_bytes}")
    lay = _layout(h)
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
    tables = _read_tables(buf, h, lay, delta_c)
    payload_at = lay.table_counts + int(tables.width.astype(np.int64).sum())
    if payload_at + 4 * h.payload_words != len(buf):
        raise CachegenCorrupt(
            f"payload of {h.payload_words} words does not end the {len(buf)}-byte stream"
        )
    words = np.frombuffer(buf, "<u4", h.payload_words, payload_at).astype(np.uint32)
    return _Parsed(h, delta_c, anchor_step, delta_step, tables, words)


def _decode_symbols(p: _Parsed) -> list[np.ndarray]:
    """Each table's run of symbols (int32), in the stream's order."""
    h = p.header
    groups = -(-h.tokens // h.group_size)
    per_anchor_table = h.layers * groups * h.heads * h.head_dim
    per_delta_table = (h.tokens - groups) * h.head_dim
    lengths = [per_anchor_table] * 2 + [per_delta_table] * (h.layers * 2 * h.heads)
    try:
        return _range_decode(p.words, p.tables, lengths)
    except CachegenCorrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the coder makes of bad bytes is corruption
        raise CachegenCorrupt(f"payload does not decode: {exc}") from None
    except BaseException as exc:
        # A Rust panic surfaces as pyo3's PanicException, a BaseException: corruption too.
        if type(exc).__name__ != "PanicException":
            raise
        raise CachegenCorrupt(f"payload does not decode: {exc}") from None


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
    parsed = _parse(_as_bytes(data))
    out = _dequantize(parsed, _decode_symbols(parsed))
    return out.to(dtype)
