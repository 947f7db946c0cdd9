"""What a decode worker would give a new sequence: when it is admitted, and the time between
tokens it then sees, predicted from the worker's fitted step model and its running sequences."""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple

from conductor.policy_types import DecodeCandidate, RequestInfo
from servekit import blocks_needed, decode_features, predict


class DecodeEstimate(NamedTuple):
    """What a decode worker gives a new sequence: when it joins the batch, the TBT it then sees
    (Mooncake's: the mean of the slowest 10% of its gaps) and its TPOT (the mean gap). The
    conductor holds the prefill's first token until the decode worker admits the sequence (its KV
    pulled, the batch joined), so every wait before that is TTFT (`ttft_ms`) and the first gap is
    an ordinary step."""

    tbt_ms: float
    # time per output token, as vLLM's benchmark counts it: the mean of its steps over the answer
    # (the same step times as tbt_ms, so never above it)
    tpot_ms: float
    step_ms: float  # the first step after it joins
    admission_wait_ms: float  # from now until the pool holds its answer (and the batch a slot)
    # A sequence is admitted at a step boundary: a first token arriving while a step runs waits
    # out the rest of it (half a step on average)...
    align_ms: float = 0.0
    # ...then its KV pull runs alongside the next step, and it joins at the boundary after the
    # pull (with no batch running: the pull only).
    joining_ms: float = 0.0
    pull_ms: float = 0.0  # its KV pull
    drained_ms: float = math.inf  # when the sequences it knows of have all ended

    def ttft_ms(self, prefill_ttft_ms: float) -> float:
        """The TTFT of a sequence whose prefill answers `prefill_ttft_ms` from now."""
        if prefill_ttft_ms >= self.drained_ms:  # the worker is idle by then: admitted at once
            return prefill_ttft_ms + self.pull_ms
        return max(prefill_ttft_ms + self.align_ms, self.admission_wait_ms) + self.joining_ms



WORST_GAP_SHARE = 0.10  # Mooncake's TBT: the mean of a request's slowest 10% of token gaps
_LIFE_POINTS = 12  # points along a sequence's life at which its step time is predicted


def tbt_of_times(times_ms: Sequence[float]) -> float:
    """Mooncake's TBT of one answer from its token times: the mean of its slowest 10% of gaps."""
    return tbt_of_gaps([b - a for a, b in zip(times_ms, times_ms[1:])])


def tpot_of_times(times_ms: Sequence[float]) -> float:
    """The TPOT of one answer from its token times: its mean gap, (last - first) / (tokens - 1),
    vLLM's (end-to-end - TTFT) / (output tokens - 1) on the conductor's clock; 0.0 for one token."""
    if len(times_ms) < 2:
        return 0.0
    return (times_ms[-1] - times_ms[0]) / (len(times_ms) - 1)


def paced_slo_ms(tbt_slo_ms: float, tpot_slo_ms: float) -> float:
    """The objective a decode worker paces a stream's gaps by (DecodeRequest.tbt_slo_ms): the
    stricter of its TBT and TPOT objectives that are set (> 0); 0.0 when neither is. Where only
    TPOT is judged, its gaps are paced by the TPOT objective."""
    return min((x for x in (tbt_slo_ms, tpot_slo_ms) if x > 0), default=0.0)


def tbt_of_gaps(gaps_ms: Sequence[float]) -> float:
    """The mean of the slowest 10% of `gaps_ms` (at least one); 0.0 for none."""
    gaps = sorted(gaps_ms, reverse=True)
    if not gaps:
        return 0.0
    k = max(1, math.ceil(len(gaps) * WORST_GAP_SHARE))
    return sum(gaps[:k]) / k


def decode_estimate(
    d: DecodeCandidate, request: RequestInfo, block_size: int, window_tokens: int = 0
) -> DecodeEstimate:
    """What a new sequence would see on `d`: it waits until the pool holds its whole answer (and
    the batch has a slot), behind the sequences admitted before it; then each step costs the
    fitted model at the batch and context of that moment, running sequences growing a token a
    step and leaving when their answers end."""
    need = blocks_needed(request.num_tokens, request.max_tokens, block_size, window_tokens)
    pull_ms = d.pull_ms_per_block * -(-request.num_tokens // block_size)
    if not d.seqs and d.running > len(d.waiting):
        # Totals only: the batch and context as they are now, the wait unknown.
        batch = d.running + 1
        context = d.context_tokens + request.num_tokens + sum(w[0] for w in d.waiting)
        step = predict(d.coef, decode_features(batch, context))
        wall = step * d.wait_scale
        return DecodeEstimate(
            step * d.tbt_scale, step, step, 0.0, wall / 2, max(wall, pull_ms + wall / 2), pull_ms
        )
    # Admission in order, each when the pool holds its answer and the batch has a slot: blocks
    # free up as sequences end, the running ones first and then those admitted ahead of it.
    ending = [(r, held) for _, r, held in d.seqs]
    heapq.heapify(ending)
    slots = d.max_batch - len(d.seqs) if d.max_batch > 0 else math.inf
    free, t = d.free_blocks, 0
    # Each sequence by when it ends and its position offset: `t` steps from now one still going
    # holds (offset + t) tokens (one admitted later is counted as if in the batch from now).
    joined = [(r, pos) for pos, r, _ in d.seqs]
    for pos, gen, blocks in d.waiting:
        while (free < blocks or slots < 1) and ending:
            end, held = heapq.heappop(ending)
            t, free, slots = max(t, end), free + held, slots + 1
        free, slots = free - blocks, slots - 1
        heapq.heappush(ending, (t + gen, blocks))
        joined.append((t + gen, pos - t))
    while (free < need or slots < 1) and ending:
        end, held = heapq.heappop(ending)
        t, free, slots = max(t, end), free + held, slots + 1
    wait_steps = t
    joined.sort()
    ends = [r for r, _ in joined]
    after = [0] * (len(joined) + 1)  # after[i]: position offsets of joined[i:]
    for i in range(len(joined) - 1, -1, -1):
        after[i] = after[i + 1] + joined[i][1]

    c0, c1, c2 = d.coef  # the decode model, inlined: this runs per candidate per request

    def step_at(t: int, own: int) -> float:
        i = bisect.bisect_right(ends, t)
        alive = len(joined) - i
        return max(0.0, c0 + c1 * (alive + (own > 0)) + c2 * (after[i] + t * alive + own))

    before = _spread(wait_steps)
    # waits pass in wall-clock steps, the compute model's times d.wait_scale
    wait_ms = sum(step_at(t, 0) for t in before) * wait_steps / len(before) if before else 0.0
    wait_ms *= d.wait_scale
    gaps = max(1, request.max_tokens - 1)
    points = _spread(gaps)
    steps = [step_at(wait_steps + i, request.num_tokens + i) for i in points]
    # Mooncake's TBT: the mean of the slowest 10% of the gaps, each point standing for its share.
    k = max(1, math.ceil(gaps * WORST_GAP_SHARE))
    total, taken = 0.0, 0.0
    for v in sorted(steps, reverse=True):
        take = min(gaps / len(points), k - taken)
        if take <= 0:
            break
        total, taken = total + v * take, taken + take
    # TPOT: the mean step, each point standing for the same share of the gaps; TBT's tail as
    # the worker's streams measured it beyond the model's mean
    tpot = sum(steps) / len(steps)
    tbt = total / taken * d.tbt_scale
    if bisect.bisect_right(ends, wait_steps) == len(joined):
        # No batch running when it may join: admitted as soon as its KV is in.
        return DecodeEstimate(tbt, tpot, steps[0], wait_ms, 0.0, pull_ms, pull_ms)
    # It is admitted at a step boundary, pulls its KV alongside the next step and joins at the
    # boundary after the pull; unless its prefill answers after the batch has run dry.
    inflight = step_at(wait_steps, 0) * d.wait_scale
    span = _spread(ends[-1])
    drained = sum(step_at(t, 0) for t in span) * ends[-1] / len(span) * d.wait_scale
    return DecodeEstimate(
        tbt,
        tpot,
        steps[0],
        wait_ms,
        inflight / 2,
        max(inflight, pull_ms + inflight / 2),
        pull_ms,
        drained,
    )


def _spread(n: int) -> list[int]:
    """Up to _LIFE_POINTS step offsets spread evenly over [0, n)."""
    if n <= 0:
        return []
    if n <= _LIFE_POINTS:
        return list(range(n))
    return [round(i * (n - 1) / (_LIFE_POINTS - 1)) for i in range(_LIFE_POINTS)]
