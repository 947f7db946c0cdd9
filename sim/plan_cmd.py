"""`halfmoon plan`: recommend a prefill:decode split for a trace, the objectives and an instance
count, from simulation (sim.plan)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from client.traces import SHIPPED_TRACE, load_trace
from sim.config import load_sim_config
from sim.driver import ClusterSpec
from sim.plan import format_plan, plan_split, plot_plan
from sim.profile import load_profile
from sim.sweep import finite

DEFAULT_RATES = "0.25,0.5,1,2,4,8"


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, required=True, help="instances to split (>= 2)")
    p.add_argument("--config", default=None, help="sim config: a name in sim/configs/ or a path")
    p.add_argument("--profile", default=None, help="profile name in sim/profiles/ or a YAML path")
    p.add_argument("--trace", default=None, help="trace file (default: the config's, else shipped)")
    p.add_argument("--format", default="auto", choices=["auto", "mooncake", "azure"])
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--policy", default="mooncake")
    p.add_argument("--ttft-slo-ms", type=float, default=None)
    p.add_argument("--tbt-slo-ms", type=float, default=None)
    p.add_argument("--rates", default=DEFAULT_RATES, help="the trace's rate x these, to sweep")
    p.add_argument("--target", type=float, default=None, help="attainment of an effective rate")
    p.add_argument("--output", default="runs/plan")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--rates: comma-separated numbers, got {text!r}") from None
    if not rates or min(rates) <= 0:
        raise ValueError("--rates: rate scales must be > 0")
    return rates


def plan_cmd(args: argparse.Namespace) -> int:
    cfg = load_sim_config(args.config)
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1")
    base = cfg.clusters[0]
    for name in ("ttft_slo_ms", "tbt_slo_ms"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 (ms), got {value}")
    spec = ClusterSpec(
        policy=args.policy,
        ttft_slo_ms=args.ttft_slo_ms or base.ttft_slo_ms,
        tbt_slo_ms=args.tbt_slo_ms or base.tbt_slo_ms,
    )
    profile = load_profile(args.profile or cfg.profile)
    trace = args.trace or cfg.trace or SHIPPED_TRACE
    reqs = load_trace(trace, args.format, args.limit)
    if not reqs:
        raise ValueError(f"{trace}: no requests")
    target = args.target if args.target is not None else cfg.target
    plan = plan_split(
        reqs, cfg.scaling, profile, args.instances, _rates(args.rates), spec, target
    )
    out = Path(args.output)
    png = plot_plan(
        plan,
        out / "plan.png",
        title=f"{Path(trace).name} ({len(reqs)} requests), profile {profile.name}, "
        f"TTFT <= {spec.ttft_slo_ms:g} ms, TBT <= {spec.tbt_slo_ms:g} ms",
    )
    print(format_plan(plan))
    print(f"plot in {png}")
    result = {
        "instances": plan.instances,
        "target": plan.target,
        # None when no split keeps the target at any rate swept
        "recommended": {"prefill": plan.best.prefill, "decode": plan.best.decode}
        if plan.best.capacity_rps > 0
        else None,
        "capacity_rps": {f"{s.prefill}P:{s.decode}D": round(s.capacity_rps, 4)
                         for s in plan.splits},  # fmt: skip
        "trace": str(trace),
        "profile": profile.name,
        "ttft_slo_ms": spec.ttft_slo_ms,
        "tbt_slo_ms": spec.tbt_slo_ms,
    }
    (out / "plan.json").write_text(json.dumps(finite(result), indent=2) + "\n", encoding="utf-8")
    print(json.dumps(finite(result)))
    return 0
