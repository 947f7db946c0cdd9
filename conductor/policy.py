"""Routing policies: pure objects that pick a (prefill, decode) worker pair for one request, no I/O.

The live conductor and any simulator build a `ClusterState` and call `policy.choose(request, state)`.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from conductor.timing import decode_features, predict, prefill_features


class RequestInfo(NamedTuple):
    num_tokens: int        # prompt tokens
    max_tokens: int        # new tokens the request may generate
    ttft_slo_ms: float     # time-to-first-token objective; <= 0 = none
    tbt_slo_ms: float      # time-between-tokens objective; <= 0 = none


class PrefillCandidate(NamedTuple):
    worker_id: str
    nodes: tuple[str, ...]      # index node ids local to this worker (its device tier, its host's store)
    queue_ms: float             # predicted wait before a new request starts computing
    coef: tuple[float, ...]     # fitted prefill model: ms = c0 + c1*tokens + c2*tokens*context
    healthy: bool = True


class DecodeCandidate(NamedTuple):
    worker_id: str
    running: int                # sequences in its running batch (and admitted, waiting for KV)
    free_blocks: int            # KV pool blocks free now
    total_blocks: int           # KV pool size
    context_tokens: int         # KV tokens its running sequences hold
    coef: tuple[float, ...]     # fitted decode-step model: ms = c0 + c1*batch + c2*context_tokens
    healthy: bool = True


class ClusterState(NamedTuple):
    prefill: Sequence[PrefillCandidate]
    decode: Sequence[DecodeCandidate]
    matches: dict[str, int]     # index answer: node id -> leading blocks of this prompt it holds
    block_size: int             # tokens per block
    block_bytes: int            # bytes of one block's KV (all layers)


class Decision(NamedTuple):
    prefill: str                # prefill worker id
    decode: str                 # decode worker id
    use_cache: bool             # False: the prefill worker computes everything (cache_off)
    fetch_from: str             # node to pull the cached prefix from; "" = the worker's own lookup
    fetch_blocks: int           # blocks to pull from `fetch_from` (0 = let the worker look up)
    reuse_blocks: int           # prefix blocks the policy expects to be reused
    predicted_ttft_ms: float    # the policy's estimate (0 when it does not estimate)
    predicted_tbt_ms: float
    predicted_prefill_ms: float = 0.0  # the compute part of the TTFT estimate (work this request adds to the queue)


class Rejected(Exception):
    """No worker pair can serve the request within its SLOs (the conductor answers RESOURCE_EXHAUSTED)."""


class Policy(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def choose(self, request: RequestInfo, state: ClusterState) -> Decision: ...


def blocks_needed(num_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a sequence holds at its longest (prompt + all new tokens)."""
    return -(-(num_tokens + max_tokens) // block_size)


def reusable_blocks(blocks: int, num_tokens: int, block_size: int) -> int:
    """Cached blocks a prefill may reuse: at least one prompt token must be computed for the logits."""
    return max(0, min(blocks, (num_tokens - 1) // block_size))


def _healthy(items):
    return [c for c in items if c.healthy]


def _decode_fits(request: RequestInfo, state: ClusterState) -> list[DecodeCandidate]:
    need = blocks_needed(request.num_tokens, request.max_tokens, state.block_size)
    fits = [d for d in _healthy(state.decode) if d.total_blocks >= need]
    if not fits:
        raise Rejected(f"no decode worker has a KV pool large enough for {need} blocks")
    return fits


def _least_loaded_decode(request: RequestInfo, state: ClusterState, slo: bool) -> tuple[DecodeCandidate, float]:
    """Lowest load first (sequences with room now before those that would wait); `slo` filters by TBT."""
    need = blocks_needed(request.num_tokens, request.max_tokens, state.block_size)
    best, best_key, best_tbt = None, None, 0.0
    for d in _decode_fits(request, state):
        tbt = predict(d.coef, decode_features(d.running + 1, d.context_tokens + request.num_tokens))
        if slo and request.tbt_slo_ms > 0 and tbt > request.tbt_slo_ms:
            continue
        key = (d.free_blocks < need, d.running, tbt, d.worker_id)
        if best_key is None or key < best_key:
            best, best_key, best_tbt = d, key, tbt
    if best is None:
        raise Rejected(f"predicted time between tokens exceeds the {request.tbt_slo_ms:g} ms SLO on every decode worker")
    return best, best_tbt


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
    """Mooncake's Algorithm 1: KV-cache-aware prefill choice by estimated TTFT, decode by load, early rejection."""

    kvcache_balancing_threshold: float = 1.5   # fetch a remote prefix only when longer than this x the own match
    transfer_mb_per_ms: float = 1.0            # store-to-worker bandwidth (1.0 = 1 GB/s)
    reject: bool = True                        # reject when a predicted SLO is missed
    name: str = "mooncake"

    def choose(self, request: RequestInfo, state: ClusterState) -> Decision:
        bs = state.block_size
        cap = lambda b: reusable_blocks(b, request.num_tokens, bs)  # noqa: E731
        best_node, best_blocks = "", 0
        for node, blocks in sorted(state.matches.items()):
            if cap(blocks) > best_blocks:
                best_node, best_blocks = node, cap(blocks)
        chosen = None
        for w in _prefill_workers(state):
            own = max((cap(state.matches.get(n, 0)) for n in w.nodes), default=0)
            fetch_from, fetch_blocks, transfer_ms = "", 0, 0.0
            reuse = own
            if best_blocks > own and best_blocks > self.kvcache_balancing_threshold * own and best_node not in w.nodes:
                reuse, fetch_from, fetch_blocks = best_blocks, best_node, best_blocks
                transfer_ms = (best_blocks - own) * state.block_bytes / (self.transfer_mb_per_ms * 1e6)
            compute_ms = predict(w.coef, prefill_features(request.num_tokens - reuse * bs, request.num_tokens))
            ttft = w.queue_ms + transfer_ms + compute_ms
            key = (ttft, w.worker_id)
            if chosen is None or key < chosen[0]:
                chosen = (key, w, reuse, fetch_from, fetch_blocks, ttft, compute_ms)
        _, w, reuse, fetch_from, fetch_blocks, ttft, compute_ms = chosen
        if self.reject and request.ttft_slo_ms > 0 and ttft > request.ttft_slo_ms:
            raise Rejected(f"predicted TTFT {ttft:.0f} ms exceeds the {request.ttft_slo_ms:g} ms SLO on every prefill worker")
        d, tbt = _least_loaded_decode(request, state, slo=self.reject)
        return Decision(w.worker_id, d.worker_id, True, fetch_from, fetch_blocks, reuse, ttft, tbt, compute_ms)


@dataclass
class LoadBalancePolicy(Policy):
    """Baseline: the least-loaded prefill and decode workers, blind to where the cache lives."""

    use_cache: bool = True
    name: str = "load_balance"

    def choose(self, request: RequestInfo, state: ClusterState) -> Decision:
        w = min(_prefill_workers(state), key=lambda c: (c.queue_ms, c.worker_id))
        d, tbt = _least_loaded_decode(request, state, slo=False)
        compute_ms = _cold_prefill_ms(w, request)
        return Decision(w.worker_id, d.worker_id, self.use_cache, "", 0, 0, w.queue_ms + compute_ms, tbt, compute_ms)


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
        return Decision(w.worker_id, d.worker_id, True, "", 0, 0, w.queue_ms + compute_ms, 0.0, compute_ms)


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
