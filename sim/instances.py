"""Simulated instances: a prefill instance (FIFO queue, chunked prefill, prefix loads from its
tiers), a decode instance (admission bounded by KV blocks and batch size, continuous batching),
and a colocated one that does both on one pool (prefill first, as vLLM schedules it)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from servekit import blocks_needed, reusable_blocks
from sim.cache import BlockCache
from sim.events import EventLoop
from sim.profile import Profile
from sim.timing import prefill_ms, transfer_ms


class Job:
    """One request's life in the simulated cluster (the driver turns it into a record)."""

    __slots__ = (
        "req", "decision", "arrived", "first_at", "last_at", "gaps", "pos", "remaining",
        "need", "cached", "computed", "prefill_id", "decode_id", "predicted_ms", "done_at",
        "prompt_blocks", "compute_ms", "held", "local_ratio",
    )  # fmt: skip

    def __init__(self, req, decision, arrived: float, block_size: int):
        self.req, self.decision, self.arrived = req, decision, arrived
        self.first_at = self.last_at = self.done_at = -1.0
        self.gaps: list[float] = []
        self.pos = req.input_tokens  # KV position of the next token fed
        self.remaining = req.output_tokens - 1  # tokens the decode side generates
        self.need = blocks_needed(req.input_tokens, req.output_tokens, block_size)
        self.cached = {"device": 0, "dram": 0, "ssd": 0, "remote": 0}
        self.computed = 0
        self.prefill_id = self.decode_id = ""
        self.predicted_ms = 0.0  # the compute this job adds to its prefill queue
        self.prompt_blocks = len(req.keys)
        self.compute_ms = 0.0  # its prefill round's first forward to its answer
        # its first token waits for the decode side to admit it (as the live conductor holds it)
        self.held = False
        # prefilled on its decode instance: the `local` correction its prediction was made with
        self.local_ratio = 1.0


def load_prefix(
    job: Job,
    profile: Profile,
    device: BlockCache | None,
    store: BlockCache | None,
    remote: BlockCache | None,
) -> tuple[int, float]:
    """(blocks reused, ms to load them): the instance's device pool first, then its node's DRAM
    and SSD, then the remote node the decision names; what they hold now, not at routing."""
    keys = job.req.keys
    cap = reusable_blocks(len(keys), job.req.input_tokens, profile.block_size)
    if not job.decision.use_cache or cap == 0:
        return 0, 0.0
    keys = keys[:cap]
    bb = profile.block_bytes
    dev = device.held(keys).blocks if device is not None else 0
    have, ms = dev, 0.0
    job.cached["device"] = dev * profile.block_size
    if device is not None:
        device.use(keys[:dev])
    if store is not None:
        h = store.held(keys)
        if h.blocks > have:
            extra = h.blocks - have
            # the slow-tier hits among the extra ones: counted from the tail of the held run
            slow = min(h.slow, extra)
            ms += transfer_ms(slow, bb, profile.ssd_gbps) + transfer_ms(
                extra, bb, profile.dram_gbps
            )
            job.cached["ssd"] = slow * profile.block_size
            job.cached["dram"] = (extra - slow) * profile.block_size
            have = h.blocks
        store.use(keys[: h.blocks])
    if remote is not None and job.decision.fetch_blocks > have:
        got = min(remote.held(keys[: job.decision.fetch_blocks]).blocks, cap)
        if got > have:
            ms += transfer_ms(got - have, bb, profile.network_gbps)
            job.cached["remote"] = (got - have) * profile.block_size
            remote.use(keys[:got])
            have = got
    return have, ms


class PrefillInstance:
    """As the live prefill worker schedules: a round takes the waiting requests in arrival order
    up to `max_batch_tokens` (0: one request a round), loads each one's cached prefix, then runs
    batched forwards of up to `chunk_size` tokens a request; a request is answered with the
    forward that computes its last position, and its KV lands in the node's store (and the
    instance's own pool)."""

    def __init__(
        self,
        loop: EventLoop,
        iid: str,
        profile: Profile,
        store: BlockCache | None,
        device: BlockCache | None,
        caches: dict[str, BlockCache],
        on_first: Callable[[Job], None],
    ):
        self.loop, self.id, self.profile = loop, iid, profile
        self.store, self.device, self.caches = store, device, caches
        self.on_first = on_first
        self.queue: deque[Job] = deque()
        self.queued_ms = 0.0  # predicted compute of the queued jobs
        self.queued_tokens = 0
        self.round_end = -1.0  # when the round computing now ends (< now: idle)
        self.busy = False
        self.gather_start = -1.0  # when an idle instance began gathering a round (< 0: not)
        self.gather_seq = 0  # the last arrival's mark: a gather check for an older one is stale
        self.host_decode: DecodeInstance | None = None  # sharing the host's CPUs (shared_host)

    def queue_ms(self) -> float:
        left = max(0.0, self.round_end - self.loop.now) if self.busy else 0.0
        return left + self.queued_ms

    def submit(self, job: Job) -> None:
        job.prefill_id = self.id
        self.queue.append(job)
        self.queued_ms += job.predicted_ms
        self.queued_tokens += job.req.input_tokens
        if self.busy:
            return
        gap, small = self.profile.batch_gather_ms, self.profile.batch_gather_tokens
        if (
            gap <= 0
            or self.queued_tokens >= self.profile.max_batch_tokens
            or (small and self.queued_tokens >= small)
        ):
            self._start()
            return
        now = self.loop.now
        if self.gather_start < 0:
            self.gather_start = now
        self.gather_seq += 1
        self.loop.at(min(now + gap, self.gather_start + 10 * gap), self._gathered, self.gather_seq)

    def _gathered(self, seq: int) -> None:
        if seq == self.gather_seq and not self.busy:  # no arrival since: the round starts
            self._start()

    def _start(self) -> None:
        self.gather_start = -1.0
        self._round()

    def _round(self) -> None:
        p = self.profile
        batch: list[Job] = []
        tokens = 0
        while self.queue and (not batch or tokens < p.max_batch_tokens):
            job = self.queue.popleft()
            self.queued_ms = max(0.0, self.queued_ms - job.predicted_ms)
            self.queued_tokens -= job.req.input_tokens
            batch.append(job)
            tokens += job.req.input_tokens
        t = self.loop.now
        spans: list[list] = []  # [job, tokens prefilled so far] each, advanced in place
        for job in batch:  # each loads its prefix (from what the tiers hold now)
            remote = self.caches.get(job.decision.fetch_from) if job.decision.fetch_from else None
            reused, load = load_prefix(job, p, self.device, self.store, remote)
            start = reused * p.block_size
            job.computed = job.req.input_tokens - start
            t += load
            spans.append([job, start])
        c0, c1, c2 = p.prefill_coef
        chunk = p.chunk_size or max(j.req.input_tokens for j in batch)
        first_forward = t
        # the host's decode steps run inside the round, one per slack it gives (shared_host)
        stretch = self.host_decode.stretch() if self.host_decode is not None else 1.0
        while spans:  # batched forwards: every unfinished job advances a chunk
            n_tok, work = 0, 0.0
            for sp in spans:
                e = min(sp[0].req.input_tokens, sp[1] + chunk)
                n_tok += e - sp[1]
                work += (e - sp[1]) * e
                sp[1] = e
            t += max(0.0, c0 + c1 * n_tok + c2 * work) * stretch
            for sp in [sp for sp in spans if sp[1] >= sp[0].req.input_tokens]:
                # each answer (blocks written out, the reply) in turn, on the worker's thread
                t += p.request_overhead_ms
                spans.remove(sp)
                sp[0].compute_ms = t - first_forward
                self.loop.at(t + p.answer_latency_ms, self._answer, sp[0])
        self.busy, self.round_end = True, t
        self.loop.at(t, self._round_done)

    def _answer(self, job: Job) -> None:
        for cache in (self.device, self.store):
            if cache is not None:
                cache.insert(job.req.keys)
        job.first_at = job.last_at = self.loop.now
        self.on_first(job)

    def _round_done(self) -> None:
        self.busy = False
        if self.queue:
            self._round()


class DecodeInstance:
    """Admission in arrival order while the pool holds a sequence's whole answer and the batch
    has a slot; then the KV moves in and the sequence joins the running batch. As on the live
    worker, admission happens between steps, and the first token goes out when the sequence
    joins the batch: the admission wait and the KV move are TTFT, the first gap is a step."""

    def __init__(self, loop: EventLoop, iid: str, profile: Profile, on_done: Callable[[Job], None]):
        self.loop, self.id, self.profile, self.on_done = loop, iid, profile, on_done
        # a prompt prefilled here gave its first token (the driver's `local` correction)
        self.on_local_first: Callable[[Job], None] | None = None
        self.free = profile.kv_blocks
        # (job, its KV move's ms; None: prefilled here, its compute in job.compute_ms)
        self.waiting: deque[tuple[Job, float | None]] = deque()
        # Prompts prefilled here (conditional disaggregation), admitted, in order; the first one
        # computes between the steps, as the live worker's prefill takes the CPUs for the slack
        # its streams leave under their TBT objective (`tbt_budget_ms`, 0 = no objective: the
        # static slice, `slice_ms`).
        self.local: deque[Job] = deque()
        self.local_left_ms = 0.0  # compute left of local[0]
        self.tbt_budget_ms = 0.0
        self.slice_ms = 50.0
        self.layer_ms = 1.0  # what a prefill gets between steps that leave no slack
        self.host_prefill: PrefillInstance | None = None  # sharing the host's CPUs (shared_host)
        self.joining: list[Job] = []  # admitted, KV on its way
        # routed here, still in prefill: the live conductor counts these as waiting too
        self.routed: list[Job] = []
        self.running: list[Job] = []
        self.stepping = False
        self.steps = 0
        self.context = 0  # KV tokens the running sequences hold

    def arrive(self, job: Job, kv_ms: float) -> None:
        job.decode_id = self.id
        job.held = True
        if job in self.routed:
            self.routed.remove(job)
        self.waiting.append((job, kv_ms))
        if not self.stepping:  # otherwise at the end of the step in flight
            self._admit()

    def arrive_local(self, job: Job) -> None:
        """A prompt routed here to be prefilled here: admitted in turn, then computed between
        the steps, joining the batch when its prefill ends."""
        job.decode_id = job.prefill_id = self.id
        job.held = True
        self.waiting.append((job, None))
        if not self.stepping:
            self._admit()
            if not self.stepping and self.local:
                self._step()

    def local_queue_ms(self) -> float:
        """What the policy sees: compute left of the prompts to prefill here."""
        queued = sum(j.compute_ms for j in list(self.local)[1:])
        waiting = sum(j.compute_ms for j, kv in self.waiting if kv is None)
        return (self.local_left_ms if self.local else 0.0) + queued + waiting

    def _admit(self) -> None:
        p = self.profile
        while self.waiting:
            job, kv_ms = self.waiting[0]
            if self.free < job.need or len(self.running) + len(self.joining) >= p.max_batch:
                return
            self.waiting.popleft()
            self.free -= job.need
            if kv_ms is None:
                if not self.local:
                    self.local_left_ms = job.compute_ms
                self.local.append(job)
                continue
            self.joining.append(job)
            self.loop.after(kv_ms, self._join, job)

    def _join(self, job: Job) -> None:
        self.joining.remove(job)
        self.running.append(job)
        self.context += job.pos
        if not self.stepping:
            self._step()

    def _step(self) -> None:
        # Sequences that join during the step wait for the next one: the step is the first n.
        n = len(self.running)
        for j in self.running:
            if j.held:  # admitted: its first token goes out now, its first gap is this step
                j.held = False
                j.first_at = j.last_at = self.loop.now
                self._local_first(j)
        step_ms = self._step_ms()
        # a prefill here takes the CPUs between steps for the slack the streams leave (all of
        # it, a slice at a time, with no stream)
        grant = 0.0
        if self.local:
            slack = max(0.0, self._streams_slack(step_ms)) if n else self.slice_ms
            grant = min(self.local_left_ms, slack)
            if n and grant <= 0.0:  # the step takes the whole budget: a layer between steps
                grant = min(self.local_left_ms, self.layer_ms)
        wait = self._host_wait(step_ms) if n else 0.0
        self.stepping = True
        self.steps += 1
        self.loop.after(step_ms + grant + wait, self._stepped, n, grant)

    def _local_first(self, job: Job) -> None:
        if job.prefill_id == self.id and self.on_local_first is not None:
            self.on_local_first(job)

    def _step_ms(self) -> float:
        n = len(self.running)
        c0, c1, c2 = self.profile.decode_coef
        return max(0.0, c0 + c1 * n + c2 * self.context) if n else 0.0

    def _streams_slack(self, step_ms: float) -> float:
        """What the running streams leave a prefill on these CPUs before the next step: their
        objective's budget less the step (the static slice with no objective); may be < 0."""
        return self.tbt_budget_ms - step_ms if self.tbt_budget_ms else self.slice_ms

    def _slack(self, step_ms: float) -> float:
        """What the host's prefill may keep its CPUs for before the next step: the streams'
        slack, a layer at least."""
        return max(self.layer_ms, self._streams_slack(step_ms))

    def _host_wait(self, step_ms: float) -> float:
        """The wait for the CPUs a step has while the host's prefill computes: its slack, or the
        rest of the prefill's round when that ends sooner."""
        pre = self.host_prefill
        if pre is None or not pre.busy:
            return 0.0
        return min(self._slack(step_ms), max(0.0, pre.round_end - self.loop.now))

    def stretch(self) -> float:
        """How much longer a prefill round on the host's CPUs takes while this instance decodes:
        a step after every slack it gives."""
        step_ms = self._step_ms()
        return 1.0 + step_ms / self._slack(step_ms) if step_ms else 1.0

    def _stepped(self, n: int, grant: float = 0.0) -> None:
        now = self.loop.now
        if grant:
            self.local_left_ms -= grant
            if self.local_left_ms <= 1e-9:
                job = self.local.popleft()  # prefilled: it joins for the next step
                self.local_left_ms = self.local[0].compute_ms if self.local else 0.0
                if job.remaining > 0:
                    self.running.append(job)
                    self.context += job.pos
                else:  # its first token was its whole answer
                    job.held, job.first_at = False, now
                    job.last_at = job.done_at = now
                    self._local_first(job)
                    self.free += job.need
                    self.on_done(job)
        ended = False
        for j in self.running[:n]:
            j.gaps.append(now - j.last_at)
            j.last_at = now
            j.pos += 1
            j.remaining -= 1
            if j.remaining <= 0:
                ended = True
                self.free += j.need
                self.context -= j.pos - 1
                j.done_at = now
                self.on_done(j)
        self.context += n
        if ended:
            self.running = [j for j in self.running if j.remaining > 0]
        self._admit()  # between steps: room freed, or sequences that arrived during the step
        self.stepping = False
        if self.running or self.local:
            self._step()

    # what the policy sees
    def seqs(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((j.pos, j.remaining, j.need) for j in self.running + self.joining)

    def waiting_seqs(self) -> tuple[tuple[int, int, int], ...]:
        ahead = [j for j, _ in self.waiting] + self.routed
        return tuple((j.req.input_tokens, j.remaining, j.need) for j in ahead)

    def context_tokens(self) -> int:
        return self.context + sum(j.pos for j in self.joining)


class ColocatedInstance(DecodeInstance):
    """Prefill and decode on one pool, vLLM-style: while a waiting prompt fits (pool and batch)
    a prefill iteration runs, stalling the running batch; otherwise a decode step. Its free pool
    doubles as a local prefix cache."""

    def __init__(
        self,
        loop: EventLoop,
        iid: str,
        profile: Profile,
        device: BlockCache,
        on_first: Callable[[Job], None],
        on_done: Callable[[Job], None],
        max_prefill_tokens: int = 0,
    ):
        super().__init__(loop, iid, profile, on_done)
        self.device, self.on_first = device, on_first
        self.queue: deque[Job] = deque()
        self.queued_ms = 0.0
        self.queued_tokens = 0
        self.busy_until = -1.0
        self.max_prefill_tokens = max_prefill_tokens or max(profile.chunk_size, 8192)
        self._sync_cache()

    def queue_ms(self) -> float:
        return max(0.0, self.busy_until - self.loop.now) + self.queued_ms

    def submit(self, job: Job) -> None:
        job.prefill_id = job.decode_id = self.id
        self.queue.append(job)
        self.queued_ms += job.predicted_ms
        self.queued_tokens += job.req.input_tokens
        if not self.stepping:
            self._iterate()

    def arrive(self, job: Job, kv_ms: float) -> None:  # its own prefill's output: already here
        self.running.append(job)
        self.context += job.pos

    def _join(self, job: Job) -> None:  # pragma: no cover - colocated sequences never travel
        raise AssertionError("colocated sequences do not move")

    def _step(self) -> None:
        self._iterate()

    def _iterate(self) -> None:
        p = self.profile
        batch: list[Job] = []
        tokens = 0
        while self.queue:
            job = self.queue[0]
            room = self.free >= job.need and len(self.running) + len(batch) < p.max_batch
            if not room or (batch and tokens + job.req.input_tokens > self.max_prefill_tokens):
                break
            self.queue.popleft()
            self.queued_ms = max(0.0, self.queued_ms - job.predicted_ms)
            self.queued_tokens -= job.req.input_tokens
            self.free -= job.need
            batch.append(job)
            tokens += job.req.input_tokens
        if batch:
            ms = 0.0
            for i, job in enumerate(batch):
                reused, load = load_prefix(job, p, self.device, None, None)
                start = reused * p.block_size
                job.computed = job.req.input_tokens - start
                one = prefill_ms(p.prefill_coef, start, job.req.input_tokens, p.chunk_size)
                ms += load + (one if i == 0 else max(0.0, one - p.prefill_coef[0]))
            self._sync_cache()
            self.stepping = True
            self.busy_until = self.loop.now + ms
            self.loop.after(ms, self._prefilled, batch)
        elif self.running:
            self.busy_until = -1.0
            super()._step()
        else:
            self.stepping = False
            self.busy_until = -1.0

    def _prefilled(self, batch: list[Job]) -> None:
        now = self.loop.now
        for job in batch:
            self.device.insert(job.req.keys)
            job.first_at = job.last_at = now
            self.on_first(job)  # the driver hands it back through arrive() unless it is done
        # the running batch waited through the prefill: that time is in its next gap
        self._sync_cache()
        self.stepping = False
        self._iterate()

    def _stepped(self, n: int, grant: float = 0.0) -> None:
        super()._stepped(n, grant)  # calls _step -> _iterate while something runs
        self._sync_cache()
        if not self.stepping:
            self._iterate()

    def _admit(self) -> None:  # admission is the prefill queue's
        return

    def _sync_cache(self) -> None:
        # Prompt blocks of running sequences are cached and in use at once.
        held = sum(j.prompt_blocks for j in self.running)
        self.device.set_fast_capacity(self.free + held)
