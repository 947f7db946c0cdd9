"""The time models the simulator charges: the workers' fitted models (servekit), a prefill split
into the chunks its instance computes."""

from __future__ import annotations

from servekit import decode_features, predict, prefill_features


def prefill_ms(coef, start: int, end: int, chunk: int) -> float:
    """Computing positions [start, end) in forwards of up to `chunk` tokens (0 = one forward)."""
    if end <= start:
        return 0.0
    if chunk <= 0:
        return predict(coef, prefill_features(end - start, end))
    total, pos = 0.0, start
    while pos < end:
        e = min(end, pos + chunk)
        total += predict(coef, prefill_features(e - pos, e))
        pos = e
    return total


def step_ms(coef, batch: int, context_tokens: int) -> float:
    return predict(coef, decode_features(batch, context_tokens))


def transfer_ms(blocks: int, block_bytes: int, gbps: float) -> float:
    """Moving `blocks` blocks at `gbps` GB/s (= MB/ms)."""
    return blocks * block_bytes / (gbps * 1e6) if blocks > 0 else 0.0
