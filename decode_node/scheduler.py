"""The decode scheduler: admission (a sequence waits until the pool holds its whole answer),
background KV pulls, the continuous-batching step loop, and each stream's end."""

from __future__ import annotations

import collections
import logging
import threading
import time

from decode_node.config import DecodeConfig
from decode_node.metrics import DecodeMetrics
from decode_node.runner import DecodeRunner
from decode_node.seq import Seq
from kernels import ReleasingThreadPool
from protos import halfmoon_pb2 as pb
from servekit import IDLE_TRIM_S, DecodeTimeModel, decode_slack_ms, release_freed_heap

log = logging.getLogger(__name__)


class DecodeScheduler:
    """waiting -> pulling (KV arrives on io threads) -> running (one step for all) -> ended."""

    def __init__(self, config: DecodeConfig, runner: DecodeRunner, metrics: DecodeMetrics):
        self.config, self.runner, self.metrics = config, runner, metrics
        self.timing = DecodeTimeModel()
        self._wake = threading.Condition()
        self._waiting: collections.deque[Seq] = collections.deque()
        self._pulling: list[Seq] = []
        self._running: list[Seq] = []
        # KV pulls and publishes copy with torch ops: their threads free their OpenMP workers
        self._io = ReleasingThreadPool(
            max_workers=config.pull_threads, thread_name_prefix=f"{config.worker_id}-io"
        )
        self._thread: threading.Thread | None = None
        self._quit = False
        self._heap_dirty = True  # steps (or the calibration) ran since the heap was last trimmed
        self.max_batch_seen = 0
        self.requests_done = 0
        self.calibration_failures = 0  # start-up calibrations that failed (the prior stood)
        # what it last offered a prefill on its CPUs (ms it may keep them); -1 = it binds nobody
        self.offered_slack_ms = -1.0
        # how often the idle loop looks again while a pull or an admission is pending: a
        # safety net, as a done pull pokes the loop itself
        self.busy_poll_s = 0.05

    # ---- intake and reports ----

    def submit(self, seq: Seq) -> bool:
        """Queue a sequence for admission; False when the admission queue is full."""
        with self._wake:
            if len(self._waiting) >= self.config.max_waiting:
                return False
            self._waiting.append(seq)
            # Its pull starts now, not after the step running now: the step thread admits only
            # between steps, and a burst of arrivals waited up to two steps (~100 ms) for it.
            self._admit()
            self._wake.notify_all()
        return True

    def counts(self) -> tuple[int, int, int]:
        """(running + pulling, waiting, KV tokens the running and pulling sequences hold)."""
        with self._wake:
            running = list(self._running) + list(self._pulling)
            waiting = len(self._waiting)
        return len(running), waiting, sum(s.position for s in running)

    def admission_figures(self) -> dict[str, list[int] | int]:
        """WorkerLoad's per-sequence fields: each running (or pulling) sequence's position,
        tokens left and blocks held, and each waiting one's prompt, tokens and blocks needed."""
        with self._wake:
            running = list(self._running) + list(self._pulling)
            waiting = list(self._waiting)
        return {
            "seq_positions": [s.position for s in running],
            "seq_remaining": [max(0, s.budget - len(s.out)) for s in running],
            "seq_blocks": [s.need_blocks for s in running],
            "waiting_positions": [len(s.prompt) for s in waiting],
            "waiting_remaining": [s.budget for s in waiting],
            "waiting_blocks": [s.need_blocks for s in waiting],
            "max_batch": self.config.max_batch,
        }

    def poke(self) -> None:
        with self._wake:
            self._wake.notify_all()

    # ---- the loop ----

    def start(self) -> None:
        self.calibrate()
        self._thread = threading.Thread(
            target=self._loop, daemon=True, name=f"{self.config.worker_id}-step"
        )
        self._thread.start()

    def calibrate(self) -> None:
        """Seed the step-time model with timed steps over scratch sequences of a few batch sizes
        and lengths, before the port opens: a cold cluster's first TBT estimates are measured,
        not the prior."""
        r, cfg = self.runner, self.config
        t0 = time.perf_counter()
        seqs: list[Seq] = []
        try:
            for batch, length in (
                (1, 64),
                (2, 256),
                (4, 128),
                (8, 512),
                (16, 256),
                (cfg.max_batch, 64),
            ):
                batch = min(batch, cfg.max_batch)
                need = r.blocks_to_reserve(length + 1)
                if need * batch > r.pool.num_blocks // 2:
                    continue
                request = pb.DecodeRequest(prompt_ids=[10] * length, first_token=10)
                seqs = [Seq(request, 1, need) for _ in range(batch)]
                for s in seqs:
                    if not r.admit(s):
                        raise RuntimeError("pool short of blocks for a scratch batch")
                    r.as_if_filled(s)
                r.step(seqs)  # warm-up (lazy kernels, allocations): not timed
                for _ in range(2):
                    c0 = time.perf_counter()
                    r.step(seqs)
                    # the step, not its wait for a turn: beside a prefill worker calibrating
                    # on the same cores, waits made the fit [144, 0, 0] (a flat 144 ms step)
                    ms = (time.perf_counter() - c0) * 1000.0 - r.turn_wait_ms
                    self.timing.seed(ms, batch, sum(s.position for s in seqs))
                for s in seqs:
                    r.release(s)
                seqs = []
        except Exception as exc:  # noqa: BLE001 - serving goes on with the prior
            for s in seqs:
                r.release(s)
            self.calibration_failures += 1
            log.warning(
                "%s: step-time calibration failed (%s); the prior stands until steps are measured",
                cfg.worker_id,
                exc,
            )
            return
        log.info(
            "%s: decode time model calibrated in %.1f s: %s",
            cfg.worker_id,
            time.perf_counter() - t0,
            [round(c, 5) for c in self.timing.coef],
        )

    def stop(self) -> None:
        with self._wake:
            self._quit = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._io.shutdown(wait=True)

    def _loop(self) -> None:
        while True:
            with self._wake:
                self._tidy()
                if not self._running:
                    self.runner.turns.offer(None)  # no stream waits on a step: bind nobody
                    self.offered_slack_ms = -1.0
                while not self._running and not self._quit:
                    busy = self._pulling or self._waiting
                    self._wake.wait(timeout=self.busy_poll_s if busy else IDLE_TRIM_S)
                    self._tidy()
                    if not busy and not self._running and self._heap_dirty:
                        release_freed_heap()  # idle: the steps' freed heap goes back
                        self._heap_dirty = False
                if self._quit:
                    return
                batch = list(self._running)
            try:
                self._step(batch)
            except Exception as exc:  # noqa: BLE001 - these streams end with an error; serving goes on
                log.exception("%s: decode step failed", self.config.worker_id)
                for s in batch:
                    self.finish(s, "error", publish=False, note=str(exc))

    def _tidy(self) -> None:
        self._admit()
        self._collect_pulled()
        self._drop_cancelled()

    def _admit(self) -> None:
        """Waiting -> pulling while the batch has room and the pool holds a whole answer."""
        while self._waiting and len(self._running) + len(self._pulling) < self.config.max_batch:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                self._end_stream(seq, "cancelled")
                continue
            if not self.runner.admit(seq):
                return  # first come, first served: later ones wait too
            self._waiting.popleft()
            self._pulling.append(seq)
            seq.pull = self._io.submit(self.runner.fill, seq)
            # Woken once the future is done, not from inside the job: a poke before the job
            # returned found the pull not yet done, and the idle loop slept its 50 ms out.
            seq.pull.add_done_callback(lambda _: self.poke())

    def _collect_pulled(self) -> None:
        joined = False
        for seq in [s for s in self._pulling if s.pull.done()]:
            self._pulling.remove(seq)
            exc = seq.pull.exception()
            if exc is not None:
                log.warning("%s: KV fill failed: %s", self.config.worker_id, exc)
                self._release(seq)
                self._end_stream(seq, "error", note=f"KV pull failed: {exc}")
            else:
                seq.events.put(("admitted",))  # its tokens come with the next steps
                # prefilled here, its first token may end it (EOS, one token asked)
                reason = self.runner.finish_reason(seq) if seq.prefill_here else ""
                if reason:
                    self.finish(seq, reason, publish=True)
                else:
                    seq.joined = time.perf_counter()
                    self._running.append(seq)
                    joined = True
        self.metrics.running.set(len(self._running))
        if joined:
            # Offered again with the new streams in: what the others banked (up to
            # MAX_BANKED_GAPS objectives) is no slack of theirs, and a prefill kept on it held
            # their first step back: a 2-token answer's one gap took 230-250 ms of a 100 ms
            # TPOT objective while the streams before them had banked ahead.
            self._pace()

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.cancelled]:
            self._running.remove(seq)
            self._release(seq)
            self._end_stream(seq, "cancelled")

    def _step(self, batch: list[Seq]) -> None:
        self._heap_dirty = True
        t0 = time.perf_counter()
        b = len(batch)
        context = sum(s.position for s in batch) + b
        new = self.runner.step(batch)
        step_ms = (time.perf_counter() - t0) * 1000.0
        # the model learns the step, not the wait for the CPUs while the prefill worker computed
        self.timing.observe(step_ms - self.runner.turn_wait_ms, b, context)
        self.metrics.step.observe(step_ms / 1000.0)
        self.metrics.batch.observe(b)
        self.metrics.tokens.inc(b)
        self.max_batch_seen = max(self.max_batch_seen, b)
        for s, tok in zip(batch, new):
            s.out.append(tok)
            s.held.append((tok, s.ms(), b, step_ms - self.runner.turn_wait_ms))
            reason = self.runner.finish_reason(s)
            if reason:
                self.finish(s, reason, publish=True)
            elif len(s.held) >= self.config.stream_interval:
                # a stream's thread wakes once per `stream_interval` tokens: each wake-up took
                # a core from the step's threads, whose barriers then waited
                s.send_held()
        self._pace()

    def _pace(self) -> None:
        """Offer a prefill on this host's CPUs the time the running streams can spare: the
        shortest TBT objective among them, its `tbt_pace_fraction`, less the next step as the
        time model predicts it (servekit.decode_slack_ms); with `tbt_pacing` "mean", each
        stream's objective is what its next gap may take and its answer's mean still meet it."""
        with self._wake:
            running = list(self._running)
        b = len(running)
        step_ms = self.timing.predict(b, sum(s.position for s in running) + b) if b else 0.0
        fraction = self.config.tbt_pace_fraction
        if self.config.tbt_pacing == "mean":
            now = time.perf_counter()
            banked = [banked_gap_ms(s, now, fraction) for s in running if s.tbt_slo_ms > 0]
            slack = max(0.0, min(banked) - step_ms) if banked else None
        else:
            slack = decode_slack_ms([s.tbt_slo_ms for s in running], step_ms, fraction)
        self.offered_slack_ms = -1.0 if slack is None else slack
        self.runner.turns.offer(slack)

    # ---- endings ----

    def finish(self, s: Seq, reason: str, publish: bool, note: str = "") -> None:
        with self._wake:
            if s in self._running:
                self._running.remove(s)
            self.metrics.running.set(len(self._running))
        if publish and self.config.publish and not s.cancelled:
            self._io.submit(self._publish_and_release, s)
        else:
            self._release(s)
        self._end_stream(s, reason, note)

    def end_early(self, s: Seq, reason: str) -> None:
        """A stream that ends before admission (its first token ended it)."""
        self.requests_done += 1
        self.metrics.requests.labels(self.config.worker_id, reason).inc()

    def _end_stream(self, s: Seq, reason: str, note: str = "") -> None:
        self.requests_done += 1
        self.metrics.requests.labels(self.config.worker_id, reason).inc()
        s.send_held()  # the tokens before the end go first
        s.events.put(("end", reason, note))

    def _release(self, s: Seq) -> None:
        self.runner.release(s)
        self.poke()

    def _publish_and_release(self, s: Seq) -> None:
        """Publish the blocks the answer added (the connector counts and logs a failure: the
        answer was streamed already), then free the sequence's blocks."""
        try:
            self.runner.publish(s)
        finally:
            self._release(s)


# A long answer well ahead of its objective banks a lot: one gap may spend at most this many
# objectives of it, so that a stream never stalls for seconds while its mean still passes
MAX_BANKED_GAPS = 10


def banked_gap_ms(s: Seq, now: float, fraction: float) -> float:
    """How long the next gap of `s` may be with the mean gap of its answer so far within
    `fraction` of its objective: the gaps it has made, plus the next, at the objective, less the
    time they took (0 = no objective). A stream that ran ahead of its objective banked the
    difference; one behind it gets the bare objective back once it catches up."""
    if s.tbt_slo_ms <= 0 or s.joined <= 0:
        return s.tbt_slo_ms
    gaps = len(s.out) - 1  # tokens since the first, released when it joined
    spent_ms = (now - s.joined) * 1000.0
    banked = (gaps + 1) * s.tbt_slo_ms * fraction - spent_ms
    return min(max(0.0, banked), MAX_BANKED_GAPS * s.tbt_slo_ms)
