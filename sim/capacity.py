"""Mooncake's P:D splits against colocated vLLM-like instances on the same number of instances:
each split (sim.plan) and each colocated configuration (sim.vllm_baseline: a token budget and a
router) swept over the same rates, and the best of each side's effective capacity (the highest
rate keeping `target` of the requests within both objectives, sim.sweep) compared. A sweep stops
at a configuration's first rate below the target: capacity is decided there, and the rates past
it (deep queues) are the slowest to simulate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from client.plot import save_figure
from client.traces import TraceRequest
from sim.arrivals import TraceScaling, make_arrivals
from sim.driver import ClusterSpec, simulate
from sim.plan import splits_of
from sim.profile import Profile
from sim.sweep import SweepPoint, effective_capacity, trace_rate


class Capacity(NamedTuple):
    label: str  # the cluster's label (policy[shape])
    spec: ClusterSpec
    capacity_rps: float  # effective capacity (sim.sweep.effective_capacity)


class SplitsVsColocated(NamedTuple):
    instances: int
    target: float  # attainment an effective rate keeps
    splits: list[Capacity]  # every P:D split, fewest prefill instances first
    colocated: list[Capacity]  # every colocated configuration tried
    best_split: Capacity
    best_colocated: Capacity
    ratio: float  # best split / best colocated capacity (inf: colocated keeps none; nan: neither)
    points: list[SweepPoint]  # the sweeps behind them


def sweep_until_miss(
    reqs: list[TraceRequest], scaling: TraceScaling, profile: Profile, spec: ClusterSpec,
    rate_scales: Sequence[float], target: float,
) -> list[SweepPoint]:  # fmt: skip
    """`spec` at each rate scale in increasing order, up to and with the first below `target`."""
    base = trace_rate(reqs)
    out = []
    for scale in sorted(rate_scales):
        arrivals = make_arrivals(reqs, scaling._replace(rate_scale=scale), profile.block_size)
        r = simulate(arrivals, profile, spec)
        rep = r.report
        out.append(SweepPoint(spec.label, scale, base * scale, rep.slo_attainment, rep.done,
                              rep.rejected, rep.ttft_ms.p90, rep.tbt_ms.p90, r.wall_s))  # fmt: skip
        if rep.slo_attainment < target:
            break
    return out


def splits_vs_colocated(
    reqs: list[TraceRequest],
    scaling: TraceScaling,
    split_profile: Profile,
    colocated_profile: Profile,
    instances: int,
    rate_scales: Sequence[float],
    base: ClusterSpec,
    colocated: Sequence[ClusterSpec],
    target: float,
) -> SplitsVsColocated:
    """Every split of `instances` under `base`'s policy and objectives on `split_profile`, and
    each of `colocated` (their instance count must be `instances`) on `colocated_profile`."""
    if any(c.colocated != instances for c in colocated) or not colocated:
        raise ValueError(f"colocated configurations of {instances} instances each, at least one")
    specs = [ClusterSpec(prefill=p, decode=d, policy=base.policy, ttft_slo_ms=base.ttft_slo_ms,
                         tbt_slo_ms=base.tbt_slo_ms, admission=base.admission,
                         policy_options=dict(base.policy_options))
             for p, d in splits_of(instances)]  # fmt: skip
    points: list[SweepPoint] = []
    done: list[list[Capacity]] = [[], []]
    for side, profile, group in ((0, split_profile, specs), (1, colocated_profile, colocated)):
        for spec in group:
            pts = sweep_until_miss(reqs, scaling, profile, spec, rate_scales, target)
            points += pts
            done[side].append(Capacity(spec.label, spec, effective_capacity(pts, spec.label,
                                                                            target)))  # fmt: skip
    best_split = max(done[0], key=lambda c: c.capacity_rps)
    best_col = max(done[1], key=lambda c: c.capacity_rps)
    a, b = best_split.capacity_rps, best_col.capacity_rps
    ratio = a / b if b > 0 else (math.inf if a > 0 else math.nan)
    return SplitsVsColocated(instances, target, done[0], done[1], best_split, best_col, ratio,
                             points)  # fmt: skip


def format_vs(r: SplitsVsColocated) -> str:
    lines = [f"capacity (req/s at >= {100 * r.target:.0f}% within both objectives), "
             f"{r.instances} instances:"]  # fmt: skip
    for c in r.splits + r.colocated:
        mark = "  <- best of its kind" if c in (r.best_split, r.best_colocated) else ""
        lines.append(f"  {c.label:52} {c.capacity_rps:7.3f}{mark}")
    lines.append(f"  best split / best colocated: {r.ratio:.2f}x")
    return "\n".join(lines)


def plot_vs(results: dict[str, SplitsVsColocated], path: str | Path, title: str = "") -> Path:
    """Capacity against the P:D split, a panel per case (`results`' keys, e.g. a TBT objective),
    the best colocated configuration of the case dashed across it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n + 0.6, 4.0), sharey=True, squeeze=False)
    for ax, (case, r) in zip(axes[0], results.items()):
        names = [f"{c.spec.prefill}P:{c.spec.decode}D" for c in r.splits]
        ax.plot(names, [c.capacity_rps for c in r.splits], "o-", color="C0",
                label=f"{r.splits[0].spec.policy}, P:D split")  # fmt: skip
        best = r.best_colocated
        budget = best.spec.colocated_options.get("max_num_batched_tokens", "default")
        ax.axhline(best.capacity_rps, color="C3", linestyle="--", linewidth=1.4,
                   label=f"best {best.spec.colocated}x colocated {best.spec.colocated_kind}\n"
                   f"({best.spec.policy} router, budget {budget})")  # fmt: skip
        ax.set_title(f"{case}: {r.ratio:.2f}x", fontsize=9)
        ax.set_xlabel("prefill : decode instances")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel(f"capacity (req/s at >= {100 * next(iter(results.values())).target:.0f}"
                          "% good)")  # fmt: skip
    axes[0][0].set_ylim(bottom=0)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)
