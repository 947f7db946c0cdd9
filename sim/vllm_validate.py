"""The vLLM baseline simulated against measured `vllm bench serve` runs: each run's trace on one
simulated vLLM instance (sim.vllm_baseline) with a fitted profile, and the figures bench serve
reports computed alike from both: goodput (requests meeting the TTFT objective and the TPOT one,
TPOT = (end to end - TTFT) / (output tokens - 1), per second of the run) and TTFT p50/p90."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import NamedTuple

import numpy as np
import yaml

from sim.driver import ClusterSpec, simulate
from sim.profile import Profile, profile_to_dict
from sim.validate import relative_error
from sim.vllm_fit import BenchRun, VllmFit


class Outcome(NamedTuple):
    requests: int
    good: int  # requests within both objectives
    duration_s: float  # first arrival to the last answer (bench serve's duration)
    goodput_rps: float  # good / duration_s (bench serve's request_goodput)
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float


def outcome(
    ttft_ms: list[float],
    e2e_ms: list[float],
    outputs: list[int],
    duration_s: float,
    ttft_slo_ms: float,
    tpot_slo_ms: float,
) -> Outcome:
    """bench serve's figures from per-request times (a one-token answer has TPOT 0, as there)."""
    tpot = [(e - t) / (o - 1) if o > 1 else 0.0 for t, e, o in zip(ttft_ms, e2e_ms, outputs)]
    good = sum(t <= ttft_slo_ms and p <= tpot_slo_ms for t, p in zip(ttft_ms, tpot))
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else math.nan  # noqa: E731
    return Outcome(
        len(ttft_ms), good, duration_s, good / duration_s if duration_s > 0 else 0.0,
        pct(ttft_ms, 50), pct(ttft_ms, 90), pct([p for p, o in zip(tpot, outputs) if o > 1], 50),
    )  # fmt: skip


def measured(run: BenchRun, ttft_slo_ms: float, tpot_slo_ms: float) -> Outcome:
    return outcome(run.ttft_ms, run.latency_ms, run.output_tokens, run.duration_s, ttft_slo_ms,
                   tpot_slo_ms)  # fmt: skip


def simulated(
    run: BenchRun, profile: Profile, ttft_slo_ms: float, tpot_slo_ms: float,
    options: dict | None = None,
) -> Outcome:  # fmt: skip
    """The run's trace (its arrival times, lengths and prefixes) on one simulated vLLM."""
    spec = ClusterSpec(
        colocated=1, colocated_kind="vllm", colocated_options=dict(options or {}),
        policy="load_balance", ttft_slo_ms=ttft_slo_ms, tbt_slo_ms=tpot_slo_ms,
    )  # fmt: skip
    recs = [r for r in simulate(run.arrivals, profile, spec).records if r.status == "ok"]
    if len(recs) < len(run.arrivals):
        raise ValueError(f"{run.name}: {len(run.arrivals) - len(recs)} requests unfinished")
    end_s = max(r.arrival_s + r.e2e_ms / 1000.0 for r in recs)
    return outcome([r.ttft_ms for r in recs], [r.e2e_ms for r in recs],
                   [r.output_tokens for r in recs], end_s, ttft_slo_ms, tpot_slo_ms)  # fmt: skip


class Check(NamedTuple):
    run: str  # the result file's name
    rate_rps: float  # the trace's mean arrival rate
    fitted: bool  # the profile was fitted on this run (in sample)
    measured: Outcome
    predicted: Outcome
    goodput_error: float  # (predicted - measured) / measured; NaN where measured is 0
    goodput_diff_rps: float  # predicted - measured, req/s (defined where the ratio is not)
    ttft_p50_error: float
    ttft_p90_error: float


def check_runs(
    runs: list[BenchRun], profile: Profile, fitted: set[str], ttft_slo_ms: float,
    tpot_slo_ms: float,
) -> list[Check]:  # fmt: skip
    out = []
    for run in runs:
        m = measured(run, ttft_slo_ms, tpot_slo_ms)
        p = simulated(run, profile, ttft_slo_ms, tpot_slo_ms)
        arr = run.arrivals
        span = (arr[-1].arrival_ms - arr[0].arrival_ms) / 1000.0
        rate = (len(arr) - 1) / span if span > 0 else math.nan
        out.append(Check(
            Path(run.name).name, rate, run.name in fitted, m, p,
            relative_error(p.goodput_rps, m.goodput_rps), p.goodput_rps - m.goodput_rps,
            relative_error(p.ttft_p50_ms, m.ttft_p50_ms),
            relative_error(p.ttft_p90_ms, m.ttft_p90_ms),
        ))  # fmt: skip
    return out


def format_checks(checks: list[Check]) -> str:
    pc = lambda x: "   n/a" if math.isnan(x) else f"{100 * x:+5.0f}%"  # noqa: E731
    lines = [f"{'run':16} {'req/s':>5} {'set':>8} {'goodput meas/pred (err)':>29} "
             f"{'TTFT p50 meas/pred ms':>27} {'TTFT p90 meas/pred ms':>27}"]  # fmt: skip
    for c in checks:
        m, p = c.measured, c.predicted
        lines.append(
            f"{c.run:16} {c.rate_rps:5.2f} {'fit' if c.fitted else 'held out':>8} "
            f"{m.goodput_rps:7.3f} /{p.goodput_rps:7.3f} ({pc(c.goodput_error)}, "
            f"{c.goodput_diff_rps:+.3f}) {m.ttft_p50_ms:8.0f} /{p.ttft_p50_ms:7.0f} "
            f"({pc(c.ttft_p50_error)}) {m.ttft_p90_ms:8.0f} /{p.ttft_p90_ms:7.0f} "
            f"({pc(c.ttft_p90_error)})"
        )
    return "\n".join(lines)


def profile_yaml(profile: Profile, fit: VllmFit, checks: list[Check], command: str) -> str:
    """The fitted profile as YAML, its header saying what each figure is, how it was fitted and
    how it did against the runs checked (fitted and held out)."""
    d0, d1, d2 = profile.decode_coef
    c0, c1, c2 = profile.prefill_coef
    head = [
        "# vLLM-CPU's engine as sim.vllm_baseline schedules it (ClusterSpec(colocated=N,",
        '# colocated_kind="vllm")): a step carries every running sequence\'s next token and prompt',
        f"# chunks up to max_batch_tokens ({profile.max_batch_tokens}: vLLM's "
        "max_num_batched_tokens), at most",
        f"# max_batch ({profile.max_batch}) sequences, a pool of kv_blocks blocks of block_size "
        "tokens with",
        "# prefix caching. A step takes",
        f"#   ms = {d0:.3f} + {d1:.4f} * decodes + {d2:.3g} * their KV tokens  (decode_coef)",
        f"#      + if it prefills: {c0:.3f} + {c1:.4f} * prompt tokens",
        f"#        + {c2:.3g} * sum of chunk tokens x where each chunk ends (prefill_coef)",
        f"# and a request reaches the scheduler decode_join_ms ({fit.intake_ms:g} ms) after it is",
        f"# sent. {fit.steps} steps rebuilt from the clients' token times, {fit.busy_steps} fitted "
        "(the",
        "# method: sim/vllm_fit.py). Written by",
        *textwrap.wrap(command, 96, initial_indent="#   ", subsequent_indent="#     ",
                       break_on_hyphens=False),  # fmt: skip
        "# Simulated against the runs (bench serve's figures, sim.vllm_validate; 'fit' = in",
        "# sample, 'held out' = not):",
    ]
    head += [f"#   {line}" for line in format_checks(checks).splitlines()]
    text = yaml.safe_dump(profile_to_dict(profile), sort_keys=False, width=100)
    return "\n".join(head) + "\n" + text
