"""Routing policies: pure objects that pick a (prefill, decode) worker pair for one request, no
I/O. The live conductor and any simulator build a `ClusterState` and call
`policy.choose(request, state)`; the decision is what runs.
"""

from __future__ import annotations

import abc
import bisect
import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from servekit import blocks_needed, decode_features, predict, prefill_features, reusable_blocks


class RequestInfo(NamedTuple):
    num_tokens: int  # prompt tokens
    max_tokens: int  # new tokens the request may generate
    ttft_slo_ms: float  # time-to-first-token objective; <= 0 = none
    tbt_slo_ms: float  # time-between-tokens objective; <= 0 = none


class Link(NamedTuple):
    """A link from a store node to a prefill worker, as the worker's fetches measured it: a fetch
    of n bytes takes fixed_ms + n / bytes_per_ms."""

    node: str  # the store node's index id
    fixed_ms: float  # round trips before the bytes flow
    bytes_per_ms: float


class PrefillCandidate(NamedTuple):
    worker_id: str
    # Index node ids local to this worker: its device pool's node and its host's store node(s).
    nodes: tuple[str, ...]
    queue_ms: float  # predicted wait before a new request starts computing
    coef: tuple[float, ...]  # fitted prefill model: ms = c0 + c1*tokens + c2*tokens*context
    healthy: bool = True
    # bytes one block moves when it fetches: a block at the store's codec, or what its last
    # CacheGen fetch moved per block (0 = unknown: the cluster's block_bytes)
    fetch_block_bytes: float = 0.0
    # Prompt tokens ahead of a new request there (queued, and left in the round computing), for
    # reports; `queue_ms` is what the policy adds.
    queued_tokens: int = 0
    # the links from the store nodes it has fetched from, as measured (others: the default)
    links: tuple[Link, ...] = ()


class DecodeCandidate(NamedTuple):
    worker_id: str
    running: int  # sequences in its running batch (and admitted, waiting for KV)
    free_blocks: int  # KV pool blocks free now
    total_blocks: int  # KV pool size
    context_tokens: int  # KV tokens its running sequences hold
    coef: tuple[float, ...]  # fitted decode-step model: ms = c0 + c1*batch + c2*context_tokens
    healthy: bool = True
    # Each running sequence as (KV position, tokens it may still generate, pool blocks it holds):
    # what the batch a new sequence joins looks like as it goes on, and when blocks free up. Empty:
    # only the totals above are known (the batch and context stay as they are now).
    seqs: tuple[tuple[int, int, int], ...] = ()
    # Sequences admitted before a new one (waiting for pool room, or routed and not yet reported),
    # as (prompt tokens, tokens to generate, blocks needed); they take the pool's room first.
    waiting: tuple[tuple[int, int, int], ...] = ()
    max_batch: int = 0  # sequences one step carries at most (0 = no bound)
    # what pulling one prompt block into its pool took lately (0 = unknown: taken as instant)
    pull_ms_per_block: float = 0.0


class DecodeEstimate(NamedTuple):
    """What a decode worker gives a new sequence: when it joins the batch and the TBT it then sees
    (Mooncake's: the mean of the slowest 10% of its gaps). The conductor holds the prefill's first
    token until the decode worker admits the sequence (its KV pulled, the batch joined), so every
    wait before that is TTFT (`ttft_ms`) and the first gap is an ordinary step."""

    tbt_ms: float
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


class ClusterState(NamedTuple):
    prefill: Sequence[PrefillCandidate]
    decode: Sequence[DecodeCandidate]
    matches: dict[str, int]  # index answer: node id -> leading blocks of this prompt it holds
    block_size: int  # tokens per block
    block_bytes: int  # bytes of one block's KV (all layers)
    # Index node ids that are a prefill worker's own device pool: they count toward that worker's
    # own match (it lists them in its nodes) but are never a fetch source, since no other worker
    # can read another's device memory.
    device_nodes: frozenset[str] = frozenset()
    # tokens of each sequence a decode worker keeps outside its pool (KIVI's full-precision
    # window, kivi_residual): its pool holds blocks for the rest only (servekit.blocks_needed)
    window_tokens: int = 0


class Decision(NamedTuple):
    """What runs: the prefill worker loads the prefix this names and fetches nothing on its own."""

    prefill: str  # prefill worker id
    decode: str  # decode worker id
    use_cache: bool  # False: the prefill worker computes everything (cache_off)
    # Remote store node to pull the prefix from; "" = the worker uses its own tiers only (its
    # device pool, its host's DRAM/SSD) and fetches nothing remote. Never a device node.
    fetch_from: str
    # Exactly what to pull from `fetch_from`: the prompt's leading `fetch_blocks` blocks, less those
    # its own tiers already hold, never more; 0 when `fetch_from` is "".
    fetch_blocks: int
    reuse_blocks: int  # prefix blocks the policy expects to be reused
    predicted_ttft_ms: float  # the policy's estimate (0 when it does not estimate)
    predicted_tbt_ms: float  # the chosen decode worker's predicted TBT
    # The compute part of the TTFT estimate (the work this request adds to the worker's queue).
    predicted_prefill_ms: float = 0.0
    # A store node the chosen worker was weighed fetching from over a link none of its fetches
    # has measured yet (the estimate took the policy's default speed); "" = none.
    assumed_link: str = ""
    # The part of the TTFT estimate after the prefill's answer: the decode admission wait, the KV
    # pull and the step boundary it joins at (what a correction of the prefill leaves out).
    predicted_admission_ms: float = 0.0


class Rejected(Exception):
    """No worker pair can serve the request within its SLOs (the conductor answers
    RESOURCE_EXHAUSTED)."""


class Policy(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def choose(self, request: RequestInfo, state: ClusterState) -> Decision: ...


def _healthy(items):
    return [c for c in items if c.healthy]


def _decode_fits(request: RequestInfo, state: ClusterState) -> list[DecodeCandidate]:
    need = blocks_needed(
        request.num_tokens, request.max_tokens, state.block_size, state.window_tokens
    )
    fits = [d for d in _healthy(state.decode) if d.total_blocks >= need]
    if not fits:
        raise Rejected(f"no decode worker has a KV pool large enough for {need} blocks")
    return fits


WORST_GAP_SHARE = 0.10  # Mooncake's TBT: the mean of a request's slowest 10% of token gaps
_LIFE_POINTS = 12  # points along a sequence's life at which its step time is predicted


def tbt_of_times(times_ms: Sequence[float]) -> float:
    """Mooncake's TBT of one answer from its token times: the mean of its slowest 10% of gaps."""
    gaps = sorted((b - a for a, b in zip(times_ms, times_ms[1:])), reverse=True)
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
        return DecodeEstimate(step, step, 0.0, step / 2, max(step, pull_ms + step / 2), pull_ms)
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
    wait_ms = sum(step_at(t, 0) for t in before) * wait_steps / len(before) if before else 0.0
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
    if bisect.bisect_right(ends, wait_steps) == len(joined):
        # No batch running when it may join: admitted as soon as its KV is in.
        return DecodeEstimate(total / taken, steps[0], wait_ms, 0.0, pull_ms, pull_ms)
    # It is admitted at a step boundary, pulls its KV alongside the next step and joins at the
    # boundary after the pull; unless its prefill answers after the batch has run dry.
    inflight = step_at(wait_steps, 0)
    span = _spread(ends[-1])
    drained = sum(step_at(t, 0) for t in span) * ends[-1] / len(span)
    return DecodeEstimate(
        total / taken,
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


def _least_loaded_decode(
    request: RequestInfo, state: ClusterState, slo: bool, prefill_ttft_ms: float
) -> tuple[DecodeCandidate, DecodeEstimate]:
    """Lowest load first (sequences with room now before those that would wait); `slo` filters
    by TBT and by the TTFT the sequence sees there (its prefill answers `prefill_ttft_ms` from
    now, then it waits for admission)."""
    need = blocks_needed(
        request.num_tokens, request.max_tokens, state.block_size, state.window_tokens
    )
    best, best_key, slow_ttft = None, None, 0.0
    for d in _decode_fits(request, state):
        est = decode_estimate(d, request, state.block_size, state.window_tokens)
        if slo and request.tbt_slo_ms > 0 and est.tbt_ms > request.tbt_slo_ms:
            continue
        ttft = est.ttft_ms(prefill_ttft_ms)
        if slo and request.ttft_slo_ms > 0 and ttft > request.ttft_slo_ms:
            slow_ttft = ttft if not slow_ttft else min(slow_ttft, ttft)
            continue
        short = est.admission_wait_ms > 0 or d.free_blocks < need
        key = (short, d.running, est.tbt_ms, d.worker_id)
        if best_key is None or key < best_key:
            best, best_key, best_est = d, key, est
    if best is None:
        if slow_ttft:
            raise Rejected(
                f"predicted TTFT {slow_ttft:.0f} ms (the decode admission wait included) exceeds "
                f"the {request.ttft_slo_ms:g} ms SLO on every decode worker within the TBT SLO"
            )
        raise Rejected(
            f"predicted time between tokens exceeds the {request.tbt_slo_ms:g} ms SLO "
            "on every decode worker"
        )
    return best, best_est


def _cold_prefill_ms(w: PrefillCandidate, request: RequestInfo) -> float:
    """Predicted compute time of the whole prompt (the baselines do not look at the cache)."""
    return predict(w.coef, prefill_features(request.num_tokens, request.num_tokens))


def _prefill_workers(state: ClusterState) -> list[PrefillCandidate]:
    workers = _healthy(state.prefill)
    if not workers:
        raise Rejected("no healthy prefill worker")
    return workers


@dataclass
class MooncakePolicy(Policy):
    """Mooncake's Algorithm 1: KV-cache-aware prefill choice by estimated TTFT, decode by load,
    early rejection. Where a worker may fetch a longer prefix, it fetches only when that is
    predicted faster than computing what its own tiers lack, over the link as measured."""

    # Fetch a remote prefix only when longer than this x the worker's own match.
    kvcache_balancing_threshold: float = 1.5
    # The speed assumed of a link no fetch has measured yet (1.0 = 1 GB/s); the workers' measured
    # links (PrefillCandidate.links) take its place.
    transfer_mb_per_ms: float = 1.0
    reject: bool = True  # reject when a predicted SLO is missed
    name: str = "mooncake"

    def transfer_ms(
        self, w: PrefillCandidate, node: str, blocks: int, block_bytes: int
    ) -> tuple[float, bool]:
        """(predicted ms for `w` to fetch `blocks` blocks from `node`, whether that link was
        measured): the bytes a block moves at the store's codec (or CacheGen's level) over the
        link as `w`'s fetches measured it, else at the default speed."""
        nbytes = blocks * (w.fetch_block_bytes or block_bytes)
        link = next((x for x in w.links if x.node == node and x.bytes_per_ms > 0), None)
        if link is None:
            return nbytes / (self.transfer_mb_per_ms * 1e6), False
        return link.fixed_ms + nbytes / link.bytes_per_ms, True

    def choose(self, request: RequestInfo, state: ClusterState) -> Decision:
        bs = state.block_size
        cap = lambda b: reusable_blocks(b, request.num_tokens, bs)  # noqa: E731
        # The longest prefix a worker could fetch: a device pool is its owner's alone.
        best_node, best_blocks = "", 0
        for node, blocks in sorted(state.matches.items()):
            if node not in state.device_nodes and cap(blocks) > best_blocks:
                best_node, best_blocks = node, cap(blocks)
        chosen = None
        for w in _prefill_workers(state):
            # Its own tiers: its device pool and its host's store node(s), all listed in w.nodes;
            # what they lack is computed.
            own = max((cap(state.matches.get(n, 0)) for n in w.nodes), default=0)
            options = [("", 0, own, 0.0)]  # (fetch_from, fetch_blocks, reuse, transfer ms)
            assumed = ""
            # Fetch only a prefix enough longer than its own to be worth the transfer (Mooncake's
            # kvcache_balancing_threshold), and only when the transfer over the link as measured
            # beats computing those blocks (the first option wins a tie: nothing moves).
            longer = best_blocks > own and best_blocks > self.kvcache_balancing_threshold * own
            if longer and best_node not in w.nodes:
                moved, measured = self.transfer_ms(
                    w, best_node, best_blocks - own, state.block_bytes
                )
                options.append((best_node, best_blocks, best_blocks, moved))
                assumed = "" if measured else best_node
            for fetch_from, fetch_blocks, reuse, moved in options:
                compute_ms = predict(
                    w.coef, prefill_features(request.num_tokens - reuse * bs, request.num_tokens)
                )
                ttft = w.queue_ms + moved + compute_ms
                key = (ttft, w.worker_id)
                if chosen is None or key < chosen[0]:
                    chosen = (key, w, reuse, fetch_from, fetch_blocks, ttft, compute_ms, assumed)
        _, w, reuse, fetch_from, fetch_blocks, ttft, compute_ms, assumed = chosen
        if self.reject and request.ttft_slo_ms > 0 and ttft > request.ttft_slo_ms:
            raise Rejected(
                f"predicted TTFT {ttft:.0f} ms exceeds the {request.ttft_slo_ms:g} ms SLO "
                "on every prefill worker"
            )
        d, est = _least_loaded_decode(request, state, self.reject, ttft)
        total = est.ttft_ms(ttft)
        return Decision(
            w.worker_id,
            d.worker_id,
            True,
            fetch_from,
            fetch_blocks,
            reuse,
            total,
            est.tbt_ms,
            compute_ms,
            assumed,
            total - ttft,
        )


@dataclass
class LoadBalancePolicy(Policy):
    """Baseline: the least-loaded prefill and decode workers, blind to where the cache lives."""

    use_cache: bool = True
    name: str = "load_balance"

    def choose(self, request: RequestInfo, state: ClusterState) -> Decision:
        w = min(_prefill_workers(state), key=lambda c: (c.queue_ms, c.worker_id))
        compute_ms = _cold_prefill_ms(w, request)
        prefill_ttft = w.queue_ms + compute_ms
        d, est = _least_loaded_decode(request, state, False, prefill_ttft)
        total = est.ttft_ms(prefill_ttft)
        # Blind to where the cache lives: its own tiers only, nothing fetched remotely.
        return Decision(
            w.worker_id,
            d.worker_id,
            self.use_cache,
            fetch_from="",
            fetch_blocks=0,
            reuse_blocks=0,
            predicted_ttft_ms=total,
            predicted_tbt_ms=est.tbt_ms,
            predicted_prefill_ms=compute_ms,
            predicted_admission_ms=total - prefill_ttft,
        )


@dataclass
class CacheOffPolicy(LoadBalancePolicy):
    """Baseline: load balancing with no KV reuse at all (every prompt computed in full)."""

    use_cache: bool = False
    name: str = "cache_off"


@dataclass
class RandomPolicy(Policy):
    """Baseline: a uniformly random healthy pair (seeded, so replays repeat)."""

    seed: int = 0
    name: str = "random"

    def __post_init__(self):
        self._rng = random.Random(self.seed)

    def choose(self, request: RequestInfo, state: ClusterState) -> Decision:
        w = self._rng.choice(sorted(_prefill_workers(state)))
        d = self._rng.choice(sorted(_decode_fits(request, state)))
        compute_ms = _cold_prefill_ms(w, request)
        est = decode_estimate(d, request, state.block_size, state.window_tokens)
        total = est.ttft_ms(w.queue_ms + compute_ms)
        # Its own tiers only, nothing fetched remotely.
        return Decision(
            w.worker_id,
            d.worker_id,
            True,
            fetch_from="",
            fetch_blocks=0,
            reuse_blocks=0,
            predicted_ttft_ms=total,
            predicted_tbt_ms=est.tbt_ms,
            predicted_prefill_ms=compute_ms,
            predicted_admission_ms=total - w.queue_ms - compute_ms,
        )


POLICIES: dict[str, Callable[..., Policy]] = {
    "mooncake": MooncakePolicy,
    "load_balance": LoadBalancePolicy,
    "random": RandomPolicy,
    "cache_off": CacheOffPolicy,
}


def make_policy(name: str, **options) -> Policy:
    """A policy by registry name; options are its dataclass fields."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return POLICIES[name](**options)
