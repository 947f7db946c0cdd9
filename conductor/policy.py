"""Routing policies: pure objects that pick a (prefill, decode) worker pair for one request, no
I/O. The live conductor and any simulator build a `ClusterState` and call
`policy.choose(request, state)`; the decision is what runs.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from conductor.estimates import DecodeEstimate, decode_estimate
from conductor.policy_types import (
    ClusterState,
    Decision,
    DecodeCandidate,
    MissesObjectives,
    PrefillCandidate,
    Rejected,
    RequestInfo,
)
from servekit import blocks_needed, predict, prefill_features, reusable_blocks


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


def _least_loaded_decode(
    request: RequestInfo, state: ClusterState, slo: bool, prefill_ttft_ms: float
) -> tuple[DecodeCandidate, DecodeEstimate]:
    """Lowest load first (sequences with room now before those that would wait); `slo` filters
    by TBT and by the TTFT the sequence sees there (its prefill answers `prefill_ttft_ms` from
    now, then it waits for admission)."""
    need = blocks_needed(
        request.num_tokens, request.max_tokens, state.block_size, state.window_tokens
    )
    best, best_key, slow_ttft, slow_tbt = None, None, 0.0, 0.0
    for d in _decode_fits(request, state):
        est = decode_estimate(d, request, state.block_size, state.window_tokens)
        if slo and request.tbt_slo_ms > 0 and est.tbt_ms > request.tbt_slo_ms:
            slow_tbt = est.tbt_ms if not slow_tbt else min(slow_tbt, est.tbt_ms)
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
            raise MissesObjectives(
                f"predicted TTFT {slow_ttft:.0f} ms (the decode admission wait included) exceeds "
                f"the {request.ttft_slo_ms:g} ms SLO on every decode worker within the TBT SLO",
                slow_ttft - request.ttft_slo_ms,
            )
        # the batches there stay this slow about as long as their streams last
        raise MissesObjectives(
            f"predicted time between tokens {slow_tbt:.0f} ms exceeds the "
            f"{request.tbt_slo_ms:g} ms SLO on every decode worker",
            slow_tbt - request.tbt_slo_ms,
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


class _PrefillChoice(NamedTuple):
    """One way MooncakePolicy weighs to prefill a request: on a worker, fetching or not."""

    ttft_ms: float  # predicted time to the prefill's answer: queue, transfer and compute
    worker: PrefillCandidate
    reuse_blocks: int  # prefix blocks it reuses (its own tiers' or fetched)
    fetch_from: str  # remote store node to fetch from ("" = its own tiers only)
    fetch_blocks: int  # the prompt's leading blocks to take from there
    compute_ms: float  # the compute part of ttft_ms
    # a store node the worker was weighed fetching from over a link not measured yet ("" = none)
    assumed_link: str

    def key(self) -> tuple[float, str]:
        """The order choices are compared in: the fastest, then the worker id (a tie repeats)."""
        return (self.ttft_ms, self.worker.worker_id)


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
        chosen: _PrefillChoice | None = None
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
                if chosen is None or (ttft, w.worker_id) < chosen.key():
                    chosen = _PrefillChoice(
                        ttft, w, reuse, fetch_from, fetch_blocks, compute_ms, assumed
                    )
        assert chosen is not None  # _prefill_workers raised Rejected when none is healthy
        ttft = chosen.ttft_ms
        if self.reject and request.ttft_slo_ms > 0 and ttft > request.ttft_slo_ms:
            raise MissesObjectives(
                f"predicted TTFT {ttft:.0f} ms exceeds the {request.ttft_slo_ms:g} ms SLO "
                "on every prefill worker",
                ttft - request.ttft_slo_ms,
            )
        d, est = _least_loaded_decode(request, state, self.reject, ttft)
        total = est.ttft_ms(ttft)
        return Decision(
            prefill=chosen.worker.worker_id,
            decode=d.worker_id,
            use_cache=True,
            fetch_from=chosen.fetch_from,
            fetch_blocks=chosen.fetch_blocks,
            reuse_blocks=chosen.reuse_blocks,
            predicted_ttft_ms=total,
            predicted_tbt_ms=est.tbt_ms,
            predicted_prefill_ms=chosen.compute_ms,
            assumed_link=chosen.assumed_link,
            predicted_admission_ms=total - ttft,
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


def admit(
    policy: Policy, request: RequestInfo, state: ClusterState, admission: str = "reject"
) -> tuple[Decision, bool]:
    """(the policy's decision, whether it is best-effort). A request no pair is predicted to
    serve within its objectives raises MissesObjectives under "reject"; under "best_effort" it
    goes where the policy would send it without objectives, and is best-effort (never counted
    as good). No pair at all is Rejected either way."""
    try:
        return policy.choose(request, state), False
    except MissesObjectives:
        if admission != "best_effort":
            raise
    return policy.choose(request._replace(ttft_slo_ms=0.0, tbt_slo_ms=0.0), state), True


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
