"""The prefill scheduler: the queue, rounds of batched work, and each job's answer."""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc
import torch

from prefill_node.config import PrefillConfig
from prefill_node.job import Failure, PrefillJob
from prefill_node.metrics import PrefillMetrics
from prefill_node.runner import PrefillRunner
from protos import halfmoon_pb2 as pb
from servekit import IDLE_TRIM_S, PrefillTimeModel, release_freed_heap

log = logging.getLogger(__name__)


class PrefillScheduler:
    """One thread takes waiting jobs in rounds (up to max_batch_tokens), prepares each, and runs
    batched forwards of up to chunk_size tokens a job until every job of the round is answered."""

    def __init__(self, config: PrefillConfig, runner: PrefillRunner, metrics: PrefillMetrics):
        self.config, self.runner, self.metrics = config, runner, metrics
        self.timing = PrefillTimeModel()
        self._queue: queue.Queue[PrefillJob | None] = queue.Queue()
        self._queued: list[PrefillJob] = []  # the jobs in _queue, for load reports
        self._queued_lock = threading.Lock()
        self._current: tuple[float, float] | None = None  # (start, predicted ms) of this round
        self._round_jobs: list[PrefillJob] = []  # the round being prepared or computing now
        self.max_batch_seen = 0  # the most requests one batched forward has carried
        self.calibration_failures = 0  # start-up calibrations that failed (the prior stood)
        self.requests_done = 0
        self._thread: threading.Thread | None = None

    # ---- intake ----

    def submit(self, job: PrefillJob) -> None:
        """Queue a job; Failure(RESOURCE_EXHAUSTED) when the queue is full."""
        with self._queued_lock:
            if len(self._queued) >= self.config.max_queue:
                self.metrics.rejected.labels(self.config.worker_id, "queue_full").inc()
                raise Failure(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"prefill queue full ({self.config.max_queue} requests)",
                )
            self._queued.append(job)
            self.metrics.queued.set(len(self._queued))
        self._queue.put(job)

    def waiting(self) -> tuple[list[int], float]:
        """(prompt lengths queued, predicted ms of the work ahead of a new request)."""
        with self._queued_lock:
            lengths = [len(j.ids) for j in self._queued]
        predicted = self.rounds_ms(lengths)
        current = self._current
        if current is not None:
            # A round that overran its prediction still has its tokens left to compute.
            late = max(0.0, current[1] - (time.perf_counter() - current[0]) * 1000.0)
            left = [(j.pos, len(j.ids)) for j in list(self._round_jobs) if j.error is None]
            predicted += max(late, self.forwards_ms(left))
        return lengths, predicted

    def rounds_ms(self, lengths: list[int]) -> float:
        """Predicted compute of queued prompts as the loop will run them: rounds of up to
        max_batch_tokens prompt tokens in order, each in batched forwards. A prompt's cached
        prefix is not known before its round: counted as computed."""
        total, i, cap = 0.0, 0, self.config.max_batch_tokens
        while i < len(lengths):
            spans, tokens = [], 0
            while i < len(lengths) and (not spans or tokens < cap):
                spans.append((0, lengths[i]))
                tokens, i = tokens + lengths[i], i + 1
            total += self.forwards_ms(spans)
        return total

    def forwards_ms(self, spans: list[tuple[int, int]]) -> float:
        """Predicted compute of one round whose prompts have positions [start, end) to compute:
        forwards of up to chunk_size tokens a prompt, each one fixed cost (c0) for all of its
        prompts, as the time model is fitted per forward. Summing each prompt's own prediction
        instead charged a round of k prompts k fixed costs: on the 2-core EPYC c0 is ~90 ms, a
        burst of ten short prompts read as 0.8 s of queue that one forward computes."""
        chunk, total = self.config.chunk_size, 0.0
        spans = [(s, e) for s, e in spans if e > s]
        while spans:
            tokens = sum(min(e, s + chunk) - s for s, e in spans)
            work = sum((min(e, s + chunk) - s) * min(e, s + chunk) for s, e in spans)
            total += self.timing.predict(tokens, work / tokens)
            spans = [(s + chunk, e) for s, e in spans if s + chunk < e]
        return total

    def running_tokens(self) -> int:
        """Prompt tokens the round computing now has left to compute."""
        return sum(max(0, len(j.ids) - j.pos) for j in list(self._round_jobs) if j.error is None)

    # ---- the loop ----

    def start(self) -> None:
        self.calibrate()
        self._thread = threading.Thread(
            target=self._loop, daemon=True, name=f"{self.config.worker_id}-prefill"
        )
        self._thread.start()

    def calibrate(self) -> None:
        """Seed the time model with timed forwards of the sizes a chunk can have, before the
        port opens: the first burst of a cold cluster is routed on measured costs, not on the
        prior (which can be off by 5x). The forwards fill scratch blocks and publish nothing."""
        r, cfg = self.runner, self.config
        bs = cfg.block_size
        top = min(cfg.chunk_size, (r.pool.num_blocks // 2) * bs)
        t0 = time.perf_counter()
        try:
            # Cold chunks of several sizes, then chunks after a prefix (the tokens*context term):
            # eight forwards, what the model needs before it fits.
            small, mid = max(bs, top // 8), max(bs, top // 2)
            shapes = [(bs, 0), (small, 0), (mid, 0), (top, 0), (small, top), (mid, top)]
            shapes += [(small, 0), (small, top)]
            # Each shape once untimed first: the first touches of weights, pool pages and lazy
            # kernels cost several times a forward.
            for i, (tokens, prefix) in enumerate(shapes + shapes):
                table = r.allocate(-(-(prefix + tokens) // bs))
                try:
                    ids = torch.full((tokens,), 10, dtype=torch.long)
                    with r.turns.turn():  # timed alone, not beside the decode worker's steps
                        c0 = time.perf_counter()
                        r.lm.model.prefill_batch([(ids, table, prefix)], r.pool)
                        ms = (time.perf_counter() - c0) * 1000.0
                finally:
                    r.free(table)
                if i >= len(shapes):
                    self.timing.seed(ms, tokens, prefix + tokens)
        except Exception as exc:  # noqa: BLE001 - serving goes on with the prior
            self.calibration_failures += 1
            log.warning(
                "%s: time model calibration failed (%s); the prior stands until requests are "
                "measured",
                cfg.worker_id,
                exc,
            )
            return
        log.info(
            "%s: prefill time model calibrated in %.1f s: %s",
            cfg.worker_id,
            time.perf_counter() - t0,
            [round(c, 5) for c in self.timing.coef],
        )

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        waiting: list[PrefillJob] = []  # jobs put off to the next round
        while True:
            if not waiting:
                job = self._next_job()
                if job is None:
                    return
                waiting = [job]
            # A round takes waiting requests up to max_batch_tokens, in arrival order, and those
            # that arrive while requests keep coming (batch_gather_ms apart, 10x that at most),
            # while it holds fewer than batch_gather_tokens (then only what is queued already).
            batch, tokens = waiting, sum(len(j.ids) for j in waiting)
            gap_s = self.config.batch_gather_ms / 1000.0
            until = time.perf_counter() + 10 * gap_s
            small = self.config.batch_gather_tokens
            while tokens < self.config.max_batch_tokens:
                gather = not small or tokens < small
                wait_s = min(gap_s, until - time.perf_counter()) if gather else 0.0
                try:
                    nxt = self._queue.get(timeout=wait_s) if wait_s > 0 else self._queue.get(False)
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
                tokens += len(nxt.ids)
            waiting = self._round(batch)

    def _next_job(self) -> PrefillJob | None:
        """The next queued job (None: stop). A queue empty for IDLE_TRIM_S first gets the heap
        the last rounds freed returned to the system."""
        try:
            return self._queue.get(timeout=IDLE_TRIM_S)
        except queue.Empty:
            release_freed_heap()
            return self._queue.get()

    def _round(self, batch: list[PrefillJob]) -> list[PrefillJob]:
        """Prepare each job, compute them all together, answer each; the jobs put off."""
        with self._queued_lock:
            for job in batch:
                if job in self._queued:
                    self._queued.remove(job)
            self.metrics.queued.set(len(self._queued))
            # Out of the queue: while they are prepared (a prefix fetched, blocks allocated) the
            # load report counts their tokens as the round's, not as gone.
            self._round_jobs = list(batch)
        jobs: list[PrefillJob] = []
        later: list[PrefillJob] = []
        computing: set[bytes] = set()  # keys of the blocks this round computes
        for job in batch:
            if job.cancelled:
                job.done.set()
                continue
            if jobs and self._shares_new_blocks(job, computing):
                later.append(job)  # next round it reuses them instead of computing them again
                continue
            job.started = time.perf_counter()
            try:
                self.runner.prepare(job, self.timing)
            except Failure as exc:
                self.runner.release(job)
                if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and jobs:
                    later.append(job)  # this round's jobs hold the pool: room comes back after it
                else:
                    self._fail(job, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - the RPC answers INTERNAL; serving goes on
                self._fail(job, exc)
                continue
            self.metrics.queue.observe(job.queue_ms / 1000.0)
            computing.update(job.keys[job.pos // self.config.block_size :])
            jobs.append(job)
        predicted = self.forwards_ms([(j.pos, len(j.ids)) for j in jobs])
        self._current, self._round_jobs = (time.perf_counter(), predicted), jobs
        try:
            self._compute(jobs)
        finally:
            self._current, self._round_jobs = None, []
        return later

    def _shares_new_blocks(self, job: PrefillJob, computing: set[bytes]) -> bool:
        """Whether a reusable block of the job is one this round computes for an earlier job."""
        if job.request.no_cache or not computing:
            return False
        keys = self.runner.keys_of(job)
        return any(k in computing for k in keys[: self.runner.reusable(job, keys)])

    def _compute(self, jobs: list[PrefillJob]) -> None:
        """Batched forwards of up to chunk_size tokens a job; a job is answered once its last
        position is computed."""
        start = time.perf_counter()
        while True:
            step = [j for j in jobs if j.error is None and j.pos < len(j.ids)]
            if not step:
                return
            spans = [(j.pos, min(len(j.ids), j.pos + self.config.chunk_size)) for j in step]
            c0 = time.perf_counter()
            try:
                logits = self.runner.compute_step(step, spans)
            except Exception as exc:  # noqa: BLE001 - this forward's jobs fail; serving goes on
                for j in step:
                    self._fail(j, exc)
                continue
            now = time.perf_counter()
            tokens = sum(e - s for s, e in spans)
            # One observation per forward: tokens*context summed over its sequences.
            self.timing.observe(  # the forward, not its wait for a turn at the CPUs
                (now - c0) * 1000.0 - self.runner.turn_wait_ms,
                tokens,
                sum((e - s) * e for s, e in spans) / tokens,
            )
            self.max_batch_seen = max(self.max_batch_seen, len(step))
            done = []
            for j, (_, e), lg in zip(step, spans, logits):
                j.pos, j.logits, j.prefill_ms = e, lg, (now - start) * 1000.0
                if e == len(j.ids):
                    done.append(j)
            if done:
                try:
                    self.runner.store_all(done)
                except Exception as exc:  # noqa: BLE001 - each finish checks its own again
                    log.warning("%s: storing a round's blocks: %s", self.config.worker_id, exc)
            for j in done:
                self._answer(j)

    # ---- endings ----

    def _answer(self, job: PrefillJob) -> None:
        try:
            job.reply = self.runner.finish(job)
        except Exception as exc:  # noqa: BLE001 - the RPC answers INTERNAL; serving goes on
            self._fail(job, exc)
            return
        self._complete(job, "ok")

    def _fail(self, job: PrefillJob, exc: Exception) -> None:
        """Answer the job with exc's status (INTERNAL unless a Failure); its blocks go back."""
        if not isinstance(exc, Failure):
            log.exception("%s: prefill failed", self.config.worker_id, exc_info=exc)
            exc = Failure(grpc.StatusCode.INTERNAL, f"prefill failed: {type(exc).__name__}: {exc}")
        job.error = exc
        self.runner.release(job)
        self._complete(job, "error")

    def _complete(self, job: PrefillJob, outcome: str) -> None:
        self.metrics.requests.labels(self.config.worker_id, outcome).inc()
        self.requests_done += 1
        job.done.set()


def reply_or_raise(job: PrefillJob) -> pb.PrefillReply:
    """The job's answer once done; its Failure otherwise."""
    if job.error is not None:
        raise job.error
    return job.reply
