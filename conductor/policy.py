"""Routing policies: pure objects that pick a (prefill, decode) worker pair for one request, no
I/O. The live conductor and any simulator build a `ClusterState` and call
`policy.choose(request, state)`; the decision is what runs.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from servekit import blocks_needed, decode_features, predict, prefill_features, reusable_blocks


class RequestInfo(NamedTuple):
    num_tokens: int  # prompt tokens
    max_tokens: int  # new tokens the request may generate
    ttft_slo_ms: float  # time-to-first-token objective; <= 0 = none
    tbt_slo_ms: float  # time-between-tokens objective; <= 0 = none


class PrefillCandidate(NamedTuple):
    worker_id: str
    # Index node ids local to this worker: its device pool's node and its host's store node(s).
    nodes: tuple[str, ...]
    queue_ms: float  # predicted wait before a new request starts computing
    coef: tuple[float, ...]  # fitted prefill model: ms = c0 + c1*tokens + c2*tokens*context
    healthy: bool = True
    # bytes per block its last CacheGen fetch moved (0 = it fetches raw blocks): what a fetch
    # costs on the link, at the level its link allowed
    fetch_block_bytes: float = 0.0


class DecodeCandidate(NamedTuple):
    worker_id: str
    running: int  # sequences in its running batch (and admitted, waiting for KV)
    free_blocks: int  # KV pool blocks free now
    total_blocks: int  # KV pool size
    context_tokens: int  # KV tokens its running sequences hold
    coef: tuple[float, ...]  # fitted decode-step model: ms = c0 + c1*batch + c2*context_tokens
    healthy: bool = True


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
    predicted_tbt_ms: float  # the chosen decode worker's predicted step time
    # The compute part of the TTFT estimate (the work this request adds to the worker's queue).
    predicted_prefill_ms: float = 0.0


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
    need = blocks_needed(request.num_tokens, request.max_tokens, state.block_size)
    fits = [d for d in _healthy(state.decode) if d.total_blocks >= need]
    if not fits:
        raise Rejected(f"no decode worker has a KV pool large enough for {need} blocks")
    return fits


def _least_loaded_decode(
    request: RequestInfo, state: ClusterState, slo: bool
) -> tuple[DecodeCandidate, float]:
    """Lowest load first (sequences with room now before those that would wait); `slo` filters
    by TBT."""
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
        raise Rejected(
            f"predicted time between tokens exceeds the {request.tbt_slo_ms:g} ms SLO "
            "on every decode worker"
        )
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
    """Mooncake's Algorithm 1: KV-cache-aware prefill choice by estimated TTFT, decode by load,
    early rejection."""

    # Fetch a remote prefix only when longer than this x the worker's own match.
    kvcache_balancing_threshold: float = 1.5
    transfer_mb_per_ms: float = 1.0  # store-to-worker bandwidth (1.0 = 1 GB/s)
    reject: bool = True  # reject when a predicted SLO is missed
    name: str = "mooncake"

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
            # Its own tiers: its device pool and its host's store node(s), all listed in w.nodes.
            own = max((cap(state.matches.get(n, 0)) for n in w.nodes), default=0)
            fetch_from, fetch_blocks, transfer_ms = "", 0, 0.0
            reuse = own
            # Fetch only a prefix enough longer than its own to be worth the transfer (Mooncake's
            # kvcache_balancing_threshold); below that the worker computes what its tiers lack.
            longer = best_blocks > own and best_blocks > self.kvcache_balancing_threshold * own
            if longer and best_node not in w.nodes:
                reuse, fetch_from, fetch_blocks = best_blocks, best_node, best_blocks
                per_block = w.fetch_block_bytes or state.block_bytes
                transfer_ms = (best_blocks - own) * per_block / (self.transfer_mb_per_ms * 1e6)
            compute_ms = predict(
                w.coef, prefill_features(request.num_tokens - reuse * bs, request.num_tokens)
            )
            ttft = w.queue_ms + transfer_ms + compute_ms
            key = (ttft, w.worker_id)
            if chosen is None or key < chosen[0]:
                chosen = (key, w, reuse, fetch_from, fetch_blocks, ttft, compute_ms)
        _, w, reuse, fetch_from, fetch_blocks, ttft, compute_ms = chosen
        if self.reject and request.ttft_slo_ms > 0 and ttft > request.ttft_slo_ms:
            raise Rejected(
                f"predicted TTFT {ttft:.0f} ms exceeds the {request.ttft_slo_ms:g} ms SLO "
                "on every prefill worker"
            )
        d, tbt = _least_loaded_decode(request, state, slo=self.reject)
        return Decision(
            w.worker_id, d.worker_id, True, fetch_from, fetch_blocks, reuse, ttft, tbt, compute_ms
        )


@dataclass
class LoadBalancePolicy(Policy):
    """Baseline: the least-loaded prefill and decode workers, blind to where the cache lives."""

    use_cache: bool = True
    name: str = "load_balance"

    def choose(self, request: RequestInfo, state: ClusterState) -> Decision:
        w = min(_prefill_workers(state), key=lambda c: (c.queue_ms, c.worker_id))
        d, tbt = _least_loaded_decode(request, state, slo=False)
        compute_ms = _cold_prefill_ms(w, request)
        # Blind to where the cache lives: its own tiers only, nothing fetched remotely.
        return Decision(
            w.worker_id,
            d.worker_id,
            self.use_cache,
            fetch_from="",
            fetch_blocks=0,
            reuse_blocks=0,
            predicted_ttft_ms=w.queue_ms + compute_ms,
            predicted_tbt_ms=tbt,
            predicted_prefill_ms=compute_ms,
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
        # Its own tiers only, nothing fetched remotely.
        return Decision(
            w.worker_id,
            d.worker_id,
            True,
            fetch_from="",
            fetch_blocks=0,
            reuse_blocks=0,
            predicted_ttft_ms=w.queue_ms + compute_ms,
            predicted_tbt_ms=0.0,
            predicted_prefill_ms=compute_ms,
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
