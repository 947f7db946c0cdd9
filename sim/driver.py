"""The simulation: arrivals from a trace, each routed by the live conductor's policy object on
a ClusterState built from the simulated instances, then prefill, KV transfer and decode on them.
The result is the same records `halfmoon replay` writes, so the same report comes out."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from client.report import ReplayRecord, Report, compute_report
from conductor import (
    ClusterState,
    Correction,
    DecodeCandidate,
    Policy,
    PrefillCandidate,
    Rejected,
    RequestInfo,
    admit,
    make_policy,
)
from conductor.config import ADMISSION_MODES
from conductor.estimates import paced_slo_ms
from conductor.planner import PlannerConfig
from servekit import config_from_dict
from sim.arrivals import SimRequest
from sim.cache import BlockCache
from sim.events import EventLoop
from sim.index import GlobalIndex
from sim.instances import ColocatedInstance, DecodeInstance, Job, PrefillInstance
from sim.profile import Profile
from sim.role_switch import RoleSwitcher, SwitchRecord, host_of
from sim.timing import prefill_ms, transfer_ms
from sim.vllm_baseline import VllmConfig, VllmInstance

log = logging.getLogger(__name__)


@dataclass
class ClusterSpec:
    """The simulated cluster's shape and what requests ask of it."""

    prefill: int | None = None  # prefill instances, one node each (default 1; 0 if colocated)
    decode: int | None = None  # decode instances, one node each (default 1; 0 if colocated)
    colocated: int = 0  # > 0: this many instances that each prefill and decode (no P/D split)
    # how a colocated instance schedules, a name in COLOCATED_KINDS: "stall" prefills whole
    # prompts between decode steps; "vllm" is vLLM's chunked prefill under a token budget with
    # prefix caching (sim.vllm_baseline), its settings in colocated_options (VllmConfig's fields)
    colocated_kind: str = "stall"
    colocated_options: dict = field(default_factory=dict)
    policy: str = "mooncake"  # any name conductor.make_policy knows
    policy_options: dict = field(default_factory=dict)
    ttft_slo_ms: float = 2000.0
    tbt_slo_ms: float = 200.0  # 0 = not judged
    tpot_slo_ms: float = 0.0  # time per output token (the mean gap, as vLLM's client); 0 = none
    admission: str = "reject"  # or best_effort: as the conductor's (conductor.admit)
    tbt_pace_fraction: float = 0.8  # of the TBT objective a decode step keeps (DecodeConfig)
    # The conductor's `local` correction of each decode instance's own prefills (measured TTFT
    # over predicted, as the live one learns since 40fe995); False: the model alone judges them
    # (runs taken with a conductor from before)
    local_correction: bool = True
    # The runtime planner (conductor.planner's rule, PlannerConfig's fields; {} = its defaults)
    # moving instances between prefill and decode as the load shifts (sim.role_switch); None =
    # the roles stay as started
    planner: dict | None = None

    def __post_init__(self) -> None:
        default = 0 if self.colocated else 1
        self.prefill = default if self.prefill is None else self.prefill
        self.decode = default if self.decode is None else self.decode
        if min(self.ttft_slo_ms, self.tbt_slo_ms, self.tpot_slo_ms) < 0:
            raise ValueError(
                "ttft_slo_ms, tbt_slo_ms and tpot_slo_ms must be >= 0 (0 = not judged), got "
                f"{self.ttft_slo_ms}, {self.tbt_slo_ms}, {self.tpot_slo_ms}"
            )
        if self.admission not in ADMISSION_MODES:
            known = ", ".join(ADMISSION_MODES)
            raise ValueError(f"admission: one of {known}, not {self.admission!r}")
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("instance counts must be >= 0")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("colocated instances replace prefill/decode ones: set those to 0")
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise ValueError("need at least one prefill and one decode instance (or colocated)")
        if self.colocated_kind not in COLOCATED_KINDS:
            known = ", ".join(COLOCATED_KINDS)
            raise ValueError(f"colocated_kind: one of {known}, not {self.colocated_kind!r}")
        if self.colocated_options and self.colocated_kind == "stall":
            raise ValueError("colocated_options: the stall kind takes none")
        VllmConfig(**self.colocated_options)  # unknown names fail here, not mid-run
        if self.planner is not None:
            if self.colocated:
                raise ValueError("planner: colocated instances have no roles to switch")
            config_from_dict(PlannerConfig, self.planner, "planner")  # fails here, not mid-run

    @property
    def planner_config(self) -> PlannerConfig | None:
        if self.planner is None:
            return None
        return config_from_dict(PlannerConfig, self.planner, "planner")

    @property
    def label(self) -> str:
        shape = f"{self.colocated}M" if self.colocated else f"{self.prefill}P+{self.decode}D"
        if self.colocated and self.colocated_kind != "stall":
            opts = ",".join(f"{k}={v}" for k, v in sorted(self.colocated_options.items()))
            shape += f" {self.colocated_kind}" + (f" {opts}" if opts else "")
        if self.planner is not None:
            shape += " planner"
        return f"{self.policy}[{shape}]"


# Colocated instance kinds by name: (loop, id, profile, its pool's cache, the driver's first-token
# and done callbacks, the spec's colocated_options) -> the instance
ColocatedFactory = Callable[..., "ColocatedInstance | VllmInstance"]
COLOCATED_KINDS: dict[str, ColocatedFactory] = {
    "stall": lambda loop, iid, p, cache, first, done, opts: ColocatedInstance(
        loop, iid, p, cache, first, done
    ),
    "vllm": lambda loop, iid, p, cache, first, done, opts: VllmInstance(
        loop, iid, p, cache, done, VllmConfig(**opts)
    ),
}


class SimResult(NamedTuple):
    records: list[ReplayRecord]
    report: Report
    events: int  # callbacks the event loop ran
    wall_s: float  # time the simulation took
    sim_s: float  # simulated time, first arrival to last answer
    redirected: int  # colocated: decisions whose decode worker differed (served where prefilled)
    best_effort: int = 0  # admitted although predicted to miss (spec.admission: best_effort)
    local_prefills: int = 0  # prompts prefilled on their decode instance (prefill_on_decode)
    # the planner's switches in order (spec.planner; empty without one)
    role_switches: list[SwitchRecord] = []


class _Sim:
    def __init__(self, profile: Profile, spec: ClusterSpec, policy: Policy):
        self.p, self.spec, self.policy = profile, spec, policy
        self.loop = EventLoop()
        self.index = GlobalIndex()
        self.caches: dict[str, BlockCache] = {}
        self.prefill: dict[str, PrefillInstance | ColocatedInstance | VllmInstance] = {}
        self.decode: dict[str, DecodeInstance | VllmInstance] = {}
        self.nodes: dict[str, tuple[str, ...]] = {}  # prefill id -> its index node ids
        self.device_nodes: set[str] = set()
        self.jobs: list[Job] = []
        self.rejected: list[tuple[SimRequest, str]] = []
        self.redirected = 0
        self.best_effort = 0  # admitted although predicted to miss (admission: best_effort)
        self.local_prefills = 0  # prompts prefilled on their decode instance
        # Per decode instance, the live conductor's `local` correction: prompts prefilled there,
        # measured against their predicted TTFT, scale the next ones' predictions (a decode
        # instance whose prefills run slow behind its host's prefill is routed fewer of them).
        self.local_corrections: dict[str, Correction] = {}
        p = profile
        for i in range(spec.colocated):
            dev = f"m{i}-dev"
            cache = self.caches[dev] = BlockCache(dev, self.index, p.kv_blocks)
            make = COLOCATED_KINDS[spec.colocated_kind]
            inst = make(self.loop, f"m{i}", p, cache, self._first, self._done,
                        spec.colocated_options)  # fmt: skip
            self.prefill[inst.id] = inst
            self.decode[inst.id] = inst
            self.nodes[inst.id] = (dev,)
            self.device_nodes.add(dev)
        for i in range(spec.prefill or 0):  # resolved to a count by ClusterSpec.__post_init__
            self.add_prefill(f"p{i}")
        for i in range(spec.decode or 0):
            self.add_decode(f"d{i}")
        # instances the planner drains for a role switch: routed nothing new
        self.draining: set[str] = set()
        # shared_host: p<i> and d<i> on one host take turns at its CPUs. Kept by the hosts
        # they started on, so that a role switch pairs again what then runs there.
        self.cpu_mates: dict[str, str] = {}
        if p.shared_host:
            for i in range(min(spec.prefill or 0, spec.decode or 0)):
                self.cpu_mates.update({f"p{i}": f"d{i}", f"d{i}": f"p{i}"})
                self.pair_cpus(f"p{i}")

    def pair_cpus(self, host: str) -> None:
        """The instances on `host` and its CPU mate (shared_host) take turns at their CPUs when
        they are one prefill and one decode instance (after a role switch made them two of one
        role, neither slows the other: that sharing is not modelled)."""
        mate = self.cpu_mates.get(host)
        if mate is None:
            return
        on = [x for iid, x in [*self.prefill.items(), *self.decode.items()]
              if host_of(iid) in (host, mate)]  # fmt: skip
        pre = [x for x in on if isinstance(x, PrefillInstance)]
        dec = [x for x in on if isinstance(x, DecodeInstance)]
        for x in pre:
            x.host_decode = None
        for y in dec:
            y.host_prefill = None
        if len(pre) == 1 and len(dec) == 1:
            pre[0].host_decode, dec[0].host_prefill = dec[0], pre[0]

    def add_prefill(self, iid: str, host: str = "") -> PrefillInstance:
        """A prefill instance on `host` (default: its id), with its node's store (kept when the
        host changed role before) and a device pool of its own."""
        p, host = self.p, host or iid
        node = f"node-{host}"
        store = self.caches.get(node)
        if store is None and p.dram_blocks > 0:
            store = self.caches[node] = BlockCache(node, self.index, p.dram_blocks, p.ssd_blocks)
        device = None
        if p.device_cache_blocks > 0:
            dev = f"{host}-dev"
            device = self.caches[dev] = BlockCache(dev, self.index, p.device_cache_blocks)
            self.device_nodes.add(dev)
        pre = PrefillInstance(self.loop, iid, p, store, device, self.caches, self._first)
        self.prefill[pre.id] = pre
        self.nodes[pre.id] = tuple(c.node for c in (store, device) if c is not None)
        return pre

    def add_decode(self, iid: str) -> DecodeInstance:
        dec = DecodeInstance(self.loop, iid, self.p, self._done)
        if self.spec.local_correction:
            self.local_corrections[iid] = Correction()
            dec.on_local_first = self._local_first
        # a prefill there keeps to what its streams' TBT objective leaves (DecodeConfig)
        dec.tbt_budget_ms = self.spec.tbt_pace_fraction * paced_slo_ms(
            self.spec.tbt_slo_ms, self.spec.tpot_slo_ms
        )
        self.decode[dec.id] = dec
        return dec

    # ---- routing: the live policy on the simulated cluster's state ----

    def state(self, keys: tuple[int, ...] = ()) -> ClusterState:
        """What the policy (and the planner) judge: the instances not draining, and the index's
        answer for a prompt's block keys (none: no matches)."""
        p, out = self.p, self.draining
        prefill = [
            PrefillCandidate(
                worker_id=iid,
                nodes=self.nodes[iid],
                queue_ms=w.queue_ms(),
                coef=p.prefill_coef,
                queued_tokens=w.queued_tokens,
                cpu_peers=self._cpu_peers(w),
            )
            for iid, w in self.prefill.items()
            if iid not in out
        ]
        decode = [
            DecodeCandidate(
                iid,
                len(d.running) + len(d.joining) + len(d.waiting) + len(d.routed),
                d.free,
                p.kv_blocks,
                d.context_tokens(),
                p.decode_coef,
                True,
                d.seqs(),
                d.waiting_seqs(),
                p.max_batch,
                local_queue_ms=d.local_queue_ms(),
                local_scale=self._local_scale(iid),
            )
            for iid, d in self.decode.items()
            if iid not in out
        ]
        matches = self.index.longest_prefix(keys)
        return ClusterState(
            prefill, decode, matches, p.block_size, p.block_bytes, frozenset(self.device_nodes)
        )

    def _local_scale(self, iid: str) -> float:
        corr = self.local_corrections.get(iid)  # none kept without spec.local_correction
        return corr.ratio_at(self.loop.now / 1000.0) if corr is not None else 1.0

    def _local_first(self, job: Job) -> None:
        """A prompt prefilled on its decode instance gave its first token: measured against the
        TTFT it was routed by, as the live conductor does when the `prefilled` message comes."""
        corr = self.local_corrections[job.decode_id]
        corr.observe(job.first_at - job.arrived, job.decision.predicted_ttft_ms, job.local_ratio,
                     corr.epoch, now=self.loop.now / 1000.0)  # fmt: skip

    @staticmethod
    def _cpu_peers(w: object) -> tuple[str, ...]:
        """The decode instance that takes turns with prefill instance `w` at its host's CPUs
        (shared_host), as the live conductor finds it from the workers' turn locks."""
        peer = w.host_decode if isinstance(w, PrefillInstance) else None
        return (peer.id,) if peer is not None else ()

    def arrive(self, req: SimRequest) -> None:
        spec = self.spec
        info = RequestInfo(req.input_tokens, req.output_tokens, spec.ttft_slo_ms, spec.tbt_slo_ms,
                           tpot_slo_ms=spec.tpot_slo_ms)  # fmt: skip
        try:
            d, how = admit(self.policy, info, self.state(req.keys), spec.admission)
        except Rejected as exc:
            self.rejected.append((req, str(exc)))
            return
        self.best_effort += how == "best_effort"
        job = Job(req, d, self.loop.now, self.p.block_size)
        job.predicted_ms = d.predicted_prefill_ms
        self.jobs.append(job)
        if d.prefill_on_decode and self.spec.colocated:  # one instance does both anyway
            d = d._replace(prefill=d.decode, prefill_on_decode=False)
        if d.prefill_on_decode:  # on the decode instance, between its steps (no store there)
            p = self.p
            job.computed = req.input_tokens
            job.compute_ms = prefill_ms(p.prefill_coef, 0, req.input_tokens, p.chunk_size)
            job.local_ratio = self._local_scale(d.decode)
            self.local_prefills += 1
            dec = self.decode[d.decode]
            assert isinstance(dec, DecodeInstance)  # colocated ones took the branch above
            dec.arrive_local(job)
            return
        if self.spec.colocated and d.decode != d.prefill:
            self.redirected += 1  # one instance does both: it decodes where it prefilled
        job.decode_id = d.prefill if self.spec.colocated else d.decode
        if not self.spec.colocated:
            self.decode[d.decode].routed.append(job)
        self.prefill[d.prefill].submit(job)

    def _first(self, job: Job) -> None:
        if job.remaining <= 0:
            job.done_at = self.loop.now
            if not self.spec.colocated:  # its answer was one token: the decode side never sees it
                self.decode[job.decision.decode].routed.remove(job)
            inst = self.decode.get(job.prefill_id)
            if isinstance(inst, ColocatedInstance):
                inst.free += job.need
            return
        kv = 0.0
        if not self.spec.colocated:
            # Streamed layer by layer while the prefill computes (Mooncake's layer-wise
            # transfer): the decode side waits only for what the compute time did not cover.
            blocks = -(-job.req.input_tokens // self.p.block_size)
            moved = transfer_ms(blocks, self.p.block_bytes, self.p.network_gbps)
            kv = max(0.0, moved - job.compute_ms) + self.p.decode_join_ms

        self.decode[job.decode_id].arrive(job, kv)

    def _done(self, job: Job) -> None:
        pass

    # ---- records ----

    def record_of(self, job: Job) -> ReplayRecord:
        """A job as the replay records it (unfinished: an error)."""
        r, d = job.req, job.decision
        done = job.done_at >= 0
        return ReplayRecord(
            index=r.index,
            policy=self.policy.name,
            arrival_s=r.arrival_ms / 1000.0,
            sent_s=r.arrival_ms / 1000.0,
            status="ok" if done else "error",
            error="" if done else "unfinished when the simulation ended",
            prompt_tokens=r.input_tokens,
            output_tokens=1 + len(job.gaps) if job.first_at >= 0 else 0,
            ttft_ms=job.first_at - job.arrived if job.first_at >= 0 else math.nan,
            gaps_ms=job.gaps,
            e2e_ms=(job.done_at - job.arrived) if done else math.nan,
            cached_tokens=dict(job.cached),
            computed_tokens=job.computed,
            prefill_worker=job.prefill_id,
            decode_worker=job.decode_id,
            predicted_ttft_ms=d.predicted_ttft_ms,
            predicted_tbt_ms=d.predicted_tbt_ms,
        )

    def records(self) -> list[ReplayRecord]:
        name = self.policy.name
        out = [self.record_of(job) for job in self.jobs]
        for r, why in self.rejected:
            out.append(
                ReplayRecord(
                    r.index,
                    name,
                    r.arrival_ms / 1000.0,
                    r.arrival_ms / 1000.0,
                    "rejected",
                    f"RESOURCE_EXHAUSTED: {why}",
                    r.input_tokens,
                    0,
                    math.nan,
                    [],
                    0.0,
                    {"device": 0, "dram": 0, "ssd": 0, "remote": 0},
                    0,
                    "",
                    "",
                )  # fmt: skip
            )
        return sorted(out, key=lambda x: x.index)


def simulate(
    arrivals: list[SimRequest], profile: Profile, spec: ClusterSpec, policy: Policy | None = None
) -> SimResult:
    """Run the arrivals through the cluster to the last answer."""
    if policy is None:
        options = dict(spec.policy_options)
        if spec.policy == "mooncake":
            options.setdefault("transfer_mb_per_ms", profile.network_gbps)
        policy = make_policy(spec.policy, **options)
    sim = _Sim(profile, spec, policy)
    t0 = time.perf_counter()
    for req in arrivals:
        sim.loop.at(req.arrival_ms, sim.arrive, req)
    planner = spec.planner_config
    switcher = None if planner is None else RoleSwitcher(sim, planner, len(arrivals))
    if switcher is not None:
        switcher.start()
    sim.loop.run()
    wall = time.perf_counter() - t0
    end_ms = sim.loop.now
    if switcher is not None:  # its last look came after the last answer
        ends = [j.done_at for j in sim.jobs] + [r.arrival_ms for r in arrivals]
        end_ms = max(ends, default=0.0)
    if sim.redirected:
        log.info(
            "%d decisions named another decode instance; colocated instances decode where they "
            "prefilled",
            sim.redirected,
        )
    records = sim.records()
    report = compute_report(
        records, spec.ttft_slo_ms, spec.tbt_slo_ms, spec.label, tpot_slo_ms=spec.tpot_slo_ms
    )
    return SimResult(
        records, report, sim.loop.events, wall, end_ms / 1000.0, sim.redirected,
        sim.best_effort, sim.local_prefills, [] if switcher is None else switcher.switches,
    )  # fmt: skip
