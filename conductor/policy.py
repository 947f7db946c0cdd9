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

from conductor.corrections import Correction
from conductor.estimates import DecodeEstimate, decode_estimate, paced_slo_ms
from conductor.policy_types import (
    ClusterState,
    Decision,
    DecodeCandidate,
    MissesObjectives,
    PrefillCandidate,
    Rejected,
    RequestInfo,
)
from servekit import blocks_needed, decode_features, predict, prefill_features, reusable_blocks

# A miss predicted by an unchecked model on an idle worker is a probe (admit) only where the
# conductor's correction, which scales a model by 0.2x at the least, could bring it within the
# objective: a prediction 5x past it stays a refusal whatever the model's error.
PROBE_WITHIN = 1.0 / Correction.BOUNDS[0]


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


def _decode_misses(request: RequestInfo, est: DecodeEstimate) -> list[tuple[str, float, float]]:
    """The decode objectives of `request` that `est` misses, as (what, predicted ms, objective
    ms): TBT (the mean of the slowest 10% of gaps) and TPOT (the mean gap), each where set."""
    misses = []
    if request.tbt_slo_ms > 0 and est.tbt_ms > request.tbt_slo_ms:
        misses.append(("time between tokens", est.tbt_ms, request.tbt_slo_ms))
    if request.tpot_slo_ms > 0 and est.tpot_ms > request.tpot_slo_ms:
        misses.append(("time per output token", est.tpot_ms, request.tpot_slo_ms))
    return misses


def _least_loaded_decode(
    request: RequestInfo, state: ClusterState, slo: bool, prefill_ttft_ms: float
) -> tuple[DecodeCandidate, DecodeEstimate]:
    """Lowest load first (sequences with room now before those that would wait); `slo` filters
    by TBT and TPOT and by the TTFT the sequence sees there (its prefill answers
    `prefill_ttft_ms` from now, then it waits for admission)."""
    need = blocks_needed(
        request.num_tokens, request.max_tokens, state.block_size, state.window_tokens
    )
    best, best_key, slow_ttft, idle = None, None, 0.0, False
    slow: dict[str, tuple[float, float]] = {}  # objective missed -> (best prediction, objective)
    for d in _decode_fits(request, state):
        est = decode_estimate(d, request, state.block_size, state.window_tokens)
        misses = _decode_misses(request, est) if slo else []
        if misses:
            for what, predicted, objective in misses:
                slow[what] = (min(predicted, slow.get(what, (predicted,))[0]), objective)
            idle = idle or (
                d.running == 0
                and not d.waiting
                and not d.checked
                and all(p <= PROBE_WITHIN * o for _, p, o in misses)
            )
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
                f"the {request.ttft_slo_ms:g} ms SLO on every decode worker within the decode SLOs",
                slow_ttft - request.ttft_slo_ms,
            )
        # the batches there stay this slow about as long as their streams last
        said = " or ".join(
            f"predicted {what} {p:.0f} ms exceeds the {o:g} ms SLO" for what, (p, o) in slow.items()
        )
        raise MissesObjectives(
            f"{said} on every decode worker",
            min(p - o for p, o in slow.values()),
            idle=idle,
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
    # Conditional disaggregation (Dynamo's, llm-d's pd-decider): a prompt with at most this many
    # tokens to compute on a decode worker (after the prefix its host's store holds) is prefilled
    # there, between its steps, when that is predicted no slower than on a prefill worker; no
    # prefill queue, no KV transfer. 0 = every prompt on a prefill worker.
    local_prefill_tokens: int = 0
    # The share of the objective a decode worker paces by (the stricter of TBT and TPOT, where
    # set) it keeps for its steps (DecodeConfig's tbt_pace_fraction): a prefill there gets the
    # rest of the CPUs while its batch runs.
    tbt_pace_fraction: float = 0.8
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

    def turn_share(self, request: RequestInfo, running: int, step_ms: float) -> float:
        """The share of a host's CPUs a prefill gets while a decode worker there runs a batch
        of `running` sequences in steps of `step_ms`: the decode paces its steps by the stricter
        of the request's TBT and TPOT objectives (the cluster's, unless the request set its own)
        and keeps `tbt_pace_fraction` of that for a period, its step included; the prefill the
        rest, a tenth at least. 1.0 with no batch running or no objective paced by."""
        paced = paced_slo_ms(request.tbt_slo_ms, request.tpot_slo_ms)
        if not running or paced <= 0:
            return 1.0
        budget = self.tbt_pace_fraction * paced
        return max(0.1, (budget - step_ms) / budget)

    def shared_ms(
        self, w: PrefillCandidate, request: RequestInfo, state: ClusterState, work_ms: float
    ) -> float:
        """Wall-clock ms of `work_ms` of compute on prefill worker `w`, beside the decode workers
        it takes turns with (the slowest): the first slack one offers now runs at full speed (a
        stream that banked time ahead of its objective waits that long for its next step), the
        rest at the share its pacing leaves. `work_ms` with no batch running beside it."""
        wall = work_ms
        for d in state.decode:
            if d.worker_id not in w.cpu_peers:
                continue
            step = predict(d.coef, decode_features(d.running, d.context_tokens))
            share = self.turn_share(request, d.running, step)
            ahead = min(work_ms, max(0.0, d.offered_slack_ms)) if share < 1.0 else work_ms
            wall = max(wall, ahead + (work_ms - ahead) / share)
        return wall

    def choose(self, request: RequestInfo, state: ClusterState) -> Decision:
        """On a prefill worker (Algorithm 1), or on the decode worker itself where a short or
        mostly cached prompt is predicted to be served as fast there (`local_prefill_tokens`)."""
        local = None
        if self.local_prefill_tokens > 0 and not request.resumed:
            local = self._on_decode(request, state)
        try:
            remote = self._disaggregated(request, state)
        except Rejected:
            if local is None:
                raise
            return local  # the prefill workers cannot meet it (or are gone): the decode worker can
        if local is not None and local.predicted_ttft_ms <= remote.predicted_ttft_ms:
            return local
        return remote

    def _on_decode(self, request: RequestInfo, state: ClusterState) -> Decision | None:
        """The best decode worker to prefill the prompt itself: the fastest predicted TTFT among
        those within the objectives with at most `local_prefill_tokens` to compute; None when
        none is. Its compute is predicted by the fastest prefill worker's model (the same model
        on the same kind of CPU), slowed to the share of the CPUs its running batch leaves."""
        bs = state.block_size
        coefs = [w.coef for w in state.prefill]
        if not coefs:
            return None
        best: Decision | None = None
        for d in _decode_fits(request, state):
            own = max((state.matches.get(n, 0) for n in d.nodes), default=0)
            own = reusable_blocks(own, request.num_tokens, bs)
            todo = request.num_tokens - own * bs
            if todo > self.local_prefill_tokens:
                continue
            est = decode_estimate(d, request, bs, state.window_tokens)
            if self.reject and _decode_misses(request, est):
                continue
            compute_ms = min(predict(c, prefill_features(todo, request.num_tokens)) for c in coefs)
            share = self.turn_share(request, d.running, est.step_ms)
            prefill_ms = d.local_queue_ms + compute_ms / share
            ttft = (est.admission_wait_ms + prefill_ms + est.align_ms) * d.local_scale
            if self.reject and request.ttft_slo_ms > 0 and ttft > request.ttft_slo_ms:
                continue
            if best is None or (ttft, d.worker_id) < (best.predicted_ttft_ms, best.decode):
                best = Decision(
                    prefill="",
                    decode=d.worker_id,
                    use_cache=True,
                    fetch_from="",
                    fetch_blocks=0,
                    reuse_blocks=own,
                    predicted_ttft_ms=ttft,
                    predicted_tbt_ms=est.tbt_ms,
                    predicted_tpot_ms=est.tpot_ms,
                    predicted_prefill_ms=compute_ms,
                    prefill_on_decode=True,  # no prefill answer: no part after it
                )
        return best

    def _disaggregated(self, request: RequestInfo, state: ClusterState) -> Decision:
        bs = state.block_size
        cap = lambda b: reusable_blocks(b, request.num_tokens, bs)  # noqa: E731
        # The longest prefix a worker could fetch: a device pool is its owner's alone.
        best_node, best_blocks = "", 0
        for node, blocks in sorted(state.matches.items()):
            if node not in state.device_nodes and cap(blocks) > best_blocks:
                best_node, best_blocks = node, cap(blocks)
        chosen: _PrefillChoice | None = None
        for w in _prefill_workers(state):
            # Its queue and its compute run at the share of its CPUs the decode steps on them
            # leave (the fetch does not need them). The batch may end sooner, but streams mostly
            # outlast a prompt: at 0.25 req/s on 2 cores, prompts of 552-584 tokens admitted by
            # full-speed predictions under 2 s took 2.5-3.8 s beside running streams.
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
                ttft = self.shared_ms(w, request, state, w.queue_ms + compute_ms) + moved
                if chosen is None or (ttft, w.worker_id) < chosen.key():
                    chosen = _PrefillChoice(
                        ttft, w, reuse, fetch_from, fetch_blocks, compute_ms, assumed
                    )
        assert chosen is not None  # _prefill_workers raised Rejected when none is healthy
        ttft = chosen.ttft_ms
        if self.reject and request.ttft_slo_ms > 0 and ttft > request.ttft_slo_ms:
            work = chosen.worker.queue_ms + chosen.compute_ms
            raise MissesObjectives(
                f"predicted TTFT {ttft:.0f} ms exceeds the {request.ttft_slo_ms:g} ms SLO "
                f"on every prefill worker (on {chosen.worker.worker_id}: "
                f"{chosen.worker.queue_ms:.0f} ms queued + {chosen.compute_ms:.0f} ms its own, "
                f"{ttft - work:.0f} ms yielding the CPUs to decode steps or fetching)",
                ttft - request.ttft_slo_ms,
                idle=chosen.worker.queue_ms <= 0.0
                and not chosen.worker.checked
                and ttft <= PROBE_WITHIN * request.ttft_slo_ms,
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
            predicted_tpot_ms=est.tpot_ms,
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
            predicted_tpot_ms=est.tpot_ms,
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
            predicted_tpot_ms=est.tpot_ms,
            predicted_prefill_ms=compute_ms,
            predicted_admission_ms=total - w.queue_ms - compute_ms,
        )


ADMITTED, PROBE, BEST_EFFORT = "admitted", "probe", "best_effort"


def admit(
    policy: Policy, request: RequestInfo, state: ClusterState, admission: str = "reject"
) -> tuple[Decision, str]:
    """(the policy's decision, how it was admitted: ADMITTED within its objectives as predicted;
    PROBE where the prediction that missed them was made on an idle worker; BEST_EFFORT).

    A request no pair is predicted to serve within its objectives raises MissesObjectives under
    "reject"; under "best_effort" it goes where the policy would send it without objectives, and
    is best-effort (never counted as good). Either way, a miss predicted on a worker with
    nothing to do and a model no served request has checked yet is admitted, as a probe, and
    judged by its outcome (where within PROBE_WITHIN of its objective): that prediction is the
    model alone, which only requests served there correct, and a model fitted on a loaded
    machine would otherwise refuse every request from then on. No pair at all is Rejected."""
    try:
        return policy.choose(request, state), ADMITTED
    except MissesObjectives as exc:
        if not exc.idle and admission != "best_effort":
            raise
        how = PROBE if exc.idle else BEST_EFFORT
    unjudged = request._replace(ttft_slo_ms=0.0, tbt_slo_ms=0.0, tpot_slo_ms=0.0)
    return policy.choose(unjudged, state), how


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
