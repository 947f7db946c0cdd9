"""The runtime planner's rule (conductor.planner) run by the simulator on its instances
(sim.role_switch): the same trace with role switching on and off, and the switch's mechanics
(drain, replacement, abandonment) under a scripted planner."""

from __future__ import annotations

import pytest

import sim.role_switch as role_switch
from client.report import ReplayRecord, compute_report
from conductor.planner import RolePressure, RoleSwitch
from sim import ClusterSpec, Profile, SimResult, sim_config_from_dict, simulate
from sim.arrivals import SimRequest

# 0.5 ms a prompt token; a decode step of 10 ms + 2 ms a sequence, at most 16 sequences (42 ms)
SHIFT = Profile(
    name="shift",
    block_size=16,
    prefill_coef=(0.0, 0.5, 0.0),
    decode_coef=(10.0, 2.0, 0.0),
    block_bytes=1000,
    kv_blocks=4096,
    max_batch=16,
    network_gbps=100.0,
)
SHIFT_MS = 40_000.0
TTFT, TBT = 3000.0, 100.0
BASE = dict(prefill=2, decode=1, ttft_slo_ms=TTFT, tbt_slo_ms=TBT)


def _req(i: int, t_ms: float, prompt: int, out: int) -> SimRequest:
    return SimRequest(i, t_ms, prompt, out, tuple(range(10**6 * i, 10**6 * i + prompt // 16)))


def shifting_trace() -> list[SimRequest]:
    """40 s of long prompts with short answers (1.5 s of prefill each, one a second: two prefill
    instances keep up, one would not), then 80 s of short prompts with long answers (400 tokens,
    1.6 a second: one decode instance serves under 1 a second at its batch bound, two keep up)."""
    arr = [_req(i, 1000.0 * i, 3000, 8) for i in range(40)]
    n = len(arr)
    arr += [_req(n + i, SHIFT_MS + 625.0 * i, 64, 400) for i in range(128)]
    return arr


def _attainment(records: list[ReplayRecord], after: bool) -> float:
    part = [r for r in records if (r.arrival_s * 1000.0 >= SHIFT_MS) == after]
    return compute_report(part, TTFT, TBT).slo_attainment


def _accounted(r: SimResult, n: int) -> None:
    assert len(r.records) == n == len({x.index for x in r.records})
    assert {x.status for x in r.records} <= {"ok", "rejected"}  # none lost or unfinished
    assert r.report.done + r.report.rejected == n and r.report.errors == 0


def _rows(r: SimResult) -> list[tuple]:
    """The records, comparable (nan as None)."""
    return [tuple(None if v != v else v for v in x) for x in r.records]


def test_the_planner_moves_a_prefill_instance_to_decode_when_the_load_shifts():
    arr = shifting_trace()
    off = simulate(arr, SHIFT, ClusterSpec(**BASE))
    on = simulate(arr, SHIFT, ClusterSpec(**BASE, planner={}))  # its default settings
    for r in (off, on):
        _accounted(r, len(arr))
    assert off.role_switches == []
    moves = [(s.from_role, s.to_role, s.outcome) for s in on.role_switches]
    assert ("prefill", "decode", "done") in moves
    first = on.role_switches[0]
    assert first.at_s >= SHIFT_MS / 1000.0  # not while the long prompts needed both
    assert first.new_id == f"{first.worker_id}->d"
    assert any(x.decode_worker == first.new_id for x in on.records)
    assert on.report.policy.endswith(" planner]") and not off.report.policy.endswith("planner]")
    # the long prompts' phase is served as well either way; after the shift one decode instance
    # refuses about a third of the requests, two serve nearly all
    assert _attainment(on.records, after=False) == _attainment(off.records, after=False)
    before, after = _attainment(off.records, after=True), _attainment(on.records, after=True)
    assert before < 0.75 and after > 0.9, (before, after)
    assert on.report.slo_attainment > off.report.slo_attainment + 0.15


def test_without_a_planner_or_one_that_never_switches_the_run_is_unchanged():
    arr = shifting_trace()
    a = simulate(arr, SHIFT, ClusterSpec(**BASE))
    b = simulate(arr, SHIFT, ClusterSpec(**BASE, planner=None))
    # a planner that looks but never finds a role past 1e9 times its objective
    idle = simulate(arr, SHIFT, ClusterSpec(**BASE, planner={"high": 1e9}))
    assert _rows(a) == _rows(b) == _rows(idle)
    assert a.role_switches == b.role_switches == idle.role_switches == []
    assert a.sim_s == b.sim_s == idle.sim_s and a.events == b.events
    assert idle.events > a.events  # its looks, which stopped with the work


def test_a_prefill_bottleneck_moves_no_prefill_instance_away():
    # The sequences routed to the decode instance and still prefilling are in its `waiting`:
    # a prefill backlog is not decode pressure (it once read as 1 + routed / admitted, and the
    # rule moved a prefill instance to decode, lowering attainment from 0.70 to 0.44).
    arr = [_req(i, 500.0 * i, 3000, 8) for i in range(80)]  # 2 long prompts a second
    off = simulate(arr, SHIFT, ClusterSpec(**BASE))
    on = simulate(arr, SHIFT, ClusterSpec(**BASE, planner={}))
    assert on.role_switches == []
    assert on.report.slo_attainment >= off.report.slo_attainment


class Scripted:
    """Stands in for the RolePlanner: asks for each (time s, worker, from, to) once its time
    has come and no switch is under way."""

    def __init__(self, asks: list[tuple[float, str, str, str]]):
        self.asks, self.ended, self.busy = list(asks), [], False

    def look(self, now_s, state, attainment, ttft_slo_ms, tbt_slo_ms):
        names = {w.worker_id for w in (*state.prefill, *state.decode)}
        if self.busy or not self.asks or now_s < self.asks[0][0]:
            return None
        _, worker, frm, to = self.asks.pop(0)
        assert worker in names
        self.busy = True
        return RoleSwitch(worker, frm, to, RolePressure(0.0, 0.0, 0, 0), (0.0, 0.0))

    def switch_ended(self, now_s):
        self.busy = False
        self.ended.append(now_s)


def _scripted(monkeypatch, asks) -> Scripted:
    planner = Scripted(asks)
    monkeypatch.setattr(role_switch, "RolePlanner", lambda config: planner)
    return planner


# with a node store and a device pool per prefill instance, as a prefill host has
CACHED = Profile(**{**SHIFT.__dict__, "dram_blocks": 512, "device_cache_blocks": 256})


def test_a_host_switches_to_decode_and_back_to_prefill(monkeypatch):
    planner = _scripted(monkeypatch, [(5.0, "p1", "prefill", "decode"),
                                      (15.0, "p1->d", "decode", "prefill")])  # fmt: skip
    arr = [_req(i, 250.0 * i, 800 if i % 2 else 64, 4 if i % 2 else 60) for i in range(120)]
    spec = ClusterSpec(prefill=2, decode=1, policy="load_balance", planner={"interval_s": 1.0})
    r = simulate(arr, CACHED, spec)
    _accounted(r, len(arr))
    assert [(s.worker_id, s.new_id, s.outcome) for s in r.role_switches] == [
        ("p1", "p1->d", "done"),
        ("p1->d", "p1", "done"),
    ]
    assert planner.ended == [s.ended_s for s in r.role_switches]
    down, back = r.role_switches
    # routed nothing new while draining and after; each role's instance served in its turn
    assert not [x for x in r.records if x.prefill_worker == "p1" and down.at_s < x.arrival_s
                < back.ended_s]  # fmt: skip
    assert any(x.decode_worker == "p1->d" for x in r.records)
    assert any(x.prefill_worker == "p1" and x.arrival_s > back.ended_s for x in r.records)


def test_a_decode_instance_becomes_a_prefill_one(monkeypatch):
    _scripted(monkeypatch, [(3.0, "d0", "decode", "prefill")])
    arr = [_req(i, 200.0 * i, 1200, 20) for i in range(100)]
    spec = ClusterSpec(prefill=1, decode=2, policy="load_balance", planner={"interval_s": 1.0})
    r = simulate(arr, CACHED, spec)
    _accounted(r, len(arr))
    (switch,) = r.role_switches
    assert (switch.new_id, switch.outcome) == ("d0->p", "done")
    assert any(x.prefill_worker == "d0->p" for x in r.records)
    assert not [x for x in r.records if x.decode_worker == "d0" and x.arrival_s > switch.at_s]


def test_a_shared_host_pairs_its_cpus_again_after_a_switch(monkeypatch):
    peers: list[tuple[float, dict]] = []  # what each look's state says of the CPU turns

    class Recording(Scripted):
        def look(self, now_s, state, *rest):
            peers.append((now_s, {w.worker_id: w.cpu_peers for w in state.prefill}))
            return super().look(now_s, state, *rest)

    planner = Recording([(3.0, "p1", "prefill", "decode"), (10.0, "d1", "decode", "prefill")])
    monkeypatch.setattr(role_switch, "RolePlanner", lambda config: planner)
    arr = [_req(i, 200.0 * i, 600, 8) for i in range(100)]
    spec = ClusterSpec(prefill=2, decode=2, policy="load_balance", planner={"interval_s": 1.0})
    r = simulate(arr, Profile(**{**SHIFT.__dict__, "shared_host": True}), spec)
    _accounted(r, len(arr))
    down, up = r.role_switches
    assert [(s.new_id, s.outcome) for s in (down, up)] == [("p1->d", "done"), ("d1->p", "done")]
    assert peers[0][1] == {"p0": ("d0",), "p1": ("d1",)}
    # host 1 ran two decode instances between the switches: no turns there; host 0 kept its own
    between = [m for t, m in peers if down.ended_s < t < up.at_s]
    assert between and all(m == {"p0": ("d0",)} for m in between)
    # one of each role again: they take turns
    assert peers[-1][1] == {"p0": ("d0",), "d1->p": ("p1->d",)}


def test_an_instance_not_drained_in_time_keeps_its_role(monkeypatch):
    planner = _scripted(monkeypatch, [(2.0, "d0", "decode", "prefill")])
    # answers of 400 tokens at about 15 ms a step: 6 s to drain, against 2 s allowed
    arr = [_req(i, 300.0 * i, 64, 400) for i in range(40)]
    spec = ClusterSpec(prefill=1, decode=2, policy="load_balance",
                       planner={"interval_s": 1.0, "drain_timeout_s": 2.0})  # fmt: skip
    r = simulate(arr, SHIFT, spec)
    _accounted(r, len(arr))
    (switch,) = r.role_switches
    assert (switch.outcome, switch.new_id) == ("abandoned", "")
    assert switch.ended_s - switch.at_s == pytest.approx(2.0)
    assert planner.ended == [switch.ended_s]
    mid = [x for x in r.records if switch.at_s <= x.arrival_s < switch.ended_s]
    assert mid and all(x.decode_worker == "d1" for x in mid)  # drained meanwhile
    assert any(x.decode_worker == "d0" and x.arrival_s > switch.ended_s for x in r.records)


def test_planner_settings_are_checked_and_refused_for_colocated_instances():
    with pytest.raises(ValueError, match="planner: colocated"):
        ClusterSpec(colocated=2, planner={})
    with pytest.raises(ValueError, match="PlannerConfig"):
        ClusterSpec(planner={"interval_s": 0})
    with pytest.raises(ValueError, match="planner: unknown key"):
        ClusterSpec(planner={"intervl_s": 1.0})
    # a sim config's cluster takes the same section
    cfg = sim_config_from_dict({"clusters": [{"prefill": 2, "planner": {"sustain": 2}}]})
    assert cfg.clusters[0].planner == {"sustain": 2}
