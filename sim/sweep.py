"""Capacity sweep: SLO attainment against request rate (the trace time-scaled), per cluster and
policy, and the effective request capacity each sustains (Mooncake's measure: the highest rate
at which the share of requests meeting both SLOs stays at or above a target)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from client.plot import save_figure
from client.traces import TraceRequest
from sim.arrivals import TraceScaling, make_arrivals
from sim.driver import ClusterSpec, simulate
from sim.profile import Profile

DEFAULT_TARGET = 0.9  # attainment an "effective" rate must keep


class SweepPoint(NamedTuple):
    label: str  # policy[shape]
    rate_scale: float
    request_rate: float  # requests per second offered
    attainment: float  # share of all requests meeting both SLOs
    done: int
    rejected: int
    ttft_p90_ms: float
    tbt_p90_ms: float
    wall_s: float  # time the simulation took


def trace_rate(reqs: Sequence[TraceRequest]) -> float:
    """The trace's mean arrival rate (requests per second)."""
    if len(reqs) < 2:
        raise ValueError("a sweep needs a trace of at least 2 requests")
    span = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000.0
    if span <= 0:
        raise ValueError("the trace's requests all arrive at once: no rate to scale")
    return (len(reqs) - 1) / span


def sweep(
    reqs: list[TraceRequest],
    scaling: TraceScaling,
    profile: Profile,
    specs: Sequence[ClusterSpec],
    rate_scales: Sequence[float],
) -> list[SweepPoint]:
    base = trace_rate(reqs)
    out = []
    for scale in rate_scales:
        arrivals = make_arrivals(reqs, scaling._replace(rate_scale=scale), profile.block_size)
        for spec in specs:
            r = simulate(arrivals, profile, spec)
            rep = r.report
            out.append(
                SweepPoint(
                    spec.label,
                    scale,
                    base * scale,
                    rep.slo_attainment,
                    rep.done,
                    rep.rejected,
                    rep.ttft_ms.p90,
                    rep.tbt_ms.p90,
                    r.wall_s,
                )
            )
    return out


def effective_capacity(points: Sequence[SweepPoint], label: str, target: float) -> float:
    """The highest rate at which `label` keeps `target` attainment, interpolated between the
    last rate that keeps it and the next that does not; 0 when even the lowest rate misses it,
    and the highest rate swept when none misses it."""
    pts = sorted((p for p in points if p.label == label), key=lambda p: p.request_rate)
    best = 0.0
    for a, b in zip([None, *pts], pts):
        if b.attainment >= target:
            best = b.request_rate
            continue
        if a is not None and a.attainment >= target:
            share = (a.attainment - target) / (a.attainment - b.attainment)
            best = a.request_rate + share * (b.request_rate - a.request_rate)
        break
    return best


def format_sweep(points: Sequence[SweepPoint], target: float) -> str:
    labels = list(dict.fromkeys(p.label for p in points))
    rates = sorted({(p.rate_scale, p.request_rate) for p in points})
    w = max(12, *(len(x) for x in labels))
    lines = ["rate x  req/s  " + "  ".join(x.rjust(w) for x in labels)]
    for scale, rate in rates:
        row = [f"{scale:6.2f}  {rate:5.2f}"]
        for label in labels:
            p = next((q for q in points if q.label == label and q.rate_scale == scale), None)
            row.append(("-" if p is None else f"{100 * p.attainment:.1f}%").rjust(w))
        lines.append("  ".join(row))
    lines.append(f"effective capacity (req/s at >= {100 * target:.0f}% attainment):")
    base = None
    for label in labels:
        cap = effective_capacity(points, label, target)
        rel = ""
        if base is None:
            base = cap
        elif base > 0:
            rel = f"  ({100 * (cap / base - 1):+.0f}% vs {labels[0]})"
        lines.append(f"  {label.ljust(w)}  {cap:.3f}{rel}")
    return "\n".join(lines)


def plot_sweep(points: Sequence[SweepPoint], target: float, path: str | Path, title: str = ""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label in dict.fromkeys(p.label for p in points):
        pts = sorted((p for p in points if p.label == label), key=lambda p: p.request_rate)
        cap = effective_capacity(points, label, target)
        ax.plot(
            [p.request_rate for p in pts],
            [100 * p.attainment for p in pts],
            marker="o",
            label=f"{label}: {cap:.2f} req/s",
        )
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def finite(x):
    """JSON without NaN."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x
