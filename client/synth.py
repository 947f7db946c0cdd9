"""Trace requests to concrete prompts: each hash id becomes a deterministic pseudo-random token
run."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from client.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

FIRST_TOKEN_ID = 10  # keep clear of the special tokens at the bottom of most vocabularies


class Scaling(NamedTuple):
    """How a trace is fitted to the machine at hand."""

    length_scale: float = 1.0  # prompt and block lengths are multiplied by this
    time_scale: float = 1.0  # inter-arrival times are multiplied by this
    max_output: int | None = None  # cap on answer lengths (None = as the trace says)
    max_input: int | None = None  # cap on prompt lengths, e.g. the model's context window
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per hash id in the trace


class Prompt(NamedTuple):
    """One request ready to send."""

    index: int  # the trace request's index
    arrival_s: float  # when to send it, seconds from the start of the replay
    token_ids: list[int]
    max_tokens: int


@lru_cache(maxsize=65536)
def _run(hash_id: int, length: int, vocab_size: int, seed: int) -> tuple[int, ...]:
    rng = np.random.Generator(np.random.PCG64([seed, hash_id & 0xFFFFFFFFFFFFFFFF]))
    return tuple(int(t) for t in rng.integers(FIRST_TOKEN_ID, vocab_size, size=length))


def block_tokens(s: Scaling) -> int:
    """Tokens each hash id becomes after scaling (at least 1)."""
    return max(1, round(s.trace_block_tokens * s.length_scale))


def prompt_tokens(req: TraceRequest, s: Scaling, vocab_size: int, seed: int = 0) -> list[int]:
    """The request's prompt: its hash ids' runs, cut to its scaled length; equal ids, equal
    prefixes."""
    if vocab_size <= FIRST_TOKEN_ID + 1:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID + 1}, got {vocab_size}")
    n = max(1, round(req.input_length * s.length_scale))
    if s.max_input is not None:
        n = min(n, s.max_input)
    per = block_tokens(s)
    out: list[int] = []
    for h in req.hash_ids:
        if len(out) >= n:
            break
        out.extend(_run(h, per, vocab_size, seed))
    if len(out) < n:  # a trace with too few ids: the rest is unique to this request
        out.extend(_run(-(req.index + 1), n - len(out), vocab_size, seed + 1))
    return out[:n]


def make_prompts(
    reqs: list[TraceRequest], s: Scaling, vocab_size: int, seed: int = 0
) -> list[Prompt]:
    """Scaled prompts and arrival times for a trace slice; the first request arrives at 0."""
    if not reqs:
        return []
    t0 = reqs[0].timestamp_ms
    out = []
    for r in reqs:
        max_tokens = max(
            1, r.output_length if s.max_output is None else min(r.output_length, s.max_output)
        )
        out.append(
            Prompt(
                r.index,
                (r.timestamp_ms - t0) / 1000.0 * s.time_scale,
                prompt_tokens(r, s, vocab_size, seed),
                max_tokens,
            )
        )
    return out
