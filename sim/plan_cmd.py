"""`halfmoon plan`: recommend a prefill:decode split for a trace, the objectives and an instance
count, from simulation (sim.plan), against the colocated vLLM-like baseline on as many instances.
The trace is a file, or (--conductor) a running cluster's recent requests, whose objectives and
worker count are then the defaults."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from client.traces import SHIPPED_TRACE, load_trace
from protos import halfmoon_pb2 as pb
from sim.arrivals import TraceScaling
from sim.config import load_sim_config
from sim.driver import ClusterSpec
from sim.live_trace import fetch_recent, live_profile, write_profile, write_trace
from sim.plan import (
    DEFAULT_VLLM_BUDGETS,
    Plan,
    format_plan,
    plan_split,
    plot_plan,
    vllm_baseline_specs,
    vllm_counterpart,
)
from sim.profile import Profile, load_profile
from sim.sweep import finite
from sim.vllm_baseline import VllmConfig

DEFAULT_RATES = "0.25,0.5,1,2,4,8"


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, default=None,
                   help="instances to split (>= 2; required with --trace; with --conductor the "
                   "cluster's workers by default)")  # fmt: skip
    p.add_argument("--config", default=None, help="sim config: a name in sim/configs/ or a path")
    p.add_argument("--profile", default=None, help="profile name in sim/profiles/ or a YAML path")
    p.add_argument("--trace", default=None, help="trace file (default: the config's, else shipped)")
    p.add_argument("--conductor", default=None, metavar="HOST:PORT",
                   help="instead of a file, the recent requests of the cluster this conductor "
                   "serves (its RecentTrace: the cluster token on a secured cluster), written to "
                   "<output>/live_trace.jsonl; its objectives and worker count are the "
                   "defaults")  # fmt: skip
    p.add_argument("--recent", type=int, default=0,
                   help="with --conductor: its newest this many requests (0 = all it keeps)")
    p.add_argument("--models", default=None, choices=["live", "profile"],
                   help="with --conductor: simulate with the cluster's own time models (live: "
                   "each worker's fitted model times the conductor's correction, over the "
                   "profile's other figures; written to <output>/live_profile.yaml) or the "
                   "profile's as they are; default live)")  # fmt: skip
    p.add_argument("--block-tokens", type=int, default=None,
                   help="tokens a trace hash id covers (default: the config's scaling, 512 as in "
                   "Mooncake's traces; with --conductor the cluster's block size)")  # fmt: skip
    p.add_argument("--format", default="auto", choices=["auto", "mooncake", "azure"])
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--policy", default="mooncake")
    p.add_argument("--ttft-slo-ms", type=float, default=None)
    p.add_argument("--tbt-slo-ms", type=float, default=None, help="0 = not judged")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="0 = not judged")
    p.add_argument("--rates", default=DEFAULT_RATES, help="the trace's rate x these, to sweep")
    p.add_argument("--target", type=float, default=None, help="attainment of an effective rate")
    p.add_argument("--output", default="runs/plan")
    b = p.add_argument_group(
        "the baseline: --instances colocated vLLM-like instances (chunked prefill, prefix "
        "caching, nothing refused; sim.vllm_baseline)"
    )
    b.add_argument("--baseline", default=None, choices=["none", "vllm"],
                   help="compare against it (vllm) or not (none); default: vllm where the "
                   "profile has a vLLM counterpart in sim/profiles/ (<profile>-vllm, or "
                   "vllm-cpu-smollm2-135m for smollm2-cpu) or --vllm-profile names one, else "
                   "none")  # fmt: skip
    b.add_argument("--vllm-profile", default=None,
                   help="the baseline's profile (default: the profile's vLLM counterpart)")
    b.add_argument("--vllm-budgets", default=None,
                   help="its max_num_batched_tokens to try, comma-separated, the best kept "
                   "(default: 256,512,1024,2048 and the vLLM profile's own)")  # fmt: skip
    b.add_argument("--vllm-policies", default=None,
                   help="its routers to try, comma-separated, the best kept (default: mooncake, "
                   "cache- and load-aware, best effort)")  # fmt: skip


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--rates: comma-separated numbers, got {text!r}") from None
    if not rates or min(rates) <= 0:
        raise ValueError("--rates: rate scales must be > 0")
    return rates


def _baseline(args: argparse.Namespace, profile: Profile) -> tuple[Profile | None, list[str]]:
    """The baseline's profile (None: no baseline) and what to say about the choice."""
    tuning = [f"--{n.replace('_', '-')}" for n in ("vllm_profile", "vllm_budgets", "vllm_policies")
              if getattr(args, n) is not None]  # fmt: skip
    if args.baseline == "none":
        if tuning:
            raise ValueError(f"{', '.join(tuning)}: for the baseline, not with --baseline none")
        return None, []
    name = args.vllm_profile or vllm_counterpart(profile.name)
    if name is None:
        if args.baseline == "vllm":
            raise ValueError(
                f"--baseline vllm: profile {profile.name!r} has no vLLM counterpart in "
                f"sim/profiles/ ({profile.name}-vllm.yaml): give --vllm-profile"
            )
        if tuning:
            raise ValueError(f"{', '.join(tuning)}: no baseline profile; give --vllm-profile")
        return None, [f"no vLLM baseline: profile {profile.name!r} has no vLLM counterpart in "
                      "sim/profiles/ (--vllm-profile names one)"]  # fmt: skip
    return load_profile(name), []


def _names(option: str, text: str | None, default: list[str]) -> list[str]:
    names = default if text is None else [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise ValueError(f"{option}: at least one, comma-separated")
    return names


def _budgets(text: str | None, profile: Profile) -> list[int]:
    if text is None:
        return sorted({*DEFAULT_VLLM_BUDGETS, VllmConfig().budget(profile)})
    try:
        budgets = [int(x) for x in _names("--vllm-budgets", text, [])]
    except ValueError:
        raise ValueError(f"--vllm-budgets: comma-separated token counts, got {text!r}") from None
    if min(budgets) < 1:
        raise ValueError("--vllm-budgets: token counts must be >= 1")
    return list(dict.fromkeys(budgets))


def _baseline_json(plan: Plan) -> dict | None:
    b = plan.baseline
    if b is None:
        return None
    return {"kind": b.kind, "label": b.label, "capacity_rps": round(b.capacity_rps, 4),
            "profile": b.profile,
            "tried": {label: round(cap, 4) for label, cap in b.tried}}  # fmt: skip


def _source(
    args: argparse.Namespace, out: Path
) -> tuple[str | Path | None, pb.RecentTraceReply | None]:
    """The trace to plan for, and the conductor's reply when it is a cluster's recent load."""
    if args.conductor is None:
        if args.recent:
            raise ValueError("--recent: with --conductor only")
        if args.models is not None:
            raise ValueError("--models: with --conductor only (a trace file's: --profile)")
        if args.instances is None:
            raise ValueError("--instances: required unless --conductor gives the cluster's")
        return args.trace, None
    if args.trace is not None:
        raise ValueError("--trace and --conductor: one or the other")
    live = fetch_recent(args.conductor, args.recent)
    return write_trace(live, out / "live_trace.jsonl"), live


def _check_objectives(args: argparse.Namespace) -> None:
    for name in ("ttft_slo_ms", "tbt_slo_ms", "tpot_slo_ms"):
        value = getattr(args, name)
        if value is not None and (not value >= 0 or (name == "ttft_slo_ms" and value == 0)):
            least = "> 0" if name == "ttft_slo_ms" else ">= 0 (0 = not judged)"
            raise ValueError(f"--{name.replace('_', '-')} must be {least} (ms), got {value}")


def _objective(args: argparse.Namespace, name: str, live, base: float) -> float:
    """The objective given, else the cluster's (with --conductor), else the config's."""
    value = getattr(args, name)
    if value is None:
        return getattr(live, name) if live is not None else base
    return value


def plan_cmd(args: argparse.Namespace) -> int:
    cfg = load_sim_config(args.config)
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1")
    if args.block_tokens is not None and args.block_tokens < 1:
        raise ValueError(f"--block-tokens must be >= 1, got {args.block_tokens}")
    _check_objectives(args)
    out = Path(args.output)
    source, live = _source(args, out)
    base = cfg.clusters[0]
    spec = ClusterSpec(
        policy=args.policy,
        ttft_slo_ms=_objective(args, "ttft_slo_ms", live, base.ttft_slo_ms),
        tbt_slo_ms=_objective(args, "tbt_slo_ms", live, base.tbt_slo_ms),
        tpot_slo_ms=_objective(args, "tpot_slo_ms", live, base.tpot_slo_ms),
    )
    instances = (
        args.instances
        if args.instances is not None or live is None
        else live.prefill_workers + live.decode_workers
    )
    # a cluster's own requests are played as they came (no length or rate scaling), a hash id
    # per block of its block size
    scaling = cfg.scaling if live is None else TraceScaling(trace_block_tokens=live.block_size)
    if args.block_tokens is not None:
        scaling = scaling._replace(trace_block_tokens=args.block_tokens)
    named = load_profile(args.profile or cfg.profile)
    profile = named
    if live is not None and args.models != "profile":
        profile = live_profile(live, named, args.conductor)
        write_profile(profile, out / "live_profile.yaml")
    trace = source or cfg.trace or SHIPPED_TRACE
    reqs = load_trace(trace, "mooncake" if live is not None else args.format, args.limit)
    if not reqs:
        raise ValueError(f"{trace}: no requests")
    target = args.target if args.target is not None else cfg.target
    baseline_profile, notes = _baseline(args, named)  # the baseline is the named profile's
    baseline = (
        vllm_baseline_specs(instances, spec, _budgets(args.vllm_budgets, baseline_profile),
                            _names("--vllm-policies", args.vllm_policies, ["mooncake"]))
        if baseline_profile is not None
        else []
    )  # fmt: skip
    plan = plan_split(reqs, scaling, profile, instances, _rates(args.rates), spec, target,
                      baseline=baseline, baseline_profile=baseline_profile)  # fmt: skip
    png = plot_plan(
        plan,
        out / "plan.png",
        title=f"{Path(trace).name} ({len(reqs)} requests), profile {profile.name},\n"
        f"TTFT <= {spec.ttft_slo_ms:g} ms, TBT <= {spec.tbt_slo_ms:g} ms"
        + (f", TPOT <= {spec.tpot_slo_ms:g} ms" if spec.tpot_slo_ms else ""),
    )
    print("\n".join([format_plan(plan), *notes]))
    print(f"plot in {png}")
    result = {
        "instances": plan.instances,
        "target": plan.target,
        # None when no split keeps the target at any rate swept
        "recommended": {"prefill": plan.best.prefill, "decode": plan.best.decode}
        if plan.best.capacity_rps > 0
        else None,
        "capacity_rps": {
            f"{s.prefill}P:{s.decode}D": round(s.capacity_rps, 4) for s in plan.splits
        },  # fmt: skip
        # the colocated baseline on as many instances (None: --baseline none, or no profile)
        "baseline": _baseline_json(plan),
        # the best split's capacity / the baseline's; None: no baseline, or it keeps none
        "capacity_vs_baseline": None
        if plan.capacity_vs_baseline is None
        else round(plan.capacity_vs_baseline, 4),
        "trace": str(trace),
        "profile": profile.name,
        "ttft_slo_ms": spec.ttft_slo_ms,
        "tbt_slo_ms": spec.tbt_slo_ms,
        "tpot_slo_ms": spec.tpot_slo_ms,
        # with --conductor: the cluster the load came from (None: a trace file)
        "live": None
        if live is None
        else {
            "conductor": args.conductor,
            "requests": len(live.requests),
            "refused": sum(r.refused for r in live.requests),
            "window_s": round(live.window_s, 3),
            "refused_at_door": live.refused_at_door,
            "workers": {"prefill": live.prefill_workers, "decode": live.decode_workers},
            # the time models simulated (the cluster's), None with --models profile
            "models": None
            if args.models == "profile"
            else {"prefill_coef": list(profile.prefill_coef),
                  "decode_coef": list(profile.decode_coef),
                  "kv_blocks": profile.kv_blocks, "max_batch": profile.max_batch},
        },
    }
    (out / "plan.json").write_text(json.dumps(finite(result), indent=2) + "\n", encoding="utf-8")
    print(json.dumps(finite(result)))
    return 0
