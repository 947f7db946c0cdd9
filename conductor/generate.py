"""One Generate request from arrival to its final message: prepared, routed, relayed over its
pair's two legs, resumed on another pair when a worker is lost, and counted when it ends."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import grpc

from conductor.config import ConductorConfig
from conductor.detok import IncrementalText
from conductor.fleet import Fleet
from conductor.metrics import ConductorMetrics, Totals
from conductor.policy_types import MissesObjectives, Rejected
from conductor.prepare import Invalid, Preparer
from conductor.recent import RecentRequests
from conductor.relay import Cancelled, Relay, Retry, abort, downstream_failed, reject
from conductor.routing import Routed, Router
from conductor.stream import RequestStream
from kvstore import block_keys
from protos import halfmoon_pb2 as pb

log = logging.getLogger(__name__)


class RequestFlow:
    """Runs Generate calls: each on one pair, and on the next when a worker is lost under it."""

    def __init__(
        self,
        config: ConductorConfig,
        fingerprint: str,
        *,
        preparer: Preparer,
        router: Router,
        relay: Relay,
        fleet: Fleet,
        metrics: ConductorMetrics,
        totals: Totals,
        recent: RecentRequests,
    ):
        self.config = config
        self._fingerprint = fingerprint  # the model part of every block key
        self._preparer = preparer
        self._router = router
        self._relay = relay
        self._fleet = fleet
        self._metrics = metrics
        self._totals = totals
        self._recent = recent  # every admitted or refused request, as a trace

    def run(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        """Route, prefill, decode; when the decode worker is lost, resume on another pair from
        the tokens already sent."""
        s = self._open(request, context)
        try:
            while not s.reason:
                prompt = s.prompt()
                s.routed = routed = self._route(context, s, prompt)
                try:
                    reply = (
                        None
                        if routed.prefill_on_decode  # the decode worker prefills it itself
                        else self._relay.prefill(context, s, routed, prompt)
                    )
                    yield from self._relay.decode(context, s, routed, prompt, reply)
                except Retry as r:
                    self._worker_lost(context, s, r)
        except Cancelled:
            self._metrics.requests.labels("cancelled").inc()
            self._recent.add(s.arrived, len(s.ids), len(s.out), s.keys)
            return
        finally:
            self._fleet.forget(s.rid)
        yield self._finish(s)

    def _open(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> RequestStream:
        """The request's stream state, or INVALID_ARGUMENT naming the bad field."""
        arrived = time.perf_counter()
        try:
            ids, policy_name = self._preparer.prompt(request)
        except Invalid as exc:
            self._metrics.rejected.labels("invalid").inc()
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        sp = request.sampling
        return RequestStream(
            rid=request.request_id or uuid.uuid4().hex[:16],
            ids=ids,
            policy=policy_name,
            sampling=sp,
            salt=self._preparer.salt(request, context),
            text=IncrementalText(self._preparer.tokenizer.decode, sp.stop),
            arrived=arrived,
            ttft_slo_ms=request.ttft_slo_ms or self.config.ttft_slo_ms,
            tbt_slo_ms=request.tbt_slo_ms or self.config.tbt_slo_ms,
            tpot_slo_ms=request.tpot_slo_ms or self.config.tpot_slo_ms,
        )

    def _route(
        self,
        context: grpc.ServicerContext,
        s: RequestStream,
        prompt: list[int],
    ) -> Routed:
        """A pair for `prompt`; RESOURCE_EXHAUSTED when none meets the SLOs (UNAVAILABLE when a
        resumed request finds none left)."""
        keys = block_keys(prompt, self.config.block_size, self._fingerprint, s.salt)
        try:
            routed = self._router.route(
                prompt,
                keys,
                s.policy,
                s.tokens_left(),
                ttft_slo_ms=s.ttft_slo_ms,  # the request's own, else the defaults
                tbt_slo_ms=s.tbt_slo_ms,
                tpot_slo_ms=s.tpot_slo_ms,
                rid=s.rid,
                resumed=bool(s.out),
            )
        except Rejected as exc:
            if s.routed is None:  # refused at admission: offered load all the same
                self._recent.add(s.arrived, len(s.ids), s.tokens_left(), keys, refused=True)
            if s.out:
                abort(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"decode worker lost and no pair left to resume on: {exc}",
                )
            retry_after_s = exc.retry_after_s if isinstance(exc, MissesObjectives) else 0
            reject(context, self._metrics, self._totals, "slo", str(exc),
                   retry_after_s=retry_after_s,
                   logged=f" (request {s.rid}: {len(prompt)} prompt tokens)")  # fmt: skip
        if s.routed is None:  # admitted: counted once, however often it is routed again
            s.best_effort = routed.best_effort
            s.keys = keys
            with self._totals.lock:
                self._totals.requests += 1
        return routed

    def _worker_lost(self, context: grpc.ServicerContext, s: RequestStream, r: Retry) -> None:
        """Out of routing until it answers a Load; the request goes on elsewhere unless every
        worker has failed it or the client is gone."""
        s.failures += 1
        self._metrics.errors.labels(f"{r.what}_lost").inc()
        r.worker.healthy = False
        if s.failures > len(self._fleet.workers) or not context.is_active():
            downstream_failed(context, self._metrics, r.what, r.worker, r.error)
        log.warning(
            "request %s: %s worker %s lost (%s); routing again after %d token(s)",
            s.rid,
            r.what,
            r.worker.worker_id,
            r.error.details() if r.error is not None else "stream ended early",
            len(s.out),
        )

    def _finish(self, s: RequestStream) -> pb.GenerateResponse:
        """The final message: the rest of the text and the usage; the totals count it."""
        rest = s.text.finish()
        usage = s.usage()  # the first prefill's cache hits among it
        met = s.met_slos()
        self._recent.add(s.arrived, len(s.ids), len(s.out), s.keys, ttft_ms=usage.ttft_ms,
                         predicted_ttft_ms=usage.predicted_ttft_ms)  # fmt: skip
        with self._totals.lock:
            self._totals.prompt_tokens += len(s.ids)
            self._totals.cached_tokens += usage.cached_tokens
            self._totals.slo_met += met
            self._totals.slo_missed += not met
            self._totals.best_effort += s.best_effort
        outcome = "best_effort" if s.best_effort else "met" if met else "missed"
        self._metrics.slo.labels(outcome).inc()
        self._metrics.prompt.inc(len(s.ids))
        tiers = (
            ("device", usage.cached_device_tokens),
            ("dram", usage.cached_dram_tokens),
            ("ssd", usage.cached_ssd_tokens),
            ("remote", usage.cached_remote_tokens),
        )
        for tier, n in tiers:
            if n:
                self._metrics.cached.labels(tier).inc(n)
        self._metrics.requests.labels(s.reason).inc()
        self._metrics.generated.inc(len(s.out))
        return pb.GenerateResponse(
            request_id=s.rid, text=rest, finished=True, finish_reason=s.reason, usage=usage
        )
