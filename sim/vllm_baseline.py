"""A colocated instance scheduled as vLLM's v1 engine schedules one: every step carries each
running sequence's next token and chunks of the prompts being prefilled, up to a per-step token
budget (`max_num_batched_tokens`), running sequences first (in the order they were admitted),
then waiting prompts first come first served; a prompt's cached prefix (automatic prefix caching:
the pool's blocks, least recently used unreferenced ones evicted first) is not computed again.
Nothing is refused: a prompt waits until the budget, `max_num_seqs` and the pool let it in, and a
sequence that finds no block for its next token preempts the last admitted one (vLLM's recompute
preemption: its blocks freed, recomputed from the front of the queue).

A step's time is the profile's fitted step model (`step_ms`): what every step costs, each decoded
sequence and the KV tokens it reads (`decode_coef`), plus, when the step carries prefill, a fixed
part, each prefill token and each token times the position its chunk ends at (`prefill_coef`);
`sim.vllm_fit` fits it from `vllm bench serve` runs."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from servekit import reusable_blocks
from sim.cache import BlockCache
from sim.events import EventLoop
from sim.instances import Job
from sim.profile import Profile

DEFAULT_BUDGET = 2048  # vLLM-CPU's max_num_batched_tokens for its OpenAI server (arg_utils.py)


@dataclass(frozen=True)
class VllmConfig:
    """The engine's scheduler settings; 0 (or a negative intake) takes the profile's figure."""

    max_num_batched_tokens: int = 0  # tokens a step carries (0: profile.max_batch_tokens or 2048)
    max_num_seqs: int = 0  # sequences running at once (0: profile.max_batch)
    prefix_caching: bool = True  # vLLM's --enable-prefix-caching
    # ms from a request's arrival until the scheduler sees it (the API server's parsing, the
    # hand-off to the engine); < 0: the profile's decode_join_ms, where a fit puts it
    intake_ms: float = -1.0

    def budget(self, p: Profile) -> int:
        return self.max_num_batched_tokens or p.max_batch_tokens or DEFAULT_BUDGET

    def seqs(self, p: Profile) -> int:
        return self.max_num_seqs or p.max_batch

    def intake(self, p: Profile) -> float:
        return self.intake_ms if self.intake_ms >= 0 else p.decode_join_ms


def step_ms(p: Profile, decodes: int, decode_context: int, tokens: int, work: float) -> float:
    """One step: `decodes` sequences reading `decode_context` KV tokens in all, and `tokens`
    prefill tokens whose sum of (chunk tokens x the position the chunk ends at) is `work`."""
    d0, d1, d2 = p.decode_coef
    ms = d0 + d1 * decodes + d2 * decode_context
    if tokens:
        c0, c1, c2 = p.prefill_coef
        ms += c0 + c1 * tokens + c2 * work
    return max(0.0, ms)


def chunked_prefill_ms(coef, start: int, end: int, chunk: int) -> float:
    """sim.timing.prefill_ms of positions [start, end) in chunks of `chunk`, in closed form (a
    policy asks for every queued prompt at every arrival; a long prompt is hundreds of chunks):
    full chunks end at start + k * chunk, k = 1..m, a last partial one at `end`."""
    n = end - start
    if n <= 0:
        return 0.0
    m, r = divmod(n, chunk)
    work = chunk * (m * start + chunk * m * (m + 1) / 2) + r * end
    c0, c1, c2 = coef
    return max(0.0, c0 * (m + (r > 0)) + c1 * n + c2 * work)


class StepLog(NamedTuple):
    start_ms: float  # when the step began
    ms: float  # its time (step_ms)
    decodes: int  # sequences it decoded a token of
    prefill_tokens: int  # prompt tokens it computed
    requests: tuple[int, ...]  # the trace index of each sequence it carried, in its order


class _Seq:
    """One request inside the engine: how far its KV goes, what it holds of the pool."""

    __slots__ = ("job", "computed", "target", "own", "shared", "decoding")

    def __init__(self, job: Job):
        self.job = job
        self.computed = 0  # tokens whose KV is in the pool
        self.target = job.req.input_tokens  # tokens to prefill before it decodes
        self.own = 0  # pool blocks it allocated itself
        self.shared: tuple[int, ...] = ()  # cached prompt blocks it references
        self.decoding = False


class VllmInstance:
    """One vLLM engine on its own KV pool (`device`, the prefix cache: published to the index
    as the instance's node, so a cache-aware policy sees it)."""

    def __init__(
        self,
        loop: EventLoop,
        iid: str,
        profile: Profile,
        device: BlockCache,
        on_done: Callable[[Job], None],
        config: VllmConfig | None = None,
    ):
        self.loop, self.id, self.profile, self.device = loop, iid, profile, device
        self.on_done = on_done
        self.cfg = config or VllmConfig()
        self.budget = self.cfg.budget(profile)
        self.max_seqs = self.cfg.seqs(profile)
        self.intake_ms = self.cfg.intake(profile)
        if self.budget < 1 or self.max_seqs < 1:
            raise ValueError(f"{iid}: max_num_batched_tokens and max_num_seqs must be >= 1")
        self.waiting: deque[_Seq] = deque()  # in the scheduler's queue, first come first served
        self.running: list[_Seq] = []  # admitted, in order: prefilling or decoding
        self.joining: list[Job] = []  # (the driver's view: nothing travels to a colocated one)
        self.refs: dict[int, int] = {}  # cached prompt block -> running sequences using it
        self.used = 0  # pool blocks referenced by running sequences
        self.stepping = False
        self.steps = 0
        self.preemptions = 0
        self.queued_tokens = 0  # prompt tokens routed here and not yet prefilled
        self.intake: list[Job] = []  # arrived, not yet seen by the scheduler
        self.routed = self.intake  # the driver counts these in the load it shows a policy
        self.step_log: list[StepLog] | None = None  # a list: every step is appended to it
        self._sync_cache()

    # ---- what the driver and the policy see ----

    @property
    def free(self) -> int:
        return self.profile.kv_blocks - self.used

    def queue_ms(self) -> float:
        """Predicted prefill compute of the prompts not yet prefilled (a policy's queue)."""
        p = self.profile
        left = [(j.req.input_tokens, 0) for j in self.intake]
        left += [(s.target, s.computed) for s in self.waiting]
        left += [(s.target, s.computed) for s in self.running if not s.decoding]
        return sum(chunked_prefill_ms(p.prefill_coef, c, t, self.budget) for t, c in left)

    def local_queue_ms(self) -> float:
        return 0.0

    def context_tokens(self) -> int:
        return sum(s.computed for s in self.running)

    def seqs(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((s.job.pos, s.job.remaining, s.job.need) for s in self.running if s.decoding)

    def waiting_seqs(self) -> tuple[tuple[int, int, int], ...]:
        ahead = self.intake + [s.job for s in self.waiting]
        ahead += [s.job for s in self.running if not s.decoding]
        return tuple((j.req.input_tokens, j.remaining, j.need) for j in ahead)

    # ---- arrivals ----

    def submit(self, job: Job) -> None:
        job.prefill_id = job.decode_id = self.id
        self.queued_tokens += job.req.input_tokens
        self.intake.append(job)
        self.loop.after(self.intake_ms, self._enqueue, job)

    def arrive(self, job: Job, kv_ms: float) -> None:  # pragma: no cover - the driver's split path
        raise AssertionError("a vLLM instance serves its own prefills")

    def _enqueue(self, job: Job) -> None:
        self.intake.remove(job)
        self.waiting.append(_Seq(job))
        if not self.stepping:
            self._step()

    # ---- the scheduler ----

    def _blocks_for(self, s: _Seq, tokens: int) -> int:
        """Blocks `s` must allocate to hold `tokens` more KV tokens."""
        bs = self.profile.block_size
        return max(0, -(-(s.computed + tokens) // bs) - len(s.shared) - s.own)

    def _release(self, s: _Seq) -> None:
        self.used -= s.own
        for k in s.shared:
            n = self.refs[k] - 1
            if n:
                self.refs[k] = n
            else:
                del self.refs[k]
                self.used -= 1
        s.own, s.shared, s.computed = 0, (), 0

    def _admit_prefix(self, s: _Seq) -> None:
        """A prompt entering the running set: its longest cached prefix (at least one token left
        to compute) is referenced instead of computed."""
        job, p = s.job, self.profile
        keys = job.req.keys
        hit = 0
        if self.cfg.prefix_caching and job.decision.use_cache:
            cap = reusable_blocks(len(keys), s.target, p.block_size)
            hit = self.device.held(keys[:cap]).blocks
        s.shared = keys[:hit]
        for k in s.shared:
            n = self.refs.get(k, 0)
            self.refs[k] = n + 1
            self.used += n == 0
        self.device.use(s.shared)
        s.computed = hit * p.block_size
        if job.first_at < 0:  # first admission: what the record reports
            job.cached["device"] = s.computed
            job.computed = job.req.input_tokens - s.computed

    def _preempt(self) -> _Seq:
        """vLLM's recompute preemption: the last admitted sequence gives its blocks back and goes
        to the front of the queue, to prefill everything it holds again."""
        victim = self.running.pop()
        self.preemptions += 1
        if victim.decoding:  # its KV and the token it would feed next
            victim.target = victim.computed + 1
        self._release(victim)
        victim.decoding = False
        self.waiting.appendleft(victim)
        return victim

    def _step(self) -> None:
        budget = self.budget
        batch: list[tuple[_Seq, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:  # running first, in admission order
            s = self.running[i]
            n = 1 if s.decoding else min(s.target - s.computed, budget)
            need = self._blocks_for(s, n)
            while need > self.free and self.running[-1] is not s:
                self._preempt()
            if need > self.free:  # it is the last one itself: it waits for room
                self._preempt()
                break
            s.own += need
            self.used += need
            batch.append((s, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            s = self.waiting[0]
            self._admit_prefix(s)
            n = min(s.target - s.computed, budget)
            need = self._blocks_for(s, n)
            if need > self.free:
                self._release(s)
                if not self.running and not batch:  # it can never fit this pool: dropped
                    self.waiting.popleft()
                    continue
                break
            self.waiting.popleft()
            s.own += need
            self.used += need
            self.running.append(s)
            batch.append((s, n))
            budget -= n
        if not batch:
            self.stepping = False
            self._sync_cache()
            return
        decodes = ctx = tokens = 0
        work = 0.0
        for s, n in batch:
            if s.decoding:
                decodes += 1
                ctx += s.computed + 1
            else:
                tokens += n
                work += n * (s.computed + n)
        ms = step_ms(self.profile, decodes, ctx, tokens, work)
        if self.step_log is not None:
            self.step_log.append(StepLog(self.loop.now, ms, decodes, tokens,
                                         tuple(s.job.req.index for s, _ in batch)))  # fmt: skip
        self.stepping = True
        self.steps += 1
        self._sync_cache()
        self.loop.after(ms, self._stepped, batch)

    def _stepped(self, batch: list[tuple[_Seq, int]]) -> None:
        now = self.loop.now
        finished = False
        for s, n in batch:
            job = s.job
            if s.decoding:
                s.computed += 1
                job.pos += 1
                job.remaining -= 1
                job.gaps.append(now - job.last_at)
                job.last_at = now
            else:
                s.computed += n
                if self.cfg.prefix_caching:
                    self._cache_computed(s)
                if s.computed < s.target:
                    continue
                s.decoding = True  # its prompt (or what a preemption took) is in: a token
                if job.first_at < 0:
                    job.first_at = job.last_at = now
                    self.queued_tokens -= job.req.input_tokens
                else:  # resumed after a preemption: the gap holds the wait
                    job.gaps.append(now - job.last_at)
                    job.last_at = now
                    job.remaining -= 1
                    job.pos = s.computed
            if job.remaining <= 0:
                finished = True
                job.done_at = now
                self._release(s)
                self.on_done(job)
        if finished:
            self.running = [s for s in self.running if s.job.done_at < 0]
        self._step()

    def _cache_computed(self, s: _Seq) -> None:
        """Full prompt blocks just computed are cached at once (a prompt arriving next step
        reuses them) and referenced like a hit: a block another sequence computed meanwhile is
        kept once, as vLLM frees the duplicate."""
        keys = s.job.req.keys
        full = min(s.computed // self.profile.block_size, len(keys))
        if full <= len(s.shared):
            return
        held = len(s.shared)
        for k in keys[held:full]:
            s.own -= 1
            n = self.refs.get(k, 0)
            self.refs[k] = n + 1
            self.used -= n > 0
        s.shared = keys[:full]
        # the new blocks under the last one cached before (insert links each to the one ahead
        # of it in what it is given; the prefix before that is in already)
        self.device.insert(keys[max(0, held - 1) : full])

    def _sync_cache(self) -> None:
        # The cache is the pool less the blocks running sequences hold outside it (uncached
        # tails and answers). Unreferenced cached blocks are evicted least recently used first
        # as the pool fills; referenced ones are touched first, so that they are not.
        cap = self.profile.kv_blocks - (self.used - len(self.refs))
        if len(self.device) > cap:
            for s in self.running:
                self.device.use(s.shared)
        self.device.set_fast_capacity(cap)
