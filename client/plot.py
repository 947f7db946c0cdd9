"""The replay's PNG: TTFT and TBT CDFs, one line per policy, SLOs marked."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from client.report import ReplayRecord, request_tbt


def save_figure(fig, path: str | Path) -> Path:
    """Lay `fig` out, write it to `path` as a PNG (its folder made), close it: the end of every
    plot the project draws."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf(values: list[float]) -> tuple[np.ndarray, np.ndarray]:
    # a log axis: zero gaps (one-token answers) have no place on it
    v = np.sort(np.asarray([x for x in values if not math.isnan(x) and x > 0], dtype=np.float64))
    return v, np.arange(1, v.size + 1) / max(v.size, 1)


def plot_cdfs(
    by_policy: dict[str, list[ReplayRecord]],
    ttft_slo_ms: float,
    tbt_slo_ms: float,
    path: str | Path,
    title: str = "",
) -> Path:
    """Write the PNG; requests that got no answer are left out of the curves (the report counts
    them)."""
    import matplotlib

    matplotlib.use("Agg")  # no display here; must precede pyplot
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (
        ("TTFT (ms)", ttft_slo_ms, lambda r: r.ttft_ms),
        ("TBT, mean of slowest 10% gaps (ms)", tbt_slo_ms, lambda r: request_tbt(r.gaps_ms)),
    )
    for ax, (label, slo, metric) in zip(axes, panels):
        for policy, records in by_policy.items():
            x, y = _cdf([metric(r) for r in records if r.status == "ok"])
            if x.size:
                ax.step(
                    x,
                    y,
                    where="post",
                    label=f"{policy or 'default'} ({x.size} done / {len(records)})",
                )
        if slo > 0:  # 0: not judged
            ax.axvline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo:.0f} ms")
        # Latencies span decades (a cached prefix against a queue): a log axis shows them all.
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("share of answered requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)
