"""The real runs `bench/sim.py` checks halfmoon's simulator on: on one local cluster (as `make
demo` starts it), a short calibration replay of one trace slice, which `halfmoon fit-profile`
fits a profile from, and validation replays of another slice at several arrival rates, which the
simulator then predicts out of sample (`bench/sim.py --real-runs DIR`).

    .venv/bin/python bench/sim_fidelity_runs.py [--output sim/data/halfmoon-smollm2] \
        [--calibration 200:60 --calibration-time-scale 4] [--validation 0:60] \
        [--time-scales 2,4,8] [--set dtype=float32]

Writes DIR/conductor.json (the conductor's policy settings), DIR/trace-calibration.jsonl and
DIR/trace-validation.jsonl (the slices, Mooncake's format), DIR/calibration/ and DIR/rate-<x>/
(replay folders: records and report.json with the workers' load reports), and one JSON line:
each run's rate and report figures, the CPU and load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import finish  # noqa: E402
from client import SHIPPED_TRACE, replay_trace  # noqa: E402
from deploy.config import load_cluster_config  # noqa: E402
from deploy.demo import DEMO_SCALING, DEMO_TBT_SLO_MS, DEMO_TTFT_SLO_MS  # noqa: E402
from deploy.launcher import Cluster  # noqa: E402


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def _slice(text: str, what: str) -> tuple[int, int]:
    try:
        start, count = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"error: {what}: START:COUNT, got {text!r}") from None
    if start < 0 or count < 1:
        raise SystemExit(f"error: {what}: START >= 0 and COUNT >= 1, got {text!r}")
    return start, count


def write_slice(trace: Path, start: int, count: int, path: Path) -> Path:
    """Lines start .. start+count of a Mooncake JSONL trace (replay counts time from the
    first)."""
    lines = [ln for ln in trace.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if start + count > len(lines):
        raise SystemExit(f"error: {trace} has {len(lines)} requests, not {start + count}")
    path.write_text("\n".join(lines[start : start + count]) + "\n", encoding="utf-8")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=SHIPPED_TRACE)
    ap.add_argument("--output", type=Path, default=ROOT / "sim" / "data" / "halfmoon-smollm2")
    ap.add_argument("--config", default=None, help="cluster config (default: local.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--calibration", default="200:60", help="START:COUNT of the trace to fit on")
    ap.add_argument("--calibration-time-scale", type=float, default=DEMO_SCALING.time_scale)
    ap.add_argument("--validation", default="0:60", help="START:COUNT of the trace to predict")
    ap.add_argument("--time-scales", default="2,4,8",
                    help="validation replays: inter-arrival times x these")  # fmt: skip
    ap.add_argument("--ttft-slo-ms", type=float, default=DEMO_TTFT_SLO_MS)
    ap.add_argument("--tbt-slo-ms", type=float, default=DEMO_TBT_SLO_MS)
    args = ap.parse_args(argv)
    scales = [float(x) for x in args.time_scales.split(",") if x.strip()]
    if not scales or min(scales) <= 0:
        raise SystemExit("error: --time-scales: numbers > 0")
    out = args.output
    out.mkdir(parents=True, exist_ok=True)
    cal = write_slice(args.trace, *_slice(args.calibration, "--calibration"),
                      out / "trace-calibration.jsonl")  # fmt: skip
    val = write_slice(args.trace, *_slice(args.validation, "--validation"),
                      out / "trace-validation.jsonl")  # fmt: skip
    cfg = load_cluster_config(args.config, args.set)
    # what the simulator's policy must decide with (sim.validate.compare_run)
    c = cfg.conductor
    conductor = {"local_prefill_tokens": c.local_prefill_tokens, "admission": c.admission,
                 "kvcache_balancing_threshold": c.kvcache_balancing_threshold}  # fmt: skip
    (out / "conductor.json").write_text(json.dumps(conductor, indent=2) + "\n", encoding="utf-8")
    load_start = os.getloadavg()[0]
    runs = [("calibration", cal, args.calibration_time_scale)]
    runs += [(f"rate-{s:g}", val, s) for s in scales]
    result: dict = {"trace": str(args.trace), "dtype": cfg.conductor.dtype, "runs": {}}
    t0 = time.monotonic()
    with Cluster(cfg, log=say) as cluster:
        for i, (name, trace, scale) in enumerate(runs, 1):
            say(f"\n== {i}/{len(runs)} {name}: {trace.name}, inter-arrival times x{scale:g}")
            r = replay_trace(
                cluster.address,
                trace,
                scaling=DEMO_SCALING._replace(time_scale=scale),
                policies=["mooncake"],
                ttft_slo_ms=args.ttft_slo_ms,
                tbt_slo_ms=args.tbt_slo_ms,
                output_dir=out / name,
            )
            rep = r.reports[0]
            result["runs"][name] = {
                "time_scale": scale,
                "requests": rep.requests,
                "rate_rps": round(rep.requests / rep.duration_s, 4) if rep.duration_s else None,
                "ttft_p50_ms": round(rep.ttft_ms.p50, 1),
                "ttft_p90_ms": round(rep.ttft_ms.p90, 1),
                "attainment": round(rep.slo_attainment, 4),
                "goodput_rps": round(rep.goodput_rps, 4),
            }
            say(r.table)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return finish(result, load_start)


if __name__ == "__main__":
    sys.exit(main())
