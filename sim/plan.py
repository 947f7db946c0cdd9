"""`halfmoon plan`: the prefill:decode split of a fixed number of instances, chosen by simulation.
Every split (1 prefill .. N-1, the rest decode) is swept over the same arrival rates on the trace,
with the live policy code, and the split that keeps the objectives at the highest rate (the
effective capacity, sim.sweep) is recommended; each split's capacity is reported beside it, so a
near tie reads as one. Dynamo's planner and llm-d's autoscaler make the same call from load; this
one makes it from a trace before launch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from client.plot import save_figure
from client.traces import TraceRequest
from sim.arrivals import TraceScaling
from sim.driver import ClusterSpec
from sim.profile import Profile
from sim.sweep import SweepPoint, effective_capacity, sweep


class SplitCapacity(NamedTuple):
    prefill: int  # prefill instances
    decode: int  # decode instances
    capacity_rps: float  # highest rate keeping the target attainment (sim.sweep)
    label: str  # the sweep's cluster label


class Plan(NamedTuple):
    instances: int
    target: float  # the attainment an effective rate keeps
    splits: list[SplitCapacity]  # every split tried, fewest prefill instances first
    best: SplitCapacity  # the highest capacity (ties: fewer prefill instances)
    points: list[SweepPoint]  # the sweep behind it


def splits_of(instances: int) -> list[tuple[int, int]]:
    """Every (prefill, decode) split of `instances`, at least one of each."""
    if instances < 2:
        raise ValueError(f"--instances: a split needs at least 2 instances, got {instances}")
    return [(p, instances - p) for p in range(1, instances)]


def plan_split(
    reqs: list[TraceRequest],
    scaling: TraceScaling,
    profile: Profile,
    instances: int,
    rate_scales: Sequence[float],
    base: ClusterSpec,
    target: float,
) -> Plan:
    """Sweep every split of `instances` (the policy and objectives of `base`) over `rate_scales`
    and rank them by effective capacity."""
    specs = [
        ClusterSpec(
            prefill=p,
            decode=d,
            policy=base.policy,
            policy_options=dict(base.policy_options),
            ttft_slo_ms=base.ttft_slo_ms,
            tbt_slo_ms=base.tbt_slo_ms,
            admission=base.admission,
        )
        for p, d in splits_of(instances)
    ]
    points = sweep(reqs, scaling, profile, specs, rate_scales)
    splits = [
        SplitCapacity(s.prefill or 0, s.decode or 0, effective_capacity(points, s.label, target),
                      s.label)  # fmt: skip
        for s in specs
    ]
    best = max(splits, key=lambda s: (s.capacity_rps, -s.prefill))
    return Plan(instances, target, splits, best, points)


def format_plan(plan: Plan) -> str:
    lines = [f"P:D split of {plan.instances} instances, capacity at >= "
             f"{100 * plan.target:.0f}% of requests within both objectives:"]  # fmt: skip
    for s in plan.splits:
        mark = "  <- recommended" if s == plan.best and s.capacity_rps > 0 else ""
        lines.append(f"  {s.prefill}P:{s.decode}D  {s.capacity_rps:7.3f} req/s{mark}")
    if plan.best.capacity_rps <= 0:
        lines.append("  none keeps the target even at the lowest rate swept: no recommendation "
                     "(sweep lower --rates, or looser objectives)")  # fmt: skip
    return "\n".join(lines)


def plot_plan(plan: Plan, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    names = [f"{s.prefill}P:{s.decode}D" for s in plan.splits]
    colors = ["tab:green" if s == plan.best else "tab:gray" for s in plan.splits]
    ax.bar(names, [s.capacity_rps for s in plan.splits], color=colors)
    ax.set_xlabel("prefill : decode instances")
    ax.set_ylabel(f"capacity (req/s at >= {100 * plan.target:.0f}% good)")
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    return save_figure(fig, path)
