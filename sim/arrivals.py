"""Trace requests to simulated arrivals: prompt length, answer length and the prompt's block keys
at the profile's block size (equal keys = equal prefix, as the trace's hash ids say)."""

from __future__ import annotations

from typing import NamedTuple

from client.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest


class TraceScaling(NamedTuple):
    """How the trace is fitted to the simulated cluster (as `halfmoon replay` fits it to a real
    one), and how fast it is played."""

    length_scale: float = 1.0  # prompt lengths (and the tokens of a hash id) times this
    rate_scale: float = 1.0  # arrival rate times this (inter-arrival times divided by it)
    max_output: int | None = None
    max_input: int | None = None
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS


class SimRequest(NamedTuple):
    # the request's place in the trace (shadows tuple.index, which nothing here calls)
    index: int  # type: ignore[assignment]
    arrival_ms: float
    input_tokens: int
    output_tokens: int  # tokens to generate, the first (from prefill) included
    keys: tuple[int, ...]  # one per full block of the prompt


def make_arrivals(reqs: list[TraceRequest], s: TraceScaling, block_size: int) -> list[SimRequest]:
    """The trace's requests in arrival order, the first at 0."""
    if s.rate_scale <= 0 or s.length_scale <= 0:
        raise ValueError("rate_scale and length_scale must be > 0")
    if not reqs:
        return []
    per = max(1, round(s.trace_block_tokens * s.length_scale))  # tokens a hash id covers
    chains: dict[tuple, int] = {}  # interned prefixes: (parent chain, hash id) -> chain id
    blocks: dict[tuple, int] = {}  # interned blocks: (chain id, block index) -> key

    def intern(table: dict, k: tuple) -> int:
        v = table.get(k)
        if v is None:
            v = table[k] = len(table) + 1
        return v

    t0 = reqs[0].timestamp_ms
    out = []
    for r in reqs:
        n = max(1, round(r.input_length * s.length_scale))
        if s.max_input is not None:
            n = min(n, s.max_input)
        out_tokens = r.output_length if s.max_output is None else min(r.output_length, s.max_output)
        chain, ids = [], 0
        for h in r.hash_ids:
            ids = intern(chains, (ids, h))
            chain.append(ids)
        keys = []
        for j in range(n // block_size):
            h = ((j + 1) * block_size - 1) // per  # the hash id holding the block's last token
            if h < len(chain):
                keys.append(intern(blocks, (chain[h], j)))
            else:  # past the trace's ids: this request's own tokens
                keys.append(intern(blocks, (-(r.index + 1), j)))
        out.append(
            SimRequest(
                r.index,
                (r.timestamp_ms - t0) / s.rate_scale,
                n,
                max(1, out_tokens),
                tuple(keys),
            )
        )
    return out
