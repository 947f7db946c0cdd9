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
4. the vLLM baseline against vLLM: every `vllm bench serve` result in --vllm-runs
   (bench/goodput.py's vllm-<rate>.json beside trace-<rate>.jsonl) simulated on one vLLM-like
   instance (sim.vllm_baseline) with the fitted profile --vllm-profile; goodput (TTFT and TPOT
   objectives as bench serve counts them) and TTFT p50/p90 against the measured ones, the runs
   the profile was fitted on marked in sample and the largest errors over the others reported
   (keys `vllm_baseline_*`; null when there are no such runs: runs/ is not in the repository).

    .venv/bin/python bench/sim.py [--real-run runs/sim-validation] [--rates 0.1,0.2,...]

5. the paper's experiment against a fair colocated baseline: Mooncake's every P:D split of four
   instances against four vLLM-like colocated instances (chunked prefill under a token budget,
   prefix caching, nothing refused; the budgets --vllm-budgets and routers --vllm-policies, the
   best one kept) on the paper profile's -vllm variant, at TBT 100/200/300 ms; capacity against
   the split with the best colocated one across it in paper-vs-vllm.png (--skip-vllm-paper
   skips it: it takes minutes).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
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
from sim.capacity import format_vs, plot_vs, splits_vs_colocated  # noqa: E402
from sim.sweep import trace_rate  # noqa: E402
from sim.validate import compare_run, format_comparisons  # noqa: E402
from sim.vllm_fit import bench_files, fitted_runs, read_bench_run  # noqa: E402
from sim.vllm_validate import check_runs, format_checks  # noqa: E402

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


def paper_vs_vllm(reqs, rates: list[float], target: float, out: Path, budgets: list[int],
                  policies: list[str]) -> dict:  # fmt: skip
    """Section 5: the best P:D split against the best vLLM-like colocated configuration."""
    p, pv = load_profile(PAPER), load_profile(PAPER + "-vllm")
    result, cases = {}, {}
    for tbt in (100, 200, 300):
        slo = {"ttft_slo_ms": 30000, "tbt_slo_ms": tbt}
        colocated = [
            ClusterSpec(colocated=4, colocated_kind="vllm", policy=pol, admission="best_effort",
                        colocated_options={"max_num_batched_tokens": b}, **slo)
            for pol in policies for b in budgets
        ]  # fmt: skip
        t0 = time.perf_counter()
        base = ClusterSpec(policy="mooncake", **slo)
        r = splits_vs_colocated(reqs, TraceScaling(), p, pv, 4, rates, base, colocated, target)
        say(f"\n== TBT SLO {tbt} ms against vLLM-like colocated ({time.perf_counter() - t0:.0f} s)")
        say(format_vs(r))
        cases[f"TBT {tbt} ms"] = r
        result[f"capacity_best_split_tbt{tbt}"] = round(r.best_split.capacity_rps, 4)
        result[f"best_split_tbt{tbt}"] = r.best_split.label
        result[f"capacity_vllm_colocated_best_tbt{tbt}"] = round(r.best_colocated.capacity_rps, 4)
        result[f"best_vllm_colocated_tbt{tbt}"] = r.best_colocated.label
        result[f"mooncake_capacity_vs_vllm_colocated_tbt{tbt}"] = (
            round(r.ratio, 3) if math.isfinite(r.ratio) else None
        )
    png = plot_vs(cases, out / "paper-vs-vllm.png",
                  title=f"synthetic trace, {PAPER}, TTFT 30 s: Mooncake P:D vs vLLM-like 4M")
    say(f"plot in {png}")
    return result


def _per_policy(rows) -> dict:
    return {
        c.policy: {
            "ttft_p50_real_ms": _num(c.real.ttft_ms.p50),
            "ttft_p50_sim_ms": _num(c.sim.ttft_ms.p50),
            "ttft_p90_real_ms": _num(c.real.ttft_ms.p90),
            "ttft_p90_sim_ms": _num(c.sim.ttft_ms.p90),
            "attainment_real": _num(c.real.slo_attainment),
            "attainment_sim": _num(c.sim.slo_attainment),
            "goodput_real_rps": _num(c.real.goodput_rps),
            "goodput_sim_rps": _num(c.sim.goodput_rps),
            "tpot_p50_error": _num(c.tpot_p50_error),
            "ttft_p50_rank_pts": _num(c.ttft_p50_rank_pts),
            "real_ttft_p50_ci_ms": [_num(x) for x in c.real_ttft_p50_ci],
        }
        for c in rows
    }


def _worst(rows, f) -> float:
    return max((abs(f(c)) for c in rows if not math.isnan(f(c))), default=math.nan)


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
    return {
        "sim_vs_real_ttft_p50_error": _num(_worst(rows, lambda c: c.ttft_p50_error)),
        "sim_vs_real_ttft_p90_error": _num(_worst(rows, lambda c: c.ttft_p90_error)),
        "sim_vs_real_attainment_error_pts": _num(_worst(rows, lambda c: c.attainment_error_pts)),
        "sim_vs_real_per_policy": _per_policy(rows),
    }


HALFMOON_RUNS = "halfmoon-smollm2"  # the calibration and validation replays shipped in sim/data


def fidelity(runs_dir: Path) -> dict:
    """halfmoon's own fidelity, out of sample: a profile fitted from runs_dir/calibration (a
    replay of one trace slice), then every runs_dir/rate-<x> replay (another slice, at several
    rates) simulated with it; the largest errors over them (bench/sim_fidelity_runs.py makes
    the runs)."""
    keys = ("fidelity_ttft_p50_error", "fidelity_ttft_p90_error", "fidelity_tpot_p50_error",
            "fidelity_goodput_error", "fidelity_ttft_p50_rank_pts", "fidelity_runs")  # fmt: skip
    cal = runs_dir / "calibration"
    held = sorted(runs_dir.glob("rate-*"), key=lambda d: float(d.name.split("-", 1)[1]))
    if not (cal / "report.json").is_file() or not held:
        say(f"\nhalfmoon fidelity: skipped (no calibration/ and rate-*/ replays in {runs_dir})")
        return {k: None for k in keys}
    profile, fit = fit_profile(cal, load_profile("smollm2-cpu"), "calibrated")
    say(f"\n== halfmoon's simulator out of sample: profile fitted on {cal} ({fit.prefill_rows} "
        f"prefill rounds, {fit.decode_rows} decode gaps), each replay of "
        f"{runs_dir / 'trace-validation.jsonl'} simulated")  # fmt: skip
    trace = runs_dir / "trace-validation.jsonl"
    settings = runs_dir / "conductor.json"
    conductor = json.loads(settings.read_text(encoding="utf-8")) if settings.is_file() else {}
    rows, per_run = [], {}
    for d in held:
        found = compare_run(d, profile, trace, conductor)
        rate = trace_rate(load_trace(trace)) / float(d.name.split("-", 1)[1])
        say(f"-- {d.name}: inter-arrival times x{d.name.split('-', 1)[1]}, {rate:.2f} req/s")
        say(format_comparisons(found))
        rows += found
        per_run[d.name] = {"rate_rps": _num(rate), **_per_policy(found)}
    return {
        "fidelity_ttft_p50_error": _num(_worst(rows, lambda c: c.ttft_p50_error)),
        "fidelity_ttft_p90_error": _num(_worst(rows, lambda c: c.ttft_p90_error)),
        "fidelity_tpot_p50_error": _num(_worst(rows, lambda c: c.tpot_p50_error)),
        "fidelity_goodput_error": _num(_worst(rows, lambda c: c.goodput_error)),
        # the sim's TTFT p50 as a percentile of the real TTFTs, less 50 (the largest off)
        "fidelity_ttft_p50_rank_pts": _num(_worst(rows, lambda c: c.ttft_p50_rank_pts)),
        "fidelity_runs": per_run,
    }


def vllm_baseline(runs_dir: Path, profile_name: str, ttft_ms: float, tpot_ms: float) -> dict:
    """Section 4: the fitted vLLM baseline against every measured vLLM run in `runs_dir`."""
    keys = ("vllm_baseline_heldout_goodput_error", "vllm_baseline_heldout_goodput_diff_rps",
            "vllm_baseline_heldout_ttft_p50_error", "vllm_baseline_heldout_ttft_p90_error",
            "vllm_baseline_runs")  # fmt: skip
    results = sorted(runs_dir.glob("vllm-*.json")) if runs_dir.is_dir() else []
    pairs = [bench_files(str(r)) for r in results]
    pairs = [(r, t) for r, t in pairs if t.is_file()]
    if not pairs:
        say(f"\nvLLM baseline vs vLLM: skipped (no vllm-<rate>.json and trace in {runs_dir})")
        return {k: None for k in keys}
    p = load_profile(profile_name)
    runs = [read_bench_run(r, t, p.block_size) for r, t in pairs]
    fit = {str(r) for r, _ in pairs if any((ROOT / f).resolve() == r.resolve()
                                           for f in fitted_runs(p))}  # fmt: skip
    rows = check_runs(runs, p, fit, ttft_ms, tpot_ms)
    say(f"\n== vLLM baseline (profile {p.name}) vs vLLM bench serve runs in {runs_dir}")
    say(format_checks(rows))
    held = [c for c in rows if not c.fitted]
    worst = lambda f: max((abs(f(c)) for c in held if not math.isnan(f(c))), default=math.nan)  # noqa: E731
    return {
        "vllm_baseline_heldout_goodput_error": _num(worst(lambda c: c.goodput_error)),
        "vllm_baseline_heldout_goodput_diff_rps": _num(worst(lambda c: c.goodput_diff_rps)),
        "vllm_baseline_heldout_ttft_p50_error": _num(worst(lambda c: c.ttft_p50_error)),
        "vllm_baseline_heldout_ttft_p90_error": _num(worst(lambda c: c.ttft_p90_error)),
        "vllm_baseline_runs": {
            c.run: {
                "fitted": c.fitted,
                "goodput_measured": _num(c.measured.goodput_rps),
                "goodput_predicted": _num(c.predicted.goodput_rps),
                "ttft_p50_measured_ms": _num(c.measured.ttft_p50_ms),
                "ttft_p50_predicted_ms": _num(c.predicted.ttft_p50_ms),
                "ttft_p90_measured_ms": _num(c.measured.ttft_p90_ms),
                "ttft_p90_predicted_ms": _num(c.predicted.ttft_p90_ms),
            }
            for c in rows
        },
    }


VLLM_RUNS = "vllm-cpu-smollm2-135m"  # the measured runs the shipped vLLM profile was fitted on


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real-run", type=Path, default=None, help="a `halfmoon replay` output dir")
    ap.add_argument("--real-runs", type=Path, default=ROOT / "sim" / "data" / HALFMOON_RUNS,
                    help="calibration/ and rate-*/ replays (bench/sim_fidelity_runs.py)")
    ap.add_argument("--trace", default=str(SHIPPED_TRACE))
    ap.add_argument("--rates", default="0.05,0.1,0.2,0.3,0.45,0.6,0.8,1.0,1.3,1.6")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--skip-paper", action="store_true")
    ap.add_argument("--output", type=Path, default=ROOT / "runs" / "bench")
    ap.add_argument("--vllm-runs", type=Path, default=ROOT / "sim" / "data" / VLLM_RUNS,
                    help="bench/goodput.py's output: vllm-<rate>.json and trace-<rate>.jsonl")
    ap.add_argument("--vllm-profile", default="vllm-cpu-smollm2-135m")
    ap.add_argument("--vllm-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--vllm-tpot-ms", type=float, default=100.0)
    ap.add_argument("--skip-vllm-paper", action="store_true")
    ap.add_argument("--vllm-budgets", default="256,512,1024,2048",
                    help="the colocated baseline's max_num_batched_tokens to try")
    ap.add_argument("--vllm-policies", default="mooncake,load_balance",
                    help="the colocated baseline's routers to try")
    args = ap.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    reqs = load_trace(args.trace)
    result = {"trace_requests": len(reqs)}
    result.update(scale_run(reqs))
    if not args.skip_paper:
        rates = [float(x) for x in args.rates.split(",")]
        result.update(paper_experiment(reqs, rates, args.target, args.output))
    if not args.skip_vllm_paper:
        rates = [float(x) for x in args.rates.split(",")]
        budgets = [int(x) for x in args.vllm_budgets.split(",")]
        result.update(paper_vs_vllm(reqs, rates, args.target, args.output, budgets,
                                    args.vllm_policies.split(",")))  # fmt: skip
    result.update(validation(args.real_run, args.trace))
    result.update(fidelity(args.real_runs))
    result.update(vllm_baseline(args.vllm_runs, args.vllm_profile, args.vllm_ttft_ms,
                                args.vllm_tpot_ms))  # fmt: skip
    return finish(result, load_start)


if __name__ == "__main__":
    sys.exit(main())
