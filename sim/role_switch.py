"""The runtime planner on the simulated cluster: every `interval_s` of simulated time the live
rule (conductor.planner.RolePlanner) looks at the same ClusterState the routing policy judges and
the attainment of the requests judged since its last look; a switch it asks for drains the named
instance (routed nothing new, left out of the planner's state too) and, once nothing is left on
it, replaces it with a fresh instance of the other role on the same host. One not drained within
`drain_timeout_s` keeps its role (abandoned)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from client.report import meets_slo
from conductor.estimates import paced_slo_ms
from conductor.planner import PlannerConfig, RolePlanner, RoleSwitch
from sim.instances import DecodeInstance, Job, PrefillInstance

if TYPE_CHECKING:
    from sim.driver import _Sim


class SwitchRecord(NamedTuple):
    """One switch the planner asked for, and how it ended."""

    at_s: float  # simulated s when the planner asked for it
    worker_id: str  # the instance drained
    from_role: str  # "prefill" | "decode"
    to_role: str
    outcome: str  # "done" (drained and replaced) | "abandoned" (not drained in time)
    ended_s: float  # when it was replaced or given up
    new_id: str  # the instance that took its place ("" when abandoned)


def new_id(iid: str, to_role: str) -> str:
    """The id of `iid`'s host in `to_role`: the host's own id in the role it started in, else
    the host and the role's letter ("p1" -> "p1->d" -> "p1")."""
    host = host_of(iid)
    return host if host[:1] == to_role[:1] else f"{host}->{to_role[:1]}"


def host_of(iid: str) -> str:
    return iid.split("->")[0]


class RoleSwitcher:
    """Drives a RolePlanner on a simulation from its event loop (call `start` once the
    arrivals are scheduled). Its timer stops once every arrival is in and nothing is left that
    could still happen, so the loop ends as it would without it."""

    def __init__(self, sim: _Sim, config: PlannerConfig, arrivals: int):
        self.sim, self.config, self.arrivals = sim, config, arrivals
        self.planner = RolePlanner(config)
        self.switches: list[SwitchRecord] = []
        self._pending: list[Job] = []  # admitted, not done: not judged yet
        self._seen_jobs = self._seen_rejected = 0
        self._switch: RoleSwitch | None = None  # the one under way
        self._since_ms = 0.0  # when it started

    def start(self) -> None:
        self.sim.loop.after(self.config.interval_s * 1000.0, self._tick)

    # ---- the planner's look, every interval ----

    def _tick(self) -> None:
        sim = self.sim
        now = sim.loop.now
        attainment = self._attainment()
        if self._switch is not None:
            self._progress(now)
        if self._idle():
            if self._switch is not None:  # nothing left that could drain it
                self._end(now, "abandoned", "")
            return
        spec = sim.spec
        switch = self.planner.look(
            now / 1000.0, sim.state(), attainment, spec.ttft_slo_ms,
            paced_slo_ms(spec.tbt_slo_ms, spec.tpot_slo_ms),
        )
        if switch is not None:
            self._switch, self._since_ms = switch, now
            sim.draining.add(switch.worker_id)
            self._progress(now)  # one with nothing on it switches at once
        sim.loop.after(self.config.interval_s * 1000.0, self._tick)

    def _attainment(self) -> float | None:
        """The share of the requests whose outcome became known since the last look that met
        both objectives, as the report judges them (rejected: missed); None when none did."""
        sim = self.sim
        self._pending.extend(sim.jobs[self._seen_jobs :])
        self._seen_jobs = len(sim.jobs)
        ttft, tbt, tpot = sim.spec.ttft_slo_ms, sim.spec.tbt_slo_ms, sim.spec.tpot_slo_ms
        judged = len(sim.rejected) - self._seen_rejected
        self._seen_rejected = len(sim.rejected)
        done = [j for j in self._pending if j.done_at >= 0]
        self._pending = [j for j in self._pending if j.done_at < 0]
        judged += len(done)
        met = sum(meets_slo(sim.record_of(j), ttft, tbt, tpot) for j in done)
        return met / judged if judged else None

    def _idle(self) -> bool:
        """Every arrival in and nothing that could still happen (a job waiting for a decode
        pool that nothing frees stays unfinished, as without the planner)."""
        sim = self.sim
        if len(sim.jobs) + len(sim.rejected) < self.arrivals:
            return False
        pre = [w for w in sim.prefill.values() if isinstance(w, PrefillInstance)]
        dec = [d for d in sim.decode.values() if isinstance(d, DecodeInstance)]
        if any(w.queue or w.busy for w in pre) or any(d.stepping or d.joining for d in dec):
            return False
        return not any(self._answering(j) for j in self._pending)

    @staticmethod
    def _answering(job: Job) -> bool:
        """Prefilled (or prefilling) on a prefill instance, its answer not back yet."""
        return job.first_at < 0 and not job.decision.prefill_on_decode

    # ---- the switch under way ----

    def _progress(self, now: float) -> None:
        switch = self._switch
        assert switch is not None
        iid = switch.worker_id
        if self._drained(iid):
            new = new_id(iid, switch.to_role)
            self._replace(iid, new, switch.to_role)
            self._end(now, "done", new)
        elif now - self._since_ms >= self.config.drain_timeout_s * 1000.0:
            self._end(now, "abandoned", "")

    def _drained(self, iid: str) -> bool:
        sim = self.sim
        pre = sim.prefill.get(iid)
        if isinstance(pre, PrefillInstance):
            answering = any(j.prefill_id == iid and self._answering(j) for j in self._pending)
            return not (pre.queue or pre.busy or answering)
        dec = sim.decode[iid]
        assert isinstance(dec, DecodeInstance)  # colocated specs take no planner
        return not (
            dec.running or dec.joining or dec.waiting or dec.routed or dec.local or dec.stepping
        )

    def _replace(self, iid: str, new: str, to_role: str) -> None:
        """The drained instance gives way to a fresh one of `to_role` on its host. A prefill
        instance's device pool goes with it (its blocks leave the index); its node's store
        stays, a remote source for the others, and its own again if the host switches back."""
        sim = self.sim
        if to_role == "decode":
            old = sim.prefill.pop(iid)
            sim.nodes.pop(iid)
            device = getattr(old, "device", None)
            if device is not None:
                device.set_fast_capacity(0)  # one tier: every block dropped
                sim.caches.pop(device.node, None)
                sim.device_nodes.discard(device.node)
            sim.add_decode(new)
        else:
            assert isinstance(sim.decode[iid], DecodeInstance)
            del sim.decode[iid]
            sim.add_prefill(new, host_of(iid))
        sim.pair_cpus(host_of(iid))  # shared_host: what now runs on the host takes turns

    def _end(self, now: float, outcome: str, new: str) -> None:
        switch = self._switch
        assert switch is not None
        self.sim.draining.discard(switch.worker_id)
        at = self._since_ms / 1000.0
        self.switches.append(SwitchRecord(at, *switch[:3], outcome, now / 1000.0, new))
        self._switch = None
        self.planner.switch_ended(now / 1000.0)
