"""One routing decision: the request's SLOs and the cluster's state go to the policy, and its
choice comes back as a `Routed` pair with the work booked on both workers."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from conductor.config import ConductorConfig
from conductor.fleet import DecodeBooking, DecodeWorker, Fleet, PrefillBooking, PrefillWorker
from conductor.links import AssumedLinks
from conductor.policy import (
    ADMITTED,
    BEST_EFFORT,
    POLICIES,
    Policy,
    RequestInfo,
    admit,
    make_policy,
)
from conductor.prefixes import PrefixIndex
from conductor.state import cluster_state
from servekit import blocks_needed, is_kivi

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Routed:
    """Where a request runs now and what the policy predicted of it there; the estimates are
    kept to correct the workers' models once the request's times are measured."""

    decision_policy: str  # the policy's registry name
    prefill: PrefillWorker | None  # the chosen prefill worker (None: the decode worker prefills)
    decode: DecodeWorker  # the chosen decode worker
    fetch_from: str  # remote store node to pull the prefix from ("" = own tiers only)
    fetch_blocks: int  # the prompt's leading blocks to take from there
    use_cache: bool  # False: compute everything (cache_off)
    predicted_ttft_ms: float  # the policy's TTFT estimate
    predicted_prefill_ms: float  # the compute this request adds to the prefill worker's queue
    ttft_slo_ms: float = 0.0  # the request's TTFT objective (0 = none): the prefill's budget
    predicted_tbt_ms: float = 0.0  # the policy's TBT estimate
    predicted_tpot_ms: float = 0.0  # the policy's TPOT estimate (the mean step)
    decode_tbt_scale: float = 1.0  # the decode worker's tail factor the TBT estimate was made with
    local_ratio: float = 1.0  # prefilled on the decode worker: its `local` correction applied
    prefill_ratio: float = 1.0  # the prefill worker's correction the estimates were made with
    decode_ratio: float = 1.0  # the decode worker's
    # the part of predicted_ttft_ms after the prefill's answer (decode admission, KV pull)
    predicted_admission_ms: float = 0.0
    prefill_epoch: int = 0  # the prefill worker's model epoch the estimates were made against
    decode_epoch: int = 0  # the decode worker's
    # admitted although no pair was predicted to meet its objectives (admission: best_effort):
    # served, never counted as good
    best_effort: bool = False
    # prefilled on the decode worker itself, loading the prompt's leading `reuse_blocks` blocks
    # from its host's store (Decision.prefill_on_decode)
    prefill_on_decode: bool = False
    reuse_keys: tuple[bytes, ...] = ()


def make_policies(config: ConductorConfig) -> dict[str, Policy]:
    """Every policy a request may name, built with the configured options."""
    # a KIVI decode worker's pool holds packed blocks its prefill cannot write
    local = 0 if is_kivi(config.kv_cache_dtype) else config.local_prefill_tokens
    policies = {
        "mooncake": make_policy(
            "mooncake",
            kvcache_balancing_threshold=config.kvcache_balancing_threshold,
            local_prefill_tokens=local,
            transfer_mb_per_ms=config.transfer_mb_per_ms,
        ),
        "load_balance": make_policy("load_balance"),
        "random": make_policy("random", seed=config.random_seed),
        "cache_off": make_policy("cache_off"),
    }
    if config.policy not in policies:
        raise ValueError(
            f"ConductorConfig.policy: unknown policy {config.policy!r} "
            f"(known: {', '.join(sorted(POLICIES))})"
        )
    return policies


class Router:
    """Chooses a pair for a request with the policy it names, and books the work on the pair."""

    def __init__(
        self,
        config: ConductorConfig,
        policies: dict[str, Policy],
        fleet: Fleet,
        prefixes: PrefixIndex,
        registry: CollectorRegistry,
    ):
        self.config = config
        self.policies = policies  # by registry name (make_policies)
        self._fleet = fleet
        self._prefixes = prefixes
        # Choosing and booking are one step (see route); the random policy's generator is not
        # thread-safe either.
        self._lock = threading.Lock()
        self._assumed_links = AssumedLinks(registry, config.transfer_mb_per_ms)
        self._probes = Counter(
            "halfmoon_admitted_unpredicted",
            "Requests admitted although no pair was predicted to meet their objectives: probe "
            "(predicted on an idle worker, whose model only served requests correct) or "
            "best_effort (admission: best_effort)",
            ["how"],
            registry=registry,
        )
        self._placed = Counter(
            "halfmoon_prefill_placement",
            "Routed prompts by where they are prefilled: on a prefill worker, or on their decode "
            "worker (conditional disaggregation: local_prefill_tokens)",
            ["where"],
            registry=registry,
        )

    def settle(self) -> None:
        """Return once every routing decision begun before this call has booked its work: a
        worker marked draining before it gets nothing routed after it returns."""
        with self._lock:
            pass

    def route(
        self,
        ids: list[int],
        keys: list[bytes],
        policy_name: str,
        max_tokens: int,
        *,
        ttft_slo_ms: float = 0.0,
        tbt_slo_ms: float = 0.0,
        tpot_slo_ms: float = 0.0,
        rid: str = "",
        resumed: bool = False,
    ) -> Routed:
        """A pair for prompt `ids` (its block `keys`) generating up to `max_tokens`, judged by
        the request's SLOs (0 = the configured default); raises policy.Rejected when none can
        serve it, and MissesObjectives when none meets them unless admission is best_effort
        (then the pair chosen without objectives, `best_effort` set)."""
        # A request resumed after its decode worker was lost has had its first token: its TTFT
        # is history, and refusing it now would break a stream the client is reading. It goes
        # to the best pair left, judged by no SLO (none left is still an error).
        info = RequestInfo(
            num_tokens=len(ids),
            max_tokens=max_tokens,
            ttft_slo_ms=0.0 if resumed else ttft_slo_ms or self.config.ttft_slo_ms,
            tbt_slo_ms=0.0 if resumed else tbt_slo_ms or self.config.tbt_slo_ms,
            resumed=resumed,
            tpot_slo_ms=0.0 if resumed else tpot_slo_ms or self.config.tpot_slo_ms,
        )
        self._fleet.loads_wanted.set()  # routed or refused, the next request sees fresh loads
        # Choosing and booking the work on the pair is one step: a burst of requests each sees
        # the ones routed before it.
        with self._lock:
            state = cluster_state(self._fleet, self._prefixes.matches(keys), self.config)
            d, how = admit(self.policies[policy_name], info, state, self.config.admission)
            best_effort = how == BEST_EFFORT
            if how != ADMITTED:
                self._probes.labels(how).inc()
                log.info("request %s admitted (%s): no pair is predicted to meet its objectives",
                         rid, how)  # fmt: skip
            self._assumed_links.note(d)
            self._placed.labels("decode" if d.prefill_on_decode else "prefill").inc()
            log.debug("request %s: prefill on %s, decode on %s, predicted TTFT %.0f ms", rid,
                      d.decode if d.prefill_on_decode else d.prefill, d.decode,
                      d.predicted_ttft_ms)  # fmt: skip
            block_size = self.config.block_size
            prefill, decode = self._fleet.book(
                rid,
                d.prefill,
                d.decode,
                PrefillBooking(
                    sent_at=time.perf_counter(),
                    compute_ms=d.predicted_prefill_ms,
                    tokens=info.num_tokens - d.reuse_blocks * block_size,
                ),
                # Not sent until the prefill answers: counted as unseen until then (sent at once
                # where the decode worker prefills it, its compute held until it says done).
                DecodeBooking(
                    sent_at=time.perf_counter() if d.prefill_on_decode else math.inf,
                    prompt_tokens=info.num_tokens,
                    max_tokens=info.max_tokens,
                    blocks=blocks_needed(info.num_tokens, info.max_tokens, block_size),
                    local_ms=d.predicted_prefill_ms if d.prefill_on_decode else 0.0,
                ),
            )
        return Routed(
            decision_policy=policy_name,
            prefill=prefill,
            decode=decode,
            fetch_from=d.fetch_from,
            fetch_blocks=d.fetch_blocks,
            use_cache=d.use_cache,
            predicted_ttft_ms=d.predicted_ttft_ms,
            predicted_prefill_ms=d.predicted_prefill_ms,
            ttft_slo_ms=info.ttft_slo_ms,
            predicted_tbt_ms=d.predicted_tbt_ms,
            predicted_tpot_ms=d.predicted_tpot_ms,
            decode_tbt_scale=decode.tbt_scale,
            local_ratio=decode.local.ratio if d.prefill_on_decode else 1.0,
            prefill_ratio=prefill.correction.ratio if prefill is not None else 1.0,
            decode_ratio=decode.correction.ratio,
            predicted_admission_ms=d.predicted_admission_ms,
            prefill_epoch=prefill.correction.epoch if prefill is not None else 0,
            decode_epoch=decode.correction.epoch,
            best_effort=best_effort,
            prefill_on_decode=d.prefill_on_decode,
            reuse_keys=tuple(keys[: d.reuse_blocks]) if d.prefill_on_decode else (),
        )
