"""The simulator's three figures, in one run:

1. scale: the whole shipped synthetic trace (3,993 requests) on 16 prefill + 16 decode instances
   of the paper-setting profile under Mooncake's policy; wall time, events/s, requests/s.
2. the paper's experiment: effective request capacity (the highest rate keeping --target SLO
   attainment, TTFT <= 30 s) of Mooncake's policy on 3P+1D and 2P+2D against four colocated
   vLLM-like instances with local prefix caching under load balancing, at TBT 100/200/300 ms,
   the trace time-scaled over --rates.
3. simulated against real: a `halfmoon replay` output folder (--real-run; records-*.jsonl and
   report.json, with the workers' load reports) is fitted into a profile (`halfmoon
   fit-profile`) and its slice simulated per policy; TTFT p50/p90 and attainment compared.
   Without --real-run this part is skipped and its keys are null (a real replay takes minutes:
   see README "Simulator").

    .venv/bin/python bench/sim.py [--real-run runs/sim-validation] [--rates 0.1,0.2,...]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import finish  # noqa: E402
from client.traces import SHIPPED_TRACE, load_trace  # noqa: E402
from sim import (  # noqa: E402
    ClusterSpec,
    TraceScaling,
    effective_capacity,
    fit_profile,
    format_sweep,
    load_profile,
    make_arrivals,
    plot_sweep,
    simulate,
    sweep,
)
from sim.validate import compare_run, format_comparisons  # noqa: E402

PAPER = "llama2-70b-8xa800"


def say(*a) -> None:
    print(*a, flush=True)


def _num(x: float):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, 4)


def scale_run(reqs) -> dict:
    p = load_profile(PAPER)
    arrivals = make_arrivals(reqs, TraceScaling(), p.block_size)
    spec = ClusterSpec(prefill=16, decode=16, policy="mooncake", ttft_slo_ms=30000, tbt_slo_ms=200)
    r = simulate(arrivals, p, spec)
    say(
        f"scale: {len(arrivals)} requests on {spec.label}: {r.wall_s:.1f} s wall, "
        f"{r.events:,} events ({r.events / r.wall_s:,.0f}/s), "
        f"{len(arrivals) / r.wall_s:,.0f} requests/s, {r.sim_s:.0f} s simulated; "
        f"attainment {100 * r.report.slo_attainment:.1f}%"
    )
    return {
        "sim_requests": len(arrivals),
        "sim_wall_s": round(r.wall_s, 2),
        "sim_events": r.events,
        "sim_events_per_s": round(r.events / r.wall_s),
        "sim_requests_per_s": round(len(arrivals) / r.wall_s, 1),
    }


def paper_experiment(reqs, rates: list[float], target: float, out: Path) -> dict:
    p = load_profile(PAPER)
    result = {}
    for tbt in (100, 200, 300):
        specs = [
            ClusterSpec(policy="mooncake", prefill=3, decode=1, ttft_slo_ms=30000, tbt_slo_ms=tbt),
            ClusterSpec(policy="mooncake", prefill=2, decode=2, ttft_slo_ms=30000, tbt_slo_ms=tbt),
            ClusterSpec(policy="load_balance", colocated=4, ttft_slo_ms=30000, tbt_slo_ms=tbt),
        ]
        t0 = time.perf_counter()
        points = sweep(reqs, TraceScaling(), p, specs, rates)
        say(f"\n== TBT SLO {tbt} ms ({time.perf_counter() - t0:.0f} s)")
        say(format_sweep(points, target))
        plot_sweep(
            points, target, out / f"paper-tbt{tbt}.png",
            title=f"synthetic trace, {PAPER}, TTFT 30 s, TBT {tbt} ms",
        )  # fmt: skip
        caps = {s.label: effective_capacity(points, s.label, target) for s in specs}
        base = caps[specs[2].label]
        best = max(caps[specs[0].label], caps[specs[1].label])
        for s in specs:
            result[f"capacity_{s.label}_tbt{tbt}"] = round(caps[s.label], 4)
        result[f"mooncake_capacity_vs_colocated_synthetic_tbt{tbt}"] = (
            round(best / base, 3) if base > 0 else None
        )
    return result


def validation(run_dir: Path | None, trace) -> dict:
    keys = ("sim_vs_real_ttft_p50_error", "sim_vs_real_ttft_p90_error",
            "sim_vs_real_attainment_error_pts")  # fmt: skip
    if run_dir is None:
        say("\nsim vs real: skipped (no --real-run)")
        return {k: None for k in keys}
    base = load_profile("smollm2-cpu")
    profile, fit = fit_profile(run_dir, base, "fitted")
    rows = compare_run(run_dir, profile, trace)
    say(f"\n== sim vs real ({run_dir}; prefill fit from {fit.prefill_rows} rounds, decode from "
        f"{fit.decode_rows} gaps)")  # fmt: skip
    say(format_comparisons(rows))
    worst = lambda f: max((abs(f(c)) for c in rows if not math.isnan(f(c))), default=math.nan)  # noqa: E731
    return {
        "sim_vs_real_ttft_p50_error": _num(worst(lambda c: c.ttft_p50_error)),
        "sim_vs_real_ttft_p90_error": _num(worst(lambda c: c.ttft_p90_error)),
        "sim_vs_real_attainment_error_pts": _num(worst(lambda c: c.attainment_error_pts)),
        "sim_vs_real_per_policy": {
            c.policy: {
                "ttft_p50_real_ms": _num(c.real.ttft_ms.p50),
                "ttft_p50_sim_ms": _num(c.sim.ttft_ms.p50),
                "ttft_p90_real_ms": _num(c.real.ttft_ms.p90),
                "ttft_p90_sim_ms": _num(c.sim.ttft_ms.p90),
                "attainment_real": _num(c.real.slo_attainment),
                "attainment_sim": _num(c.sim.slo_attainment),
            }
            for c in rows
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real-run", type=Path, default=None, help="a `halfmoon replay` output dir")
    ap.add_argument("--trace", default=str(SHIPPED_TRACE))
    ap.add_argument("--rates", default="0.05,0.1,0.2,0.3,0.45,0.6,0.8,1.0,1.3,1.6")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--skip-paper", action="store_true")
    ap.add_argument("--output", type=Path, default=ROOT / "runs" / "bench")
    args = ap.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    reqs = load_trace(args.trace)
    result = {"trace_requests": len(reqs)}
    result.update(scale_run(reqs))
    if not args.skip_paper:
        rates = [float(x) for x in args.rates.split(",")]
        result.update(paper_experiment(reqs, rates, args.target, args.output))
    result.update(validation(args.real_run, args.trace))
    return finish(result, load_start)


if __name__ == "__main__":
    sys.exit(main())
