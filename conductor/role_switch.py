"""The runtime planner's thread: every `planner.interval_s` it builds the ClusterState the router
would judge, takes the attainment of the requests judged since its last look, and asks the rule
(conductor/planner.py) whether a worker should change role. A switch drains the worker (nothing
new is routed to it; its requests run to their end), asks it to switch (WorkerRole.SwitchRole:
it keeps its weights), waits until it answers as its new role and puts it in that role's list.
No request is lost or cut short: a worker not drained in `drain_timeout_s` keeps its role."""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

import grpc

from conductor.config import ConductorConfig
from conductor.estimates import paced_slo_ms
from conductor.fleet import AnyWorker, DecodeWorker, Fleet, PrefillWorker
from conductor.metrics import ConductorMetrics, Totals
from conductor.planner import RolePlanner, RoleSwitch, role_pressure
from conductor.routing import Router
from conductor.state import cluster_state
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from servekit import work_left

log = logging.getLogger(__name__)

_POLL_S = 0.05  # between two looks at a draining worker's bookings


class SwitchRecord(NamedTuple):
    """One switch the planner asked for, and how it went."""

    worker_id: str
    from_role: str
    to_role: str
    outcome: str  # done | abandoned (not drained in time) | failed (refused, or never rejoined)
    drain_s: float  # from the worker's last routing to its last request's end
    total_s: float  # from the decision to the worker serving its new role (or giving up)
    pressure: tuple[float, float]  # (prefill, decode) pressure that asked for it
    message: str = ""  # why it was abandoned or failed


class RoleSwitcher:
    """Runs the planner on the fleet (`start` does nothing unless config.role_switching)."""

    def __init__(
        self,
        config: ConductorConfig,
        fleet: Fleet,
        router: Router,
        totals: Totals,
        metrics: ConductorMetrics,
    ):
        self.config = config
        self.planner = RolePlanner(config.planner)
        self.records: list[SwitchRecord] = []  # every switch asked for, in order
        self._fleet, self._router, self._totals, self._metrics = fleet, router, totals, metrics
        self._judged = self._counts()  # (good, all) judged before the previous look
        self._quit = threading.Event()
        self._thread: threading.Thread | None = None
        self._count_roles()

    def start(self) -> None:
        if not self.config.role_switching:
            return
        self._thread = threading.Thread(target=self._run, name="conductor-planner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._quit.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._quit.wait(self.config.planner.interval_s):
            try:
                self.look()
            except Exception:  # the planner is optional: routing goes on without it
                self._metrics.errors.labels("role_planner").inc()
                log.exception("runtime planner: a look failed")

    # ---- one look ----

    def look(self) -> SwitchRecord | None:
        """One look at the roles; the switch it made, if any (run to its end)."""
        cfg = self.config
        state = cluster_state(self._fleet, {}, cfg)
        # the objective decode steps are paced by: TBT, or TPOT where only that is judged
        step_slo_ms = paced_slo_ms(cfg.tbt_slo_ms, cfg.tpot_slo_ms)
        pressure = role_pressure(state, cfg.ttft_slo_ms, step_slo_ms)
        self._metrics.role_pressure.labels("prefill").set(pressure.prefill)
        self._metrics.role_pressure.labels("decode").set(pressure.decode)
        switch = self.planner.look(
            time.monotonic(), state, self._attainment(), cfg.ttft_slo_ms, step_slo_ms
        )
        if switch is None:
            return None
        t0 = time.monotonic()
        try:
            record = self._switch(switch, t0)
        finally:
            self.planner.switch_ended(time.monotonic())
        self.records.append(record)
        self._metrics.role_switches.labels(record.from_role, record.to_role, record.outcome).inc()
        self._count_roles()
        how = log.info if record.outcome == "done" else log.warning
        how("runtime planner: %s %s -> %s %s in %.1f s (drained in %.1f s; pressures prefill "
            "%.2f, decode %.2f)%s", record.worker_id, record.from_role, record.to_role,
            record.outcome, record.total_s, record.drain_s, *record.pressure,
            f": {record.message}" if record.message else "")  # fmt: skip
        return record

    def _attainment(self) -> float | None:
        """The share of the requests judged since the previous look that met their objectives
        (refused ones count as missed); None when none was judged."""
        good, judged = self._counts()
        before_good, before = self._judged
        self._judged = (good, judged)
        return (good - before_good) / (judged - before) if judged > before else None

    def _counts(self) -> tuple[int, int]:
        t = self._totals
        with t.lock:
            return t.slo_met, t.slo_met + t.slo_missed + t.rejected

    def _count_roles(self) -> None:
        self._metrics.role_workers.labels("prefill").set(len(self._fleet.prefill))
        self._metrics.role_workers.labels("decode").set(len(self._fleet.decode))

    # ---- one switch ----

    def _switch(self, s: RoleSwitch, t0: float) -> SwitchRecord:
        def record(outcome: str, drain_s: float, message: str = "") -> SwitchRecord:
            return SwitchRecord(s.worker_id, s.from_role, s.to_role, outcome, drain_s,
                                time.monotonic() - t0, s.before[:2], message)  # fmt: skip

        worker = self._fleet.find(s.worker_id)
        if worker is None or worker.kind != s.from_role:
            return record("failed", 0.0, f"no {s.from_role} worker {s.worker_id} in the fleet")
        with self._fleet.lock:
            worker.draining = True
        self._router.settle()  # what was being routed to it is booked now
        problem = self._drain(worker, t0 + self.config.planner.drain_timeout_s)
        drain_s = time.monotonic() - t0
        if problem:
            with self._fleet.lock:
                worker.draining = False
            return record("abandoned", drain_s, problem)
        try:
            reply = pb_grpc.WorkerRoleStub(worker.channel).SwitchRole(
                pb.SwitchRoleRequest(role=s.to_role), timeout=self.config.load_timeout_s
            )
        except grpc.RpcError as exc:
            with self._fleet.lock:
                worker.draining = False
            return record("failed", drain_s, f"SwitchRole: {exc.code().name}: {exc.details()}")
        if not reply.switching:
            log.info("worker %s already served %s", s.worker_id, reply.role)
        new_cls = PrefillWorker if s.to_role == "prefill" else DecodeWorker
        new: AnyWorker = new_cls(worker.address, self.config.security)
        new.draining = True  # until it answers as its new role
        self._fleet.replace(worker, new)
        rejoin_by = time.monotonic() + self.config.planner.rejoin_timeout_s
        problem = self._rejoin(new, s.to_role, rejoin_by)
        with self._fleet.lock:
            new.draining = False  # routed to again as soon as a load report says it is healthy
        return record("failed" if problem else "done", drain_s, problem)

    def _drain(self, worker: AnyWorker, deadline: float) -> str:
        """Wait until the conductor has no request booked on `worker` and the worker reports
        none held; '' when drained, else why not."""
        while True:
            with self._fleet.lock:
                booked = len(worker.inflight)
            held = -1
            if not booked:
                try:
                    held = work_left(worker.stub.Load(pb.LoadRequest(), timeout=2.0))
                except grpc.RpcError as exc:
                    return f"Load: {exc.code().name}: {exc.details()}"
                if not held:
                    return ""
            if self._quit.is_set():
                return "the conductor is stopping"
            if time.monotonic() > deadline:
                return (f"{booked or held} request(s) still on it after "
                        f"{self.config.planner.drain_timeout_s:g} s")  # fmt: skip
            time.sleep(_POLL_S)

    def _rejoin(self, new: AnyWorker, role: str, deadline: float) -> str:
        """Wait until the worker answers Load as `role`, then refresh the fleet's loads; '' when
        it did, else why not."""
        last = "no answer"
        while not self._quit.is_set() and time.monotonic() < deadline:
            try:
                load = new.stub.Load(pb.LoadRequest(), timeout=2.0)
                if load.kind == role:
                    self._fleet.refresh_loads()
                    return ""
                last = f"it answers as {load.kind}"
            except grpc.RpcError as exc:
                last = f"{exc.code().name}"  # its old server stopped, the new one is loading
            time.sleep(0.1)
        return f"did not answer as {role} ({last})"
