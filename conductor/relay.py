"""The two legs of a request on its routed pair: the Prefill call, then the Decode stream whose
tokens are relayed to the client; and the verdicts that end a request (a rejection, a worker's
error) or send it elsewhere (a lost worker)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import NoReturn

import grpc

from conductor.config import ConductorConfig
from conductor.estimates import paced_slo_ms, tbt_of_gaps, tbt_of_times, tpot_of_times
from conductor.fleet import AnyWorker, Fleet
from conductor.metrics import ConductorMetrics, Totals
from conductor.routing import Routed
from conductor.stream import RequestStream
from protos import halfmoon_pb2 as pb
from servekit import RETRY_AFTER_KEY

log = logging.getLogger(__name__)

class Cancelled(Exception):
    """The client went away: the request ends with no final message."""


class Retry(Exception):
    """A worker went away mid-request: route again (it is out of routing until it answers a
    Load)."""

    def __init__(self, what: str, worker: AnyWorker, error: grpc.RpcError | None):
        super().__init__(what)
        self.what = what  # which leg: "prefill" | "decode"
        self.worker = worker  # the worker lost
        self.error = error  # its call's error (None: the stream ended without its final message)


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with `code`; grpc's abort raises (its signature does not say so)."""
    context.abort(code, message)
    raise AssertionError("ServicerContext.abort returned")


def reject(
    context: grpc.ServicerContext,
    metrics: ConductorMetrics,
    totals: Totals,
    reason: str,
    message: str,
    routed: bool = False,
    retry_after_s: int = 0,
    logged: str = "",
) -> NoReturn:
    """Refuse the request before its first token: RESOURCE_EXHAUSTED with `message` (and a
    `retry-after` trailer in seconds, when given: the HTTP API's Retry-After), counted as a
    rejection by `reason` (and, once `routed`, no longer as an admitted request). `logged` is
    said in the log only (which request it was)."""
    with totals.lock:
        totals.rejected += 1
        if routed:
            totals.requests -= 1
    metrics.rejected.labels(reason).inc()
    metrics.slo.labels("rejected").inc()
    log.info("request refused (%s): %s%s", reason, message, logged)
    if retry_after_s > 0:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(retry_after_s)),))
    abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def downstream_failed(
    context: grpc.ServicerContext,
    metrics: ConductorMetrics,
    what: str,
    worker: AnyWorker,
    exc: grpc.RpcError | None,
) -> NoReturn:
    """End the request with the worker's own verdict (INVALID_ARGUMENT, RESOURCE_EXHAUSTED...),
    naming who said it."""
    code = exc.code() if exc is not None else grpc.StatusCode.UNAVAILABLE
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        worker.healthy = False
    metrics.requests.labels("error").inc()
    if code == grpc.StatusCode.CANCELLED:
        code = grpc.StatusCode.UNAVAILABLE
    details = exc.details() if exc is not None else "stream ended early"
    abort(context, code, f"{what} worker {worker.worker_id}: {details}")


def remaining(context: grpc.ServicerContext, cap: float) -> float:
    """A downstream deadline: ours (the client's) or `cap`, whichever comes first."""
    left = context.time_remaining()
    return cap if left is None else max(0.001, min(cap, left))


def decode_request(
    s: RequestStream, routed: Routed, prompt: list[int], reply: pb.PrefillReply | None
) -> pb.DecodeRequest:
    """The Decode call of the routed pair: after the prefill's `reply` (its handle, its first
    token, or the last one sent when resumed), or with none the decode worker prefilling the
    prompt itself (prefill_here), loading the leading blocks its host's store holds."""
    dreq = pb.DecodeRequest(
        request_id=s.rid,
        prompt_ids=prompt,
        sampling=s.decode_sampling(),
        cache_salt=s.salt,
        # paced by its TBT objective, or by its TPOT one where that is stricter or alone
        tbt_slo_ms=paced_slo_ms(s.tbt_slo_ms, s.tpot_slo_ms),
    )
    if reply is None:
        dreq.prefill_here = True
        dreq.handle.block_keys.extend(routed.reuse_keys)
        dreq.handle.num_tokens = len(prompt)
    else:
        dreq.first_token = s.out[-1] if s.out else reply.first_token
        dreq.handle.CopyFrom(reply.handle)
    return dreq


class Relay:
    """Runs one request's legs on the pair it was routed to."""

    def __init__(
        self, config: ConductorConfig, fleet: Fleet, metrics: ConductorMetrics, totals: Totals
    ):
        self.config = config
        self._fleet = fleet
        self._metrics = metrics
        self._totals = totals

    def prefill(
        self, context: grpc.ServicerContext, s: RequestStream, routed: Routed, prompt: list[int]
    ) -> pb.PrefillReply:
        """The prefill reply; Cancelled when the client went away, Retry when the worker is
        gone; any other verdict of the worker ends the request."""
        worker = routed.prefill
        if worker is None:
            raise ValueError(f"request {s.rid} is prefilled on its decode worker, not by a prefill")
        preq = pb.PrefillRequest(
            request_id=s.rid,
            token_ids=prompt,
            sampling=s.sampling,
            cache_salt=s.salt,
            fetch_from=routed.fetch_from,
            fetch_blocks=routed.fetch_blocks,
            no_cache=not routed.use_cache,
            # what is left of the TTFT budget: the prefill streams CacheGen chunks within it
            deadline_ms=max(1.0, routed.ttft_slo_ms - s.elapsed_ms())
            if routed.ttft_slo_ms > 0
            else 0.0,
        )
        try:
            timeout = remaining(context, self.config.prefill_timeout_s)
            fut = worker.stub.Prefill.future(preq, timeout=timeout)
            context.add_callback(fut.cancel)
            try:
                reply = fut.result()
                if s.first is None:
                    s.answered_ms = s.elapsed_ms()
                with self._fleet.lock:
                    # the prefill's own estimate: the first token is held for the decode
                    # admission after this, which the prefill worker's correction leaves out
                    worker.correction.observe(
                        s.elapsed_ms(),
                        routed.predicted_ttft_ms - routed.predicted_admission_ms,
                        routed.prefill_ratio,
                        routed.prefill_epoch,
                    )
                return reply
            except grpc.FutureCancelledError:
                raise Cancelled() from None
            except grpc.RpcError as exc:
                if not context.is_active():
                    raise Cancelled() from None
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise Retry("prefill", worker, exc) from None
                if s.first is None and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    who = f"prefill worker {worker.worker_id}"
                    self._reject(context, "prefill_full", f"{who}: {exc.details()}")
                downstream_failed(context, self._metrics, "prefill", worker, exc)
        finally:
            self._fleet.unbook(worker, s.rid)

    def decode(
        self,
        context: grpc.ServicerContext,
        s: RequestStream,
        routed: Routed,
        prompt: list[int],
        reply: pb.PrefillReply | None,
    ) -> Iterator[pb.GenerateResponse]:
        """Relays the decode worker's tokens until the answer ends (s.reason set); Cancelled
        when the client went away, Retry when the stream broke off before its end.

        A new request's first token (the prefill's) goes to the client only once the decode
        worker has admitted the sequence (its first message): a wait for pool room is part of
        TTFT, and no stream stalls after its first token. A refusal before that (the worker's
        queue is full) is an early rejection. With no `reply` the decode worker prefills the
        prompt itself, and its admitted message carries what a prefill worker would answer."""
        worker = routed.decode
        dreq = decode_request(s, routed, prompt, reply)
        self._fleet.decode_sent(worker, s.rid)
        timeout = remaining(context, self.config.decode_timeout_s)
        call = worker.stub.Decode(dreq, timeout=timeout)
        context.add_callback(call.cancel)
        try:
            for msg in call:
                if reply is None and msg.HasField("prefilled"):
                    reply = msg.prefilled  # prefilled there: the first token comes with it
                    s.answered_ms = s.elapsed_ms()
                    self._fleet.prefilled_on_decode(worker, s.rid)
                    with self._fleet.lock:  # the estimate it was routed by, against the measure
                        worker.local.observe(s.answered_ms, routed.predicted_ttft_ms,
                                             routed.local_ratio, worker.local.epoch)  # fmt: skip
                if s.first is None:  # admitted (or ended by its first token): it starts now
                    if reply is None:
                        raise Retry("decode", worker, None)  # a stream that broke the protocol
                    first = s.start(reply)
                    self._metrics.ttft.observe(s.ttft_ms / 1000.0)
                    yield first
                if msg.token_ids:
                    out, gaps = s.add(msg)
                    for gap in gaps:
                        self._metrics.tbt.observe(gap / 1000.0)
                    yield out
                    if s.text.stopped:  # a stop string: the worker need not go on
                        call.cancel()
                        s.reason = "stop"
                        break
                if msg.finished:
                    s.reason = msg.finish_reason
                    s.decode_transfer_ms += msg.transfer_ms
                    self._observe_decode(s, routed, msg.transfer_ms, len(prompt))
                    break
        except grpc.RpcError as exc:
            if not context.is_active():
                raise Cancelled() from None
            if s.first is None and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                who = f"decode worker {worker.worker_id}"
                self._reject(context, "decode_full", f"{who}: {exc.details()}")
            if not s.reason:
                raise Retry("decode", worker, exc) from None
        finally:
            self._fleet.unbook(worker, s.rid)
        if not s.reason:  # the stream ended without its final message: the worker went away
            raise Retry("decode", worker, None)

    def _observe_decode(
        self, s: RequestStream, routed: Routed, transfer_ms: float, prompt_tokens: int
    ) -> None:
        """The finished stream's measurements: its KV pull time and, past one token, its TBT
        against the estimate it was routed by."""
        worker = routed.decode
        if not routed.prefill_on_decode:  # there its fill time was a prefill's, not a pull's
            with self._fleet.lock:
                worker.observe_pull(transfer_ms, -(-prompt_tokens // self.config.block_size))
        if len(s.times) > 1:
            # its steps' own compute where the worker says it: the gaps also hold the slack its
            # streams gave a prefill on the same CPUs (by design, within their objective), and
            # learning that as the model's error refused streams the worker could serve
            wall = tpot_of_times(s.times)
            steps = s.step_ms
            mean = sum(steps) / len(steps) if steps else wall
            tail = tbt_of_gaps(steps) if steps else tbt_of_times(s.times)
            ratio, epoch = routed.decode_ratio, routed.decode_epoch
            with self._fleet.lock:
                # the model of a step against the mean step
                worker.correction.observe(mean, routed.predicted_tpot_ms, ratio, epoch)
                # the slowest 10% against the TBT estimate (made with the tail factor too)
                worker.tail.observe(
                    tail, routed.predicted_tbt_ms, ratio * routed.decode_tbt_scale, epoch
                )
                # and the wall clock's mean gap, for the admission waits behind its steps
                worker.pace.observe(wall, routed.predicted_tpot_ms, ratio, epoch)

    def _reject(self, context: grpc.ServicerContext, reason: str, message: str) -> NoReturn:
        """A worker refused the routed request before its first token (its queue is full)."""
        reject(context, self._metrics, self._totals, reason, message, routed=True)
