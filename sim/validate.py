"""Simulated against real: the slice a `halfmoon replay` output folder replayed, simulated once
per policy it holds on a cluster of the same shape, with the same report computed from both."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np

from client.report import Report, compute_report, read_records
from client.traces import load_trace
from sim.arrivals import TraceScaling, make_arrivals
from sim.driver import ClusterSpec, simulate
from sim.profile import Profile

# ConductorConfig fields the mooncake policy is built with (conductor.routing.make_policies)
POLICY_OPTIONS = ("local_prefill_tokens", "kvcache_balancing_threshold")


class Comparison(NamedTuple):
    policy: str
    real: Report
    sim: Report
    ttft_p50_error: float  # (sim - real) / real
    ttft_p90_error: float
    attainment_error_pts: float  # sim - real, in percentage points
    tpot_p50_error: float = math.nan  # TPOT: (end to end - TTFT) / (answer tokens - 1)
    goodput_error: float = math.nan  # requests within both objectives per second
    # Where the simulated TTFT p50 falls among the real requests' TTFTs, less 50 (percentile
    # points): a distribution with two modes (one-token prompts at ~40 ms, longer ones from
    # ~150 ms) has its p50 in the gap between them, where one request crossing it moves the p50
    # by 2x but this by 1/n. 0 = the sim's median is the real one.
    ttft_p50_rank_pts: float = math.nan
    # the real TTFT p50's 95% bootstrap interval (ms): how well one run fixes it at all
    real_ttft_p50_ci: tuple[float, float] = (math.nan, math.nan)


def relative_error(sim: float, real: float) -> float:
    """(sim - real) / real; nan when either is nan or real is not positive."""
    if math.isnan(sim) or math.isnan(real) or real <= 0:
        return math.nan
    return (sim - real) / real


def compare_run(
    run_dir: str | Path,
    profile: Profile,
    trace: str | Path | None = None,
    conductor: dict | None = None,
) -> list[Comparison]:
    """One comparison per policy the run replayed. `conductor`: the live conductor's settings
    the policy and admission ran with (its `local_prefill_tokens`, `kvcache_balancing_threshold`,
    `admission`; absent ones at their defaults), so that the simulated policy decides alike; and
    `local_correction: false` where the conductor predates that correction."""
    conductor = conductor or {}
    options = {k: conductor[k] for k in POLICY_OPTIONS if k in conductor}
    d = Path(run_dir)
    summary = json.loads((d / "report.json").read_text(encoding="utf-8"))
    sc = summary["scaling"]
    scaling = TraceScaling(
        length_scale=sc["length_scale"],
        rate_scale=1.0 / sc["time_scale"],
        max_output=sc.get("max_output"),
        max_input=sc.get("max_input"),
        trace_block_tokens=sc.get("trace_block_tokens", 512),
    )
    reqs = load_trace(trace or summary["trace"], "auto", summary["requests"])
    arrivals = make_arrivals(reqs, scaling, profile.block_size)
    cluster = summary.get("cluster") or {}
    if not cluster and (d / "cluster.json").is_file():
        cluster = json.loads((d / "cluster.json").read_text(encoding="utf-8"))
    kinds = [w.get("load", {}).get("kind") for w in cluster.get("workers", [])]
    n_pre, n_dec = max(1, kinds.count("prefill")), max(1, kinds.count("decode"))
    out = []
    for rep in summary["reports"]:
        policy = rep["policy"] or "mooncake"
        real = read_records(d / f"records-{rep['policy'] or 'default'}.jsonl")
        real_report = compute_report(real, rep["ttft_slo_ms"], rep["tbt_slo_ms"], policy)
        spec = ClusterSpec(
            prefill=n_pre,
            decode=n_dec,
            policy=policy,
            ttft_slo_ms=rep["ttft_slo_ms"],
            tbt_slo_ms=rep["tbt_slo_ms"],
            admission=conductor.get("admission", "reject"),
            local_correction=conductor.get("local_correction", True),
            policy_options=dict(options) if policy == "mooncake" else {},
        )
        sim_run = simulate(arrivals, profile, spec)
        s = sim_run.report
        real_ttfts = answered_ttfts(real)
        out.append(
            Comparison(
                policy,
                real_report,
                s,
                relative_error(s.ttft_ms.p50, real_report.ttft_ms.p50),
                relative_error(s.ttft_ms.p90, real_report.ttft_ms.p90),
                100.0 * (s.slo_attainment - real_report.slo_attainment),
                relative_error(tpot_p50(sim_run.records), tpot_p50(real)),
                relative_error(s.goodput_rps, real_report.goodput_rps),
                rank_pts(real_ttfts, s.ttft_ms.p50),
                bootstrap_ci(real_ttfts, 50.0),
            )
        )
    return out


def answered_ttfts(records) -> np.ndarray:
    return np.array([r.ttft_ms for r in records if r.status == "ok" and not math.isnan(r.ttft_ms)])


def rank_pts(values: np.ndarray, x: float) -> float:
    """The percentile of `values` at which `x` lies (ties counted half), less 50."""
    if not len(values) or math.isnan(x):
        return math.nan
    below, equal = float(np.sum(values < x)), float(np.sum(values == x))
    return 100.0 * (below + equal / 2) / len(values) - 50.0


def bootstrap_ci(values: np.ndarray, q: float, rounds: int = 1000) -> tuple[float, float]:
    """The 95% bootstrap interval of percentile `q` of `values` (a fixed seed: the same
    interval from the same run)."""
    if len(values) < 2:
        return (math.nan, math.nan)
    rng = np.random.default_rng(0)
    picks = rng.choice(values, size=(rounds, len(values)), replace=True)
    qs = np.percentile(picks, q, axis=1)
    return (float(np.percentile(qs, 2.5)), float(np.percentile(qs, 97.5)))


def tpot_p50(records) -> float:
    """The median TPOT over answered requests of two or more tokens (as vLLM's bench serve
    counts it: the time after the first token over the tokens after it)."""
    tpot = [(r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1) for r in records
            if r.status == "ok" and r.output_tokens > 1]  # fmt: skip
    return float(np.median(tpot)) if tpot else math.nan


def format_comparisons(rows: list[Comparison]) -> str:
    lines = [
        f"{'policy':14} {'TTFT p50 real/sim ms':>24} {'TTFT p90 real/sim ms':>24} "
        f"{'attainment real/sim':>22} {'TPOT p50 err':>12} {'goodput real/sim req/s':>26} "
        f"{'sim p50 at real pct':>19} {'real p50 95% CI ms':>19}"
    ]
    for c in rows:
        real, sim = c.real, c.sim
        lines.append(
            f"{c.policy:14} {real.ttft_ms.p50:9.0f} /{sim.ttft_ms.p50:7.0f} "
            f"({100 * c.ttft_p50_error:+4.0f}%) {real.ttft_ms.p90:9.0f} /{sim.ttft_ms.p90:7.0f} "
            f"({100 * c.ttft_p90_error:+4.0f}%) {100 * real.slo_attainment:8.1f}% /"
            f"{100 * sim.slo_attainment:5.1f}% ({c.attainment_error_pts:+.1f} pts) "
            f"{100 * c.tpot_p50_error:+11.0f}% {real.goodput_rps:11.3f} /{sim.goodput_rps:6.3f} "
            f"({100 * c.goodput_error:+4.0f}%) {50 + c.ttft_p50_rank_pts:16.0f}th "
            f"{c.real_ttft_p50_ci[0]:9.0f}-{c.real_ttft_p50_ci[1]:<6.0f}"
        )
    return "\n".join(lines)
