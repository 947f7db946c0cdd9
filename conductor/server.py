"""The conductor: validate, tokenize, look up the prefix, route with a policy, relay the answer."""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import grpc
import psutil
from prometheus_client import Counter, Histogram

from conductor.config import ConductorConfig
from conductor.detok import IncrementalText
from conductor.links import AssumedLinks
from conductor.policy import (
    POLICIES,
    ClusterState,
    DecodeCandidate,
    Link,
    Policy,
    PrefillCandidate,
    Rejected,
    RequestInfo,
    make_policy,
    tbt_of_times,
)
from conductor.stream import RequestStream, cached_tokens
from kvstore import Index, StoreControl, block_keys
from model import kv_fingerprint, load_model_info
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from servekit import (
    GrpcServer,
    SecurityConfig,
    Tokens,
    blocks_needed,
    caller_of,
    is_kivi,
    kv_cache_layout_id,
    memory_usage,
    open_channel,
    prompt_ids_problem,
    release_freed_heap,
    sampling_problem,
    shown,
    tenant_salt,
)

log = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant", "tool")
# A request routed this long before a load report was asked for may not have reached the worker
# when it answered: it counts as routed after the report.
_SKEW_S = 0.005
_MAX_MESSAGE = 256 << 20  # a prefill reply carries the tail block inline
# the deadline of the calls an administrative request makes when its caller set none
ADMIN_TIMEOUT_S = 30.0


class _Invalid(Exception):
    """A bad request field: INVALID_ARGUMENT with this message."""


class _Cancelled(Exception):
    """The client went away: the request ends with no final message."""


class _Correction:
    """measured / predicted, averaged (EWMA) over the worker's recent requests: what its fitted
    model misses (the RPCs and hand-offs around a forward, a neighbour's load on shared cores).
    The conductor scales the worker's model by it before the policy sees it."""

    ALPHA = 0.3  # weight of the newest request
    BOUNDS = (0.2, 5.0)  # one odd request cannot swing it further
    MIN_SAMPLES = 4  # applied once this many requests agree (a cold start's first is no evidence)

    MODEL_CHANGE = 0.25  # a refit moving the model's prediction this much starts it afresh

    def __init__(self) -> None:
        self._mean = 1.0  # EWMA of measured / raw predicted
        self.samples = 0
        self._reference_ms = 0.0  # the worker's model at a reference point, when last observed
        # Bumped when the model moved past MODEL_CHANGE: estimates made before are no evidence.
        self.epoch = 0
        self.stale = 0  # measurements dropped because their estimate was made against an old model

    def follow_model(self, reference_ms: float) -> None:
        """The worker reported its model's prediction at a fixed reference point. Ratios learned
        against an earlier model (its start-up prior, say) say nothing of a refit one: when the
        prediction moved by more than MODEL_CHANGE, forget them."""
        if reference_ms <= 0:
            return
        old = self._reference_ms
        self._reference_ms = reference_ms
        if old > 0 and abs(reference_ms - old) > self.MODEL_CHANGE * old:
            self._mean, self.samples = 1.0, 0
            self.epoch += 1

    @property
    def ratio(self) -> float:
        return self._mean if self.samples >= self.MIN_SAMPLES else 1.0

    def observe(self, measured_ms: float, predicted_ms: float, applied: float, epoch: int) -> None:
        """`predicted_ms` was made with `applied` as the ratio against the model of `epoch`; the
        raw model said predicted/applied. A request routed before a refit (a burst judged by the
        start-up calibration, finishing after the model learned the serving steps) measures the
        old model, not this one: it is dropped, or the ratio would scale the new model by the old
        one's error."""
        if predicted_ms <= 0 or measured_ms <= 0 or applied <= 0:
            return
        if epoch != self.epoch:
            self.stale += 1
            return
        sample = measured_ms / (predicted_ms / applied)
        sample = min(max(sample, self.BOUNDS[0]), self.BOUNDS[1])
        a = max(self.ALPHA, 1.0 / (self.samples + 1))  # a plain mean until it has history
        self._mean = (1 - a) * self._mean + a * sample
        self.samples += 1


def _model_reference_ms(kind: str, load: pb.WorkerLoad) -> float:
    """A worker's fitted model at one fixed point (prefill: 512 new tokens on no context; decode:
    a step of 8 sequences over 8,192 tokens), to notice when a refit changes it."""
    coef = tuple(load.prefill_coef if kind == "prefill" else load.decode_coef)
    if len(coef) < 3:
        return 0.0
    if kind == "prefill":
        return coef[0] + coef[1] * 512
    return coef[0] + coef[1] * 8 + coef[2] * 8192


class _Worker:
    """What the conductor knows of one worker: its last load report and whether it answers."""

    def __init__(self, address: str, kind: str, security: SecurityConfig | None = None):
        self.address = address
        self.kind = kind
        self.channel = open_channel(  # TLS and the cluster token when configured
            address,
            security,
            [
                ("grpc.max_send_message_length", _MAX_MESSAGE),
                ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ],
        )
        stub = pb_grpc.PrefillWorkerStub if kind == "prefill" else pb_grpc.DecodeWorkerStub
        self.stub = stub(self.channel)
        self.load: pb.WorkerLoad | None = None
        self.healthy = False
        # Work routed here and not yet done, by request id: prefill (sent at, predicted compute
        # ms, prompt tokens); decode (sent at, prompt tokens, tokens to generate, blocks needed).
        # What was routed after the last load report's request is work that report cannot hold.
        self.inflight: dict[str, tuple] = {}
        self.report_at = 0.0  # perf_counter when the last answered Load was asked for
        self.correction = _Correction()
        # decode: what pulling one prompt block took lately (smoothed; 0 = none measured yet)
        self.pull_ms_per_block = 0.0
        self.warned_fingerprint = ""  # the foreign fingerprint already logged for this worker

    @property
    def worker_id(self) -> str:
        return self.load.worker_id if self.load is not None else self.address

    def observe_pull(self, ms: float, blocks: int) -> None:
        """A decode worker's KV pull of `blocks` prompt blocks took `ms`: it delays admission,
        so the next TTFT estimates hold it."""
        if blocks <= 0 or ms <= 0:
            return
        sample = ms / blocks
        a = _Correction.ALPHA if self.pull_ms_per_block > 0 else 1.0
        self.pull_ms_per_block = (1 - a) * self.pull_ms_per_block + a * sample


class _Retry(Exception):
    """A worker went away mid-request: route again (it is out of routing until it answers a
    Load)."""

    def __init__(self, what: str, worker: _Worker, error: grpc.RpcError | None):
        super().__init__(what)
        self.what, self.worker, self.error = what, worker, error


class Routed(NamedTuple):
    decision_policy: str  # the policy's registry name
    prefill: _Worker  # the chosen prefill worker
    decode: _Worker  # the chosen decode worker
    fetch_from: str  # remote store node to pull the prefix from ("" = own tiers only)
    fetch_blocks: int  # the prompt's leading blocks to take from there
    use_cache: bool  # False: compute everything (cache_off)
    predicted_ttft_ms: float  # the policy's TTFT estimate
    predicted_prefill_ms: float  # the compute this request adds to the prefill worker's queue
    ttft_slo_ms: float = 0.0  # the request's TTFT objective (0 = none): the prefill's budget
    predicted_tbt_ms: float = 0.0  # the policy's TBT estimate
    prefill_ratio: float = 1.0  # the corrections the estimates were made with
    decode_ratio: float = 1.0
    # the part of predicted_ttft_ms after the prefill's answer (decode admission, KV pull)
    predicted_admission_ms: float = 0.0
    prefill_epoch: int = 0  # the workers' model epochs the estimates were made against
    decode_epoch: int = 0


class Conductor(GrpcServer, pb_grpc.ConductorServicer):
    """gRPC `Conductor`: Generate (server-streaming), Status and ClearCache."""

    # what an API token may call; ClearCache wipes every tenant's cache: the cluster token only
    client_methods = frozenset({"/halfmoon.Conductor/Generate", "/halfmoon.Conductor/Status"})
    data_methods = frozenset({"/halfmoon.Conductor/Generate"})  # a stream holds a thread

    def __init__(self, config: ConductorConfig, lm=None):
        GrpcServer.__init__(
            self, config.host, config.port, config.metrics_port, config.grpc_workers
        )
        self.config = config
        # Only the tokenizer and the architecture: the conductor never touches tensors, and its
        # process never imports torch. A test may hand over a LoadedModel it already holds.
        if lm is None:
            lm = load_model_info(config.model)
            # building the tokenizer from the checkpoint's vocabulary frees ~40 MiB that glibc
            # would otherwise keep for the process's life
            release_freed_heap()
        self.tokenizer = lm.tokenizer
        self.model_config = lm.config
        self.model_name = lm.name
        # Block keys chain from the weights and the layout the workers store blocks in (KV cache
        # type, dtype and shape), so the fingerprint is the weights id and that layout.
        layout_id = kv_cache_layout_id(lm.config, config, config.dtype)
        self.fingerprint = kv_fingerprint(lm.weights_id, layout_id)
        self.policies: dict[str, Policy] = {
            "mooncake": make_policy(
                "mooncake",
                kvcache_balancing_threshold=config.kvcache_balancing_threshold,
                transfer_mb_per_ms=config.transfer_mb_per_ms,
            ),
            "load_balance": make_policy("load_balance"),
            "random": make_policy("random", seed=config.random_seed),
            "cache_off": make_policy("cache_off"),
        }
        if config.policy not in self.policies:
            raise ValueError(
                f"ConductorConfig.policy: unknown policy {config.policy!r} "
                f"(known: {', '.join(sorted(POLICIES))})"
            )
        self._workers = [_Worker(a, "prefill", config.security) for a in config.prefill_workers] + [
            _Worker(a, "decode", config.security) for a in config.decode_workers
        ]
        self._index = (
            Index(config.index_url, timeout_s=config.index_timeout_s) if config.index_url else None
        )
        self._tokens = Tokens(config.security)  # API tokens -> tenants, for the cache salt
        self._index_down = False  # the last index lookup failed (logged once per outage)
        self._index_retry_at = 0.0  # while down, lookups skip the index until then
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._policy_lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._quit = threading.Event()
        self._loads_wanted = threading.Event()  # a request is being routed or finished (_poll)
        self.totals = {"requests": 0, "rejected": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self._init_metrics()
        self._assumed_links = AssumedLinks(self.registry, config.transfer_mb_per_ms)

    # ---- metrics ----

    def _init_metrics(self) -> None:
        r = self.registry
        self.m_requests = Counter(
            "halfmoon_requests", "Generate requests by finish reason", ["reason"], registry=r
        )
        self.m_rejected = Counter("halfmoon_rejections", "Requests refused", ["reason"], registry=r)
        self.m_ttft = Histogram(
            "halfmoon_ttft_seconds",
            "Time to first token (at the conductor)",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.m_tbt = Histogram(
            "halfmoon_tbt_seconds",
            "Time between tokens (at the conductor)",
            registry=r,
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
        )
        self.m_prompt = Counter("halfmoon_prompt_tokens", "Prompt tokens", registry=r)
        self.m_cached = Counter(
            "halfmoon_cached_tokens",
            "Prompt tokens served from a cache, by tier",
            ["tier"],
            registry=r,
        )
        self.m_generated = Counter("halfmoon_generated_tokens", "Tokens generated", registry=r)
        self.m_mismatch = Counter(
            "halfmoon_worker_mismatch",
            "Load reports refused: the worker serves another model fingerprint",
            ["worker"],
            registry=r,
        )
        self.m_errors = Counter(
            "halfmoon_conductor_errors",
            "Failures the conductor worked around (index_lookup, index_skipped, store_status, "
            "worker_load, worker_memory, prefill_lost, decode_lost)",
            ["what"],
            registry=r,
        )

    # ---- lifecycle ----

    def _add_services(self, server: grpc.Server) -> list[str]:
        pb_grpc.add_ConductorServicer_to_server(self, server)
        return ["halfmoon.Conductor"]

    def _on_start(self) -> None:
        self.refresh_loads()
        self._poller = threading.Thread(target=self._poll, name="conductor-loads", daemon=True)
        self._poller.start()

    def _on_stop(self) -> None:
        self._quit.set()
        self._loads_wanted.set()  # the poller stops waiting
        if self._poller is not None:
            self._poller.join(timeout=5)
        for w in self._workers:
            w.channel.close()
        if self._index is not None:
            self._index.close()

    def _poll(self) -> None:
        """Refresh the workers' loads as soon as a request is being routed or finishes, and then
        at most every load_poll_s while that goes on; every load_idle_poll_s when nothing is
        routed (health, metrics). Why not every load_poll_s throughout: each refresh wakes a
        thread in every worker, and where a worker's OpenMP threads fill the host's cores that
        thread stalls the forward's barriers. A cold 1,024-token prefill's round took 693-742 ms
        with a refresh every 50 ms and 671-704 ms polled as here, on a 2-core EPYC; between what
        is routed, a refresh would only see forwards in progress, which the routed work already
        books."""
        while not self._quit.is_set():
            self._loads_wanted.wait(self.config.load_idle_poll_s)
            self._loads_wanted.clear()
            if self._quit.is_set():
                break
            self.refresh_loads()
            self._quit.wait(self.config.load_poll_s)

    def refresh_loads(self) -> None:
        """Ask every worker for its load (in parallel); one that does not answer is out of
        routing."""
        timeout = self.config.load_timeout_s
        asked = time.perf_counter()
        futures = [
            (w, w.stub.Load.future(pb.LoadRequest(), timeout=timeout)) for w in self._workers
        ]
        for w, f in futures:
            try:
                load = f.result()
            except grpc.RpcError as exc:
                self.m_errors.labels("worker_load").inc()
                if w.healthy:
                    log.warning("%s worker %s stopped answering: %s", w.kind, w.worker_id, exc)
                w.healthy = False
                continue
            if load.model_fingerprint and load.model_fingerprint != self.fingerprint:
                # A worker serving other weights (or another KV dtype or layout) would produce
                # other answers and other block keys.
                self._mismatch(w, load)
                w.healthy = False
                continue
            with self._lock:
                w.load, w.healthy = load, True
                w.correction.follow_model(_model_reference_ms(w.kind, load))
                # Work routed before the report was asked for is in it (queued at the worker).
                w.report_at = asked

    def _mismatch(self, w: _Worker, load: pb.WorkerLoad) -> None:
        """Count every refused report; log once per worker (again if its fingerprint changes)."""
        self.m_mismatch.labels(load.worker_id or w.address).inc()
        if w.warned_fingerprint != load.model_fingerprint:
            w.warned_fingerprint = load.model_fingerprint
            log.warning(
                "%s worker %s at %s serves model fingerprint %s, the conductor %s: "
                "kept out of routing (same model, dtype and block size?)",
                w.kind,
                load.worker_id,
                w.address,
                load.model_fingerprint,
                self.fingerprint,
            )

    # ---- Generate ----

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        """Route, prefill, decode; when the decode worker is lost, resume on another pair from
        the tokens already sent."""
        s = self._open(request, context)
        try:
            while not s.reason:
                prompt = s.prompt()
                s.routed = self._route_stream(context, request, s, prompt)
                try:
                    reply = self._prefill_leg(context, s, prompt)
                    yield from self._decode_leg(context, s, prompt, reply)
                except _Retry as r:
                    self._worker_lost(context, s, r)
        except _Cancelled:
            self.m_requests.labels("cancelled").inc()
            return
        finally:
            self._forget(s.rid)
        yield self._finish(s)

    def _forget(self, rid: str) -> None:
        """The request's work booked on workers is done (or will never come)."""
        self._loads_wanted.set()
        with self._lock:
            for w in self._workers:
                w.inflight.pop(rid, None)

    def _open(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> RequestStream:
        """The request's stream state, or INVALID_ARGUMENT naming the bad field."""
        arrived = time.perf_counter()
        try:
            ids, policy_name = self._prepare(request)
        except _Invalid as exc:
            self.m_rejected.labels("invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        sp = request.sampling
        return RequestStream(
            rid=request.request_id or uuid.uuid4().hex[:16],
            ids=ids,
            policy=policy_name,
            sampling=sp,
            salt=self._salt(request, context),
            text=IncrementalText(self.tokenizer.decode, sp.stop),
            arrived=arrived,
        )

    def _salt(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> str:
        """The request's cache salt. With API tokens configured, a client's salt is its tenant's,
        derived here, with the salt it asked for scoped under it: one tenant never reaches
        another's blocks (so cached-token counts never cross tenants). Internal callers (the
        cluster token, e.g. a front end that authenticates its own users) and open clusters keep
        the salt they send."""
        security = self.config.security
        if not security.api_tokens:
            return request.cache_salt
        caller = caller_of(context, self._tokens)
        if caller.internal:
            return request.cache_salt
        return tenant_salt(security, caller.tenant, request.cache_salt)

    def _route_stream(
        self, context, request: pb.GenerateRequest, s: RequestStream, prompt: list[int]
    ) -> Routed:
        """A pair for `prompt`; RESOURCE_EXHAUSTED when none meets the SLOs (UNAVAILABLE when a
        resumed request finds none left)."""
        keys = block_keys(prompt, self.config.block_size, self.fingerprint, s.salt)
        try:
            routed = self._route(
                request, prompt, keys, s.policy, s.tokens_left(), s.rid, resumed=bool(s.out)
            )
        except Rejected as exc:
            if s.out:
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"decode worker lost and no pair left to resume on: {exc}",
                )
            self._reject(context, "slo", str(exc))
        if s.routed is None:  # admitted: counted once, however often it is routed again
            with self._lock:
                self.totals["requests"] += 1
        return routed

    def _prefill_leg(self, context, s: RequestStream, prompt: list[int]) -> pb.PrefillReply:
        """The prefill reply; _Cancelled when the client went away, _Retry when the worker is
        gone; any other verdict of the worker ends the request."""
        routed = s.routed
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
            timeout = self._remaining(context, self.config.prefill_timeout_s)
            fut = routed.prefill.stub.Prefill.future(preq, timeout=timeout)
            context.add_callback(fut.cancel)
            try:
                reply = fut.result()
                if s.first is None:
                    s.answered_ms = s.elapsed_ms()
                with self._lock:
                    # the prefill's own estimate: the first token is held for the decode
                    # admission after this, which the prefill worker's correction leaves out
                    routed.prefill.correction.observe(
                        s.elapsed_ms(),
                        routed.predicted_ttft_ms - routed.predicted_admission_ms,
                        routed.prefill_ratio,
                        routed.prefill_epoch,
                    )
                return reply
            except grpc.FutureCancelledError:
                raise _Cancelled() from None
            except grpc.RpcError as exc:
                if not context.is_active():
                    raise _Cancelled() from None
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise _Retry("prefill", routed.prefill, exc) from None
                if s.first is None and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    who = f"prefill worker {routed.prefill.worker_id}"
                    self._reject(context, "prefill_full", f"{who}: {exc.details()}", routed=True)
                self._downstream_failed(context, "prefill", routed.prefill, exc)
        finally:
            with self._lock:
                routed.prefill.inflight.pop(s.rid, None)

    def _decode_leg(
        self, context, s: RequestStream, prompt: list[int], reply: pb.PrefillReply
    ) -> Iterator[pb.GenerateResponse]:
        """Relays the decode worker's tokens until the answer ends (s.reason set); _Cancelled
        when the client went away, _Retry when the stream broke off before its end.

        A new request's first token (the prefill's) goes to the client only once the decode
        worker has admitted the sequence (its first message): a wait for pool room is part of
        TTFT, and no stream stalls after its first token. A refusal before that (the worker's
        queue is full) is an early rejection."""
        worker = s.routed.decode
        dreq = pb.DecodeRequest(
            request_id=s.rid,
            prompt_ids=prompt,
            first_token=s.out[-1] if s.out else reply.first_token,
            handle=reply.handle,
            sampling=s.decode_sampling(),
            cache_salt=s.salt,
        )
        with self._lock:  # from now on a load report the worker gives may hold it
            if s.rid in worker.inflight:
                worker.inflight[s.rid] = (time.perf_counter(),) + worker.inflight[s.rid][1:]
        timeout = self._remaining(context, self.config.decode_timeout_s)
        call = worker.stub.Decode(dreq, timeout=timeout)
        context.add_callback(call.cancel)
        try:
            for msg in call:
                if s.first is None:  # admitted (or ended by its first token): it starts now
                    first = s.start(reply)
                    self.m_ttft.observe(s.ttft_ms / 1000.0)
                    yield first
                if msg.token_ids:
                    out, gaps = s.add(msg)
                    for gap in gaps:
                        self.m_tbt.observe(gap / 1000.0)
                    yield out
                    if s.text.stopped:  # a stop string: the worker need not go on
                        call.cancel()
                        s.reason = "stop"
                        break
                if msg.finished:
                    s.reason = msg.finish_reason
                    s.decode_transfer_ms += msg.transfer_ms
                    with self._lock:
                        worker.observe_pull(
                            msg.transfer_ms, -(-len(prompt) // self.config.block_size)
                        )
                    if len(s.times) > 1:
                        with self._lock:
                            worker.correction.observe(
                                tbt_of_times(s.times),
                                s.routed.predicted_tbt_ms,
                                s.routed.decode_ratio,
                                s.routed.decode_epoch,
                            )
                    break
        except grpc.RpcError as exc:
            if not context.is_active():
                raise _Cancelled() from None
            if s.first is None and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                who = f"decode worker {worker.worker_id}"
                self._reject(context, "decode_full", f"{who}: {exc.details()}", routed=True)
            if not s.reason:
                raise _Retry("decode", worker, exc) from None
        finally:
            with self._lock:
                worker.inflight.pop(s.rid, None)
        if not s.reason:  # the stream ended without its final message: the worker went away
            raise _Retry("decode", worker, None)

    def _worker_lost(self, context, s: RequestStream, r: _Retry) -> None:
        """Out of routing until it answers a Load; the request goes on elsewhere unless every
        worker has failed it or the client is gone."""
        s.failures += 1
        self.m_errors.labels(f"{r.what}_lost").inc()
        if r.worker is not None:
            r.worker.healthy = False
        if s.failures > len(self._workers) or not context.is_active():
            self._downstream_failed(context, r.what, r.worker, r.error)
        log.warning(
            "request %s: %s worker %s lost (%s); routing again after %d token(s)",
            s.rid,
            r.what,
            r.worker.worker_id if r.worker is not None else "?",
            r.error.details() if r.error is not None else "stream ended early",
            len(s.out),
        )

    def _finish(self, s: RequestStream) -> pb.GenerateResponse:
        """The final message: the rest of the text and the usage; the totals count it."""
        rest = s.text.finish()
        usage = s.usage()
        r = s.first
        with self._lock:
            self.totals["prompt_tokens"] += len(s.ids)
            self.totals["cached_tokens"] += cached_tokens(r)
        self.m_prompt.inc(len(s.ids))
        tiers = (
            ("device", r.cached_device_tokens),
            ("dram", r.cached_dram_tokens),
            ("ssd", r.cached_ssd_tokens),
            ("remote", r.cached_remote_tokens),
        )
        for tier, n in tiers:
            if n:
                self.m_cached.labels(tier).inc(n)
        self.m_requests.labels(s.reason).inc()
        self.m_generated.inc(len(s.out))
        return pb.GenerateResponse(
            request_id=s.rid, text=rest, finished=True, finish_reason=s.reason, usage=usage
        )

    @staticmethod
    def _remaining(context: grpc.ServicerContext, cap: float) -> float:
        """A downstream deadline: ours (the client's) or `cap`, whichever comes first."""
        left = context.time_remaining()
        return cap if left is None else max(0.001, min(cap, left))

    def _reject(self, context, reason: str, message: str, routed: bool = False) -> None:
        """Refuse the request before its first token: RESOURCE_EXHAUSTED with `message`, counted
        as a rejection by `reason` (and, once `routed`, no longer as an admitted request)."""
        with self._lock:
            self.totals["rejected"] += 1
            if routed:
                self.totals["requests"] -= 1
        self.m_rejected.labels(reason).inc()
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    def _downstream_failed(self, context, what: str, worker: _Worker, exc: grpc.RpcError | None):
        """End the request with the worker's own verdict (INVALID_ARGUMENT, RESOURCE_EXHAUSTED...),
        naming who said it."""
        code = exc.code() if exc is not None else grpc.StatusCode.UNAVAILABLE
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            worker.healthy = False
        self.m_requests.labels("error").inc()
        if code == grpc.StatusCode.CANCELLED:
            code = grpc.StatusCode.UNAVAILABLE
        details = exc.details() if exc is not None else "stream ended early"
        context.abort(code, f"{what} worker {worker.worker_id}: {details}")

    # ---- validation and routing ----

    def _prepare(self, r: pb.GenerateRequest) -> tuple[list[int], str]:
        """Token ids of the prompt and the policy name, or _Invalid naming the field."""
        c = self.model_config
        if r.model and r.model not in (self.model_name, self.config.model):
            raise _Invalid(
                f"model: unknown model {shown(r.model)} (this cluster serves {self.model_name!r})"
            )
        policy = r.policy or self.config.policy
        if policy not in self.policies:
            raise _Invalid(
                f"policy: unknown policy {shown(policy)} "
                f"(known: {', '.join(sorted(self.policies))})"
            )
        problem = sampling_problem(r.sampling, self.config.max_tokens_limit)
        if problem:
            raise _Invalid(problem)
        if r.ttft_slo_ms < 0 or r.tbt_slo_ms < 0:
            raise _Invalid("ttft_slo_ms/tbt_slo_ms: must be >= 0 (0 = the conductor's default)")
        kind = r.WhichOneof("prompt")
        if kind is None:
            raise _Invalid("prompt: one of text, token_ids or chat is required")
        if kind == "text":
            if not r.text:
                raise _Invalid("prompt.text: empty prompt")
            ids = self.tokenizer.encode(r.text)
        elif kind == "token_ids":
            ids = list(r.token_ids.ids)
        else:
            msgs = r.chat.messages
            if not msgs:
                raise _Invalid("prompt.chat: no messages")
            for i, m in enumerate(msgs):
                if m.role not in _ROLES:
                    raise _Invalid(
                        f"prompt.chat.messages[{i}].role: {shown(m.role)} is not one of "
                        f"{', '.join(_ROLES)}"
                    )
            chat = [{"role": m.role, "content": m.content} for m in msgs]
            ids = self.tokenizer.apply_chat_template(chat)
        # Empty (after tokenization), outside the vocabulary, or no room in the context window.
        problem = prompt_ids_problem(f"prompt.{kind}", ids, c.vocab_size, c.max_position_embeddings)
        if problem:
            raise _Invalid(problem)
        return list(ids), policy

    def _matches(self, keys: list[bytes]) -> dict[str, int]:
        """The index's answer: node id -> leading blocks of these keys it holds. An unreachable
        index means routing without cache knowledge, logged once per outage and counted."""
        if self._index is None or not keys:
            return {}
        if self._index_down and time.monotonic() < self._index_retry_at:
            # a down (or hung) Redis costs one timeout per index_retry_s, not one per request
            self.m_errors.labels("index_skipped").inc()
            return {}
        try:
            found = self._index.longest_prefix(keys)
            matches = {
                node: int(f[0] if isinstance(f, tuple) else f.num_blocks)
                for node, f in found.items()
            }
        except Exception as exc:  # noqa: BLE001 - any index failure: route blind, say so
            self.m_errors.labels("index_lookup").inc()
            if not self._index_down:
                log.warning("index lookup failed, routing without cache hits: %r", exc)
            self._index_down = True
            self._index_retry_at = time.monotonic() + self.config.index_retry_s
            return {}
        if self._index_down:
            log.info("index lookups answer again")
            self._index_down = False
        return matches

    @staticmethod
    def _prefill_queue(w: _Worker, ld: pb.WorkerLoad, now: float) -> tuple[float, int]:
        """(predicted wait, prompt tokens ahead) of a new request on prefill worker `w`: what its
        last report held (queued and computing), less the time it has worked off since, plus
        what was routed to it after that report was asked for."""
        unseen = [v for v in w.inflight.values() if v[0] >= w.report_at - _SKEW_S]
        left = max(0.0, ld.predicted_queue_ms - (now - w.report_at) * 1000.0)
        tokens = ld.queued_tokens + ld.running_tokens + sum(v[2] for v in unseen)
        return left + sum(v[1] for v in unseen), tokens

    def _state(self, keys: list[bytes]) -> ClusterState:
        matches = self._matches(keys)
        prefill, decode = [], []
        device_nodes: set[str] = set()
        block_bytes = 0
        now = time.perf_counter()
        with self._lock:
            for w in self._workers:
                ld = w.load
                if ld is None:
                    continue
                if w.kind == "prefill":
                    block_bytes = max(block_bytes, ld.block_bytes)
                    nodes = tuple(ld.nodes)
                    if ld.device_node:
                        # Its own pool: counts toward its own match, never a fetch source.
                        device_nodes.add(ld.device_node)
                        if ld.device_node not in nodes:
                            nodes += (ld.device_node,)
                    queue_ms, queued_tokens = self._prefill_queue(w, ld, now)
                    r = w.correction.ratio
                    prefill.append(
                        PrefillCandidate(
                            ld.worker_id,
                            nodes,
                            queue_ms * r,
                            tuple(c * r for c in ld.prefill_coef),
                            w.healthy,
                            ld.fetch_block_bytes,
                            queued_tokens,
                            tuple(Link(x.node, x.fixed_ms, x.bytes_per_ms) for x in ld.links),
                        )
                    )
                else:
                    # Routed here and not in the report: admitted after what it reports waiting.
                    unseen = [v[1:] for v in w.inflight.values() if v[0] >= w.report_at - _SKEW_S]
                    waiting = tuple(
                        zip(ld.waiting_positions, ld.waiting_remaining, ld.waiting_blocks)
                    )
                    decode.append(
                        DecodeCandidate(
                            ld.worker_id,
                            ld.running + ld.waiting + len(unseen),
                            ld.free_blocks,
                            ld.total_blocks,
                            ld.total_context_tokens,
                            tuple(c * w.correction.ratio for c in ld.decode_coef),
                            w.healthy,
                            tuple(zip(ld.seq_positions, ld.seq_remaining, ld.seq_blocks)),
                            waiting + tuple(unseen),
                            ld.max_batch,
                            w.pull_ms_per_block,
                        )
                    )
        return ClusterState(
            prefill,
            decode,
            matches,
            self.config.block_size,
            block_bytes,
            frozenset(device_nodes),
            self.config.kivi_residual if is_kivi(self.config.kv_cache_dtype) else 0,
        )

    def _route(
        self,
        r: pb.GenerateRequest,
        ids: list[int],
        keys: list[bytes],
        policy_name: str,
        max_tokens: int,
        rid: str = "",
        resumed: bool = False,
    ) -> Routed:
        # A request resumed after its decode worker was lost has had its first token: its TTFT
        # is history, and refusing it now would break a stream the client is reading. It goes
        # to the best pair left, judged by no SLO (none left is still an error).
        info = RequestInfo(
            len(ids),
            max_tokens,
            0.0 if resumed else r.ttft_slo_ms or self.config.ttft_slo_ms,
            0.0 if resumed else r.tbt_slo_ms or self.config.tbt_slo_ms,
        )
        self._loads_wanted.set()  # routed or refused, the next request sees fresh loads
        # Choosing and booking the work on the pair is one step: a burst of requests each sees
        # the ones routed before it.
        with self._policy_lock:  # the random policy's generator is not thread-safe either
            state = self._state(keys)
            d = self.policies[policy_name].choose(info, state)
            self._assumed_links.note(d)
            with self._lock:
                by_id = {w.worker_id: w for w in self._workers}
                for w in self._workers:  # routed again after a failure: the old booking goes
                    w.inflight.pop(rid, None)
                need = blocks_needed(info.num_tokens, info.max_tokens, self.config.block_size)
                by_id[d.prefill].inflight[rid] = (
                    time.perf_counter(),
                    d.predicted_prefill_ms,
                    info.num_tokens - d.reuse_blocks * self.config.block_size,
                )
                # Not sent until the prefill answers: counted as unseen until then.
                by_id[d.decode].inflight[rid] = (math.inf, info.num_tokens, info.max_tokens, need)
        return Routed(
            policy_name,
            by_id[d.prefill],
            by_id[d.decode],
            d.fetch_from,
            d.fetch_blocks,
            d.use_cache,
            d.predicted_ttft_ms,
            d.predicted_prefill_ms,
            info.ttft_slo_ms,
            d.predicted_tbt_ms,
            by_id[d.prefill].correction.ratio,
            by_id[d.decode].correction.ratio,
            d.predicted_admission_ms,
            by_id[d.prefill].correction.epoch,
            by_id[d.decode].correction.epoch,
        )

    # ---- Status ----

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        reply = pb.StatusReply(
            model=self.model_name,
            block_size=self.config.block_size,
            default_policy=self.config.policy,
            vocab_size=self.model_config.vocab_size,
            conductor_rss_bytes=self._process.memory_info().rss,
            conductor_memory=self._own_memory(),
            model_fingerprint=self.fingerprint,
            kv_dtype=self.config.dtype
            if self.config.kv_cache_dtype == "auto"
            else self.config.kv_cache_dtype,
        )
        with self._lock:
            for w in self._workers:
                ws = reply.workers.add(
                    worker_id=w.worker_id, kind=w.kind, address=w.address, healthy=w.healthy
                )
                if w.load is not None:
                    ws.load.CopyFrom(w.load)
            # refused at the door when every Generate slot was taken: rejections too
            rejected = self.totals["rejected"] + self.call_limit.refused
            reply.requests_total = self.totals["requests"] + rejected
            reply.requests_rejected = rejected
            reply.prompt_tokens_total = self.totals["prompt_tokens"]
            reply.cached_tokens_total = self.totals["cached_tokens"]
            workers = list(zip(self._workers, reply.workers))
        self._worker_memory(workers)
        for address in self.config.store_addresses:
            reply.stores.append(self._store_status(address))
        return reply

    def _own_memory(self) -> pb.MemoryReport:
        """The conductor's memory; it is configured to hold nothing (no weights, no KV)."""
        m = memory_usage()
        return pb.MemoryReport(rss_bytes=m.rss, uss_bytes=m.uss, pss_bytes=m.pss)

    def _worker_memory(self, workers: list) -> None:
        """Each worker's memory report (a Load that reads /proc), asked of all at once; a worker
        that does not answer shows none (logged, counted)."""
        timeout = self.config.load_timeout_s
        asked = [
            (w, ws, w.stub.Load.future(pb.LoadRequest(memory=True), timeout=timeout))
            for w, ws in workers
        ]
        for w, ws, fut in asked:
            try:
                ws.load.memory.CopyFrom(fut.result().memory)
            except grpc.RpcError as exc:
                self.m_errors.labels("worker_memory").inc()
                log.warning("worker %s did not report its memory: %s", w.worker_id, exc.code())

    def ClearCache(
        self, request: pb.ClearCacheRequest, context: grpc.ServicerContext
    ) -> pb.ClearCacheReply:
        reply = pb.ClearCacheReply()
        for address in self.config.store_addresses:
            try:
                with self._store(address, self._admin_timeout(context)) as store:
                    reply.store_blocks += store.clear()
            except Exception as exc:  # noqa: BLE001 - a half-cleared cluster must say so
                context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"store {address} could not be cleared: {exc}"
                )
        for w in [w for w in self._workers if w.kind == "prefill"]:
            try:
                cleared = w.stub.ClearCache(
                    pb.ClearCacheRequest(), timeout=self._admin_timeout(context)
                )
            except grpc.RpcError as exc:
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"prefill worker {w.worker_id} could not be cleared: {exc.details()}",
                )
            reply.device_blocks += cleared.device_blocks
        return reply

    def _store(self, address: str, timeout_s: float | None = None) -> StoreControl:
        """A control connection to one store node (TLS and the cluster token as configured);
        its calls' deadline `timeout_s`, else a load poll's."""
        return StoreControl(
            address,
            timeout_s=timeout_s or self.config.load_timeout_s,
            security=self.config.security,
        )

    def _admin_timeout(self, context: grpc.ServicerContext) -> float:
        """The deadline for the calls an administrative request makes (ClearCache): what is left
        of the caller's own, not a load poll's. A store's Clear waits up to 2 s for its index to
        hear of it, so with the load poll's 2 s the call raced its own deadline (the demo's replay
        failed on a loaded machine)."""
        left = context.time_remaining()
        return max(left, 0.01) if left is not None else ADMIN_TIMEOUT_S

    def _store_status(self, address: str) -> pb.StoreStatus:
        """One store node's tiers and bulk port; an unreachable store shows up with none (logged,
        counted)."""
        st = pb.StoreStatus(address=address)
        try:
            with self._store(address) as store:
                stats = store.stats()
                st.bulk_port = store.bulk_port()
        except Exception as exc:  # noqa: BLE001 - any failure: report the store empty, say why
            self.m_errors.labels("store_status").inc()
            log.warning("store %s did not answer a stats request: %r", address, exc)
            return st
        st.node_id = getattr(stats, "node_id", "")
        for t in getattr(stats, "tiers", []):
            st.tiers.add(
                tier=t.tier,
                used_bytes=t.used_bytes,
                capacity_bytes=t.capacity_bytes,
                blocks=t.blocks,
                hits=t.hits,
                misses=getattr(t, "misses", 0),
                evictions=t.evictions,
            )
        if getattr(stats, "memory", None):
            m = st.memory
            m.rss_bytes, m.uss_bytes, m.pss_bytes, m.configured_bytes = stats.memory
        return st
