"""CacheGen's entropy coder (kvstore/client/cachegen.py has the codec): probability tables built
from a chunk's own symbols, stored in the stream as 8-bit counts over the range of symbols used,
and one range-coded stream (`constriction`'s vectorised queue coder, one call per table).

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
and one for all values, which is what the stream holds."""

from __future__ import annotations

from typing import NamedTuple

import constriction
import numpy as np

from kvstore.client.cachegen_format import CachegenCorrupt, Header, Layout

COUNT_MAX = 255  # table counts are scaled so that the largest is this


class Tables(NamedTuple):
    """The probability tables, as the stream holds them."""

    lo: np.ndarray  # uint8 [n]: first symbol of each table
    width: np.ndarray  # uint8 [n]: symbols lo .. lo+width-1 (0: the table codes no symbols)
    counts: np.ndarray  # uint8 [sum(width)]: concatenated counts, each table's from lo


# ---------------------------------------------------------------- encode


def histograms(runs: np.ndarray) -> np.ndarray:
    """Counts [n, 256] of the uint8 symbols of each row of runs [n, symbols]."""
    n = runs.shape[0]
    offset = np.arange(n, dtype=np.int32)[:, None] * 256
    return np.bincount((runs + offset).reshape(-1), minlength=n * 256).reshape(n, 256)


def counts_to_tables(hist: np.ndarray) -> Tables:
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
    return Tables(lo.astype(np.uint8), width.astype(np.uint8), scaled[inside])


def _model(counts: np.ndarray) -> constriction.stream.model.Categorical:
    return constriction.stream.model.Categorical(counts.astype(np.float64), perfect=False)


def range_encode(runs: list[np.ndarray], tables: Tables) -> np.ndarray:
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


def read_tables(buf: memoryview, h: Header, lay: Layout, delta_c: np.ndarray) -> Tables:
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
    return Tables(lo, width, counts)


def _range_decode(words: np.ndarray, tables: Tables, run_lengths: list[int]) -> list[np.ndarray]:
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


def decode_symbols(h: Header, words: np.ndarray, tables: Tables) -> list[np.ndarray]:
    """Each table's run of symbols (int32), in the stream's order, from the payload `words`."""
    groups = -(-h.tokens // h.group_size)
    per_anchor_table = h.layers * groups * h.heads * h.head_dim
    per_delta_table = (h.tokens - groups) * h.head_dim
    lengths = [per_anchor_table] * 2 + [per_delta_table] * (h.layers * 2 * h.heads)
    try:
        return _range_decode(words, tables, lengths)
    except CachegenCorrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the coder makes of bad bytes is corruption
        raise CachegenCorrupt(f"payload does not decode: {exc}") from None
    except BaseException as exc:
        # A Rust panic surfaces as pyo3's PanicException, a BaseException: corruption too.
        if type(exc).__name__ != "PanicException":
            raise
        raise CachegenCorrupt(f"payload does not decode: {exc}") from None
