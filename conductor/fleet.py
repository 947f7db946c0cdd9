"""The workers the conductor routes to: a record per worker (its channel, last load report,
health, model correction and the work booked on it), the Load polling that refreshes them, and
the refusal of a worker that serves another model."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import grpc

from conductor.config import ConductorConfig
from conductor.corrections import Correction, model_reference_ms
from conductor.metrics import ConductorMetrics
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from servekit import SecurityConfig, open_channel

log = logging.getLogger(__name__)

# A request routed this long before a load report was asked for may not have reached the worker
# when it answered: it counts as routed after the report.
SKEW_S = 0.005
_MAX_MESSAGE = 256 << 20  # a prefill reply carries the tail block inline


@dataclass(frozen=True)
class PrefillBooking:
    """A request routed to a prefill worker and not answered yet."""

    sent_at: float  # perf_counter when it was routed (its Prefill call follows at once)
    compute_ms: float  # the compute the policy predicted it adds to the worker's queue
    tokens: int  # prompt tokens it computes: those its reused prefix does not cover


@dataclass(frozen=True)
class DecodeBooking:
    """A request routed to a decode worker and not finished yet."""

    sent_at: float  # perf_counter when its Decode call went out; inf until the prefill answers
    prompt_tokens: int  # its prompt's tokens (the KV the worker pulls)
    max_tokens: int  # new tokens it may generate there
    blocks: int  # pool blocks its whole answer needs
    # a prefill on the decode worker itself: its predicted compute, until the worker says it is
    # done (the stream's admitted message); 0 = prefilled elsewhere, or done
    local_ms: float = 0.0

    def as_waiting(self) -> tuple[int, int, int]:
        """The policy's view of it: a sequence admitted before a new one (DecodeCandidate)."""
        return (self.prompt_tokens, self.max_tokens, self.blocks)


BookingT = TypeVar("BookingT", PrefillBooking, DecodeBooking)


class Worker(Generic[BookingT]):
    """What the conductor knows of one worker: its last load report and whether it answers."""

    kind: ClassVar[str]  # "prefill" | "decode"
    stub: pb_grpc.PrefillWorkerStub | pb_grpc.DecodeWorkerStub

    def __init__(self, address: str, security: SecurityConfig | None = None):
        self.address = address
        self.channel = open_channel(  # TLS and the cluster token when configured
            address,
            security,
            [
                ("grpc.max_send_message_length", _MAX_MESSAGE),
                ("grpc.max_receive_message_length", _MAX_MESSAGE),
                # a worker back after a restart or a role switch is found within seconds
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self.load: pb.WorkerLoad | None = None
        self.healthy = False
        # Work routed here and not yet done, by request id. What was routed after the last load
        # report's request is work that report cannot hold.
        self.inflight: dict[str, BookingT] = {}
        self.report_at = 0.0  # perf_counter when the last answered Load was asked for
        self.correction = Correction()
        self.warned_fingerprint = ""  # the foreign fingerprint already logged for this worker
        # Routed nothing new: the runtime planner drains it before a role switch (role_switch.py),
        # or it has switched and has not answered as its new role yet
        self.draining = False

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    @property
    def worker_id(self) -> str:
        return self.load.worker_id if self.load is not None else self.address

    def routed_coef(self) -> tuple[float, ...]:
        """Its role's fitted model from its last load report, scaled by the conductor's
        correction of it: what routing judges by (() before any report)."""
        if self.load is None:
            return ()
        coef = self.load.prefill_coef if self.kind == "prefill" else self.load.decode_coef
        r = self.correction.ratio
        return tuple(c * r for c in coef)

    def unseen(self) -> list[BookingT]:
        """The work booked here that its last load report cannot hold (routed after it was
        asked for)."""
        return [b for b in self.inflight.values() if b.sent_at >= self.report_at - SKEW_S]


class PrefillWorker(Worker[PrefillBooking]):
    kind = "prefill"
    stub: pb_grpc.PrefillWorkerStub

    def __init__(self, address: str, security: SecurityConfig | None = None):
        super().__init__(address, security)
        self.stub = pb_grpc.PrefillWorkerStub(self.channel)


class DecodeWorker(Worker[DecodeBooking]):
    kind = "decode"
    stub: pb_grpc.DecodeWorkerStub

    def __init__(self, address: str, security: SecurityConfig | None = None):
        super().__init__(address, security)
        self.stub = pb_grpc.DecodeWorkerStub(self.channel)
        # what pulling one prompt block took lately (smoothed; 0 = none measured yet)
        self.pull_ms_per_block = 0.0
        # `correction` learns its streams' mean step compute over the model's (what TPOT, the
        # admission waits and a prefill's CPU share are made of). Beside it, over the same
        # model and told of the same refits (so all three share their epochs):
        # - `pace`: their mean wall-clock gap, the slack given to a prefill on the same CPUs
        #   included: admission waits last whole wall-clock steps;
        # - `tail`: the slowest 10% of their step compute, which Mooncake's TBT judges and a
        #   model of the mean leaves out (scaling every step by it over-predicted TPOT 1.6x).
        self.pace = Correction()
        self.tail = Correction()
        # Prompts it prefilled itself: their measured TTFT over the policy's estimate, which is
        # made of a prefill worker's model and the share its batch leaves (the DecodeRequest,
        # its chunks' turns and the first token's way back are not in it: the estimates of a
        # demo replay's were half the measure). Its own epochs: the model is another worker's.
        self.local = Correction()

    def _over_mean(self, other: Correction) -> float:
        """`other`'s ratio over the mean correction's (>= 1), once both hold."""
        compute = self.correction
        if other.samples < Correction.MIN_SAMPLES or compute.samples < Correction.MIN_SAMPLES:
            return 1.0
        return max(1.0, other.ratio / compute.ratio)

    @property
    def wait_scale(self) -> float:
        """A step's wall-clock time over its compute, as its recent streams measured them."""
        return self._over_mean(self.pace)

    @property
    def tbt_scale(self) -> float:
        """Its streams' slowest 10% of steps over the mean model's (DecodeCandidate)."""
        return self._over_mean(self.tail)

    def observe_pull(self, ms: float, blocks: int) -> None:
        """A KV pull of `blocks` prompt blocks took `ms`: it delays admission, so the next TTFT
        estimates hold it."""
        if blocks <= 0 or ms <= 0:
            return
        sample = ms / blocks
        a = Correction.ALPHA if self.pull_ms_per_block > 0 else 1.0
        self.pull_ms_per_block = (1 - a) * self.pull_ms_per_block + a * sample


AnyWorker = PrefillWorker | DecodeWorker


class Fleet:
    """Every worker of the configuration, their loads and bookings (under `lock`)."""

    def __init__(self, config: ConductorConfig, fingerprint: str, metrics: ConductorMetrics):
        self.config = config
        self.fingerprint = fingerprint  # what a worker must serve to be routed to
        self.prefill = [PrefillWorker(a, config.security) for a in config.prefill_workers]
        self.decode = [DecodeWorker(a, config.security) for a in config.decode_workers]
        self.workers: list[AnyWorker] = [*self.prefill, *self.decode]
        self.lock = threading.Lock()  # the workers' loads, report times, bookings, corrections
        self.loads_wanted = threading.Event()  # a request is being routed or finished (LoadPoller)
        self._retired: list[grpc.Channel] = []  # channels of workers that changed role
        self._metrics = metrics

    def refresh_loads(self) -> None:
        """Ask every worker for its load (in parallel); one that does not answer is out of
        routing."""
        timeout = self.config.load_timeout_s
        asked = time.perf_counter()
        futures = [(w, w.stub.Load.future(pb.LoadRequest(), timeout=timeout)) for w in self.workers]
        for w, f in futures:
            try:
                load = f.result()
            except grpc.RpcError as exc:
                self._metrics.errors.labels("worker_load").inc()
                if w.healthy and not w.draining:  # a switching worker's pause is expected
                    log.warning("%s worker %s stopped answering: %s", w.kind, w.worker_id, exc)
                w.healthy = False
                continue
            if load.model_fingerprint and load.model_fingerprint != self.fingerprint:
                # A worker serving other weights (or another KV dtype or layout) would produce
                # other answers and other block keys.
                self._mismatch(w, load)
                w.healthy = False
                continue
            with self.lock:
                w.load, w.healthy = load, True
                reference = model_reference_ms(w.kind, load)
                w.correction.follow_model(reference)
                if isinstance(w, DecodeWorker):
                    w.pace.follow_model(reference)
                    w.tail.follow_model(reference)
                # Work routed before the report was asked for is in it (queued at the worker).
                w.report_at = asked

    def _mismatch(self, w: AnyWorker, load: pb.WorkerLoad) -> None:
        """Count every refused report; log once per worker (again if its fingerprint changes)."""
        self._metrics.mismatch.labels(load.worker_id or w.address).inc()
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

    def book(
        self,
        rid: str,
        prefill_id: str,
        decode_id: str,
        prefill: PrefillBooking,
        decode: DecodeBooking,
    ) -> tuple[PrefillWorker | None, DecodeWorker]:
        """Book `rid`'s work on the chosen pair (any older booking of it goes: it is routed again
        after a failure); the pair's workers (no prefill worker where `prefill_id` is "": the
        decode worker prefills it)."""
        with self.lock:
            for w in self.workers:
                w.inflight.pop(rid, None)
            p = {w.worker_id: w for w in self.prefill}[prefill_id] if prefill_id else None
            d = {w.worker_id: w for w in self.decode}[decode_id]
            if p is not None:
                p.inflight[rid] = prefill
            d.inflight[rid] = decode
        return p, d

    def prefilled_on_decode(self, worker: DecodeWorker, rid: str) -> None:
        """The decode worker has prefilled `rid` itself: its booking no longer holds compute."""
        with self.lock:
            booking = worker.inflight.get(rid)
            if booking is not None:
                worker.inflight[rid] = dataclasses.replace(booking, local_ms=0.0)

    def decode_sent(self, worker: DecodeWorker, rid: str) -> None:
        """`rid`'s Decode call goes out now: from now on a load report the worker gives may hold
        it."""
        with self.lock:
            booking = worker.inflight.get(rid)
            if booking is not None:
                worker.inflight[rid] = dataclasses.replace(booking, sent_at=time.perf_counter())

    def unbook(self, worker: AnyWorker, rid: str) -> None:
        """`rid`'s work on `worker` is done (or will never come)."""
        with self.lock:
            worker.inflight.pop(rid, None)

    def forget(self, rid: str) -> None:
        """The request's work booked on workers is done (or will never come)."""
        self.loads_wanted.set()
        with self.lock:
            for w in self.workers:
                w.inflight.pop(rid, None)

    def models(self) -> list[pb.WorkerModel]:
        """Each answering worker's time model as routing judges by it now: its fitted model
        scaled by the conductor's correction of it (where one is applied)."""
        out = []
        with self.lock:
            for w in self.workers:
                load, coef = w.load, w.routed_coef()
                if not w.healthy or load is None or len(coef) != 3:  # none fitted yet
                    continue
                out.append(
                    pb.WorkerModel(
                        worker_id=w.worker_id,
                        kind=w.kind,
                        coef=coef,
                        correction=w.correction.ratio,
                        block_bytes=load.block_bytes,
                        total_blocks=load.total_blocks,
                        max_batch=load.max_batch if w.kind == "decode" else 0,
                    )
                )
        return out

    def find(self, worker_id: str) -> AnyWorker | None:
        with self.lock:
            return next((w for w in self.workers if w.worker_id == worker_id), None)

    def replace(self, old: AnyWorker, new: AnyWorker) -> None:
        """`new` (the same worker in its other role: same address, another stub) takes `old`'s
        place; the lists are replaced, not changed, so a reader holding one sees either."""
        with self.lock:
            self.prefill = [w for w in self.prefill if w is not old]
            self.decode = [w for w in self.decode if w is not old]
            if isinstance(new, PrefillWorker):
                self.prefill = [*self.prefill, new]
            else:
                self.decode = [*self.decode, new]
            self.workers = [*self.prefill, *self.decode]
            # closed with the fleet: a Load round that took `old` before the swap still calls it
            self._retired.append(old.channel)

    def close(self) -> None:
        for ch in [*(w.channel for w in self.workers), *self._retired]:
            ch.close()


class LoadPoller:
    """The thread that keeps the fleet's loads fresh while requests are routed."""

    def __init__(self, fleet: Fleet, refresh: Callable[[], None]):
        self._fleet = fleet
        self._refresh = refresh  # one round of Load calls (Conductor.refresh_loads)
        self._quit = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="conductor-loads", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._quit.set()
        self._fleet.loads_wanted.set()  # the poller stops waiting
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        """Refresh the workers' loads as soon as a request is being routed or finishes, and then
        at most every load_poll_s while that goes on; every load_idle_poll_s when nothing is
        routed (health, metrics). Why not every load_poll_s throughout: each refresh wakes a
        thread in every worker, and where a worker's OpenMP threads fill the host's cores that
        thread stalls the forward's barriers. A cold 1,024-token prefill's round took 693-742 ms
        with a refresh every 50 ms and 671-704 ms polled as here, on a 2-core EPYC; between what
        is routed, a refresh would only see forwards in progress, which the routed work already
        books."""
        wanted = self._fleet.loads_wanted
        while not self._quit.is_set():
            wanted.wait(self._fleet.config.load_idle_poll_s)
            wanted.clear()
            if self._quit.is_set():
                break
            self._refresh()
            self._quit.wait(self._fleet.config.load_poll_s)
