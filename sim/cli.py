"""`halfmoon simulate` and `halfmoon fit-profile`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from client.plot import plot_cdfs
from client.report import format_reports, report_dict, write_records
from client.traces import SHIPPED_TRACE, load_trace
from sim.arrivals import make_arrivals
from sim.config import SimConfig, load_sim_config
from sim.driver import COLOCATED_KINDS, ClusterSpec, simulate
from sim.fit import fit_profile
from sim.profile import PROFILE_DIR, load_profile, profile_yaml_text
from sim.sweep import finite, format_sweep, plot_sweep, sweep
from sim.vllm_baseline import DEFAULT_BUDGET
from sim.vllm_fit import (
    VLLM_CPU_BLOCK,
    VLLM_CPU_SEQS,
    bench_files,
    fit_vllm_profile,
    read_bench_run,
    server_sizes,
)
from sim.vllm_validate import check_runs, format_checks, profile_yaml

log = logging.getLogger(__name__)


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="sim config: a name in sim/configs/ or a path")
    p.add_argument("--profile", default=None, help="profile name in sim/profiles/ or a YAML path")
    p.add_argument("--trace", default=None, help="trace file (default: the config's, else shipped)")
    p.add_argument("--format", default="auto", choices=["auto", "mooncake", "azure"])
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--policy", default=None, help="route every cluster with this policy")
    p.add_argument("--prefill", type=int, default=None, help="one cluster: prefill instances")
    p.add_argument("--decode", type=int, default=None, help="one cluster: decode instances")
    p.add_argument("--colocated", type=int, default=None, help="one cluster: colocated instances")
    p.add_argument("--colocated-kind", default=None, choices=sorted(COLOCATED_KINDS),
                   help="how colocated instances schedule (every colocated cluster): stall = "
                   "whole prompts between decode steps, vllm = chunked prefill under a token "
                   "budget with prefix caching")  # fmt: skip
    p.add_argument("--vllm-budget", type=int, default=None,
                   help="vllm kind: max_num_batched_tokens (default: the profile's)")  # fmt: skip
    p.add_argument("--rate-scale", type=float, default=None, help="arrival rate x this")
    p.add_argument("--length-scale", type=float, default=None)
    p.add_argument("--max-output", type=int, default=None)
    p.add_argument("--max-input", type=int, default=None)
    p.add_argument("--ttft-slo-ms", type=float, default=None)
    p.add_argument("--tbt-slo-ms", type=float, default=None)
    p.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="time per output token objective (the mean gap); 0 = not judged")
    p.add_argument(
        "--sweep",
        default=None,
        help="comma-separated rate scales: attainment per rate and effective capacity",
    )
    p.add_argument("--target", type=float, default=None, help="attainment of an effective rate")
    p.add_argument("--output", default="runs/sim")


def add_fit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", nargs="?", default=None,
                   help="a `halfmoon replay` output folder (or --vllm-bench)")  # fmt: skip
    p.add_argument("--base", default="smollm2-cpu", help="profile whose other figures it keeps")
    p.add_argument("--name", default="", help="the new profile's name")
    p.add_argument("--output", default=None, help="YAML to write (default: print it)")
    v = p.add_argument_group("a vLLM baseline profile (sim.vllm_fit) from `vllm bench serve` runs")
    run = "RESULT[,TRACE]"  # the trace defaults to bench/goodput.py's trace-<rate>.jsonl beside it
    v.add_argument("--vllm-bench", action="append", default=[], metavar=run,
                   help="a --save-detailed result to fit on (repeatable)")  # fmt: skip
    v.add_argument("--vllm-holdout", action="append", default=[], metavar=run,
                   help="a result only checked against the fit (repeatable)")  # fmt: skip
    v.add_argument("--vllm-budget", type=int, default=DEFAULT_BUDGET,
                   help="the server's max_num_batched_tokens")  # fmt: skip
    v.add_argument("--vllm-max-seqs", type=int, default=VLLM_CPU_SEQS, help="its max_num_seqs")
    v.add_argument("--vllm-block-size", type=int, default=VLLM_CPU_BLOCK, help="its block size")
    v.add_argument("--vllm-hash-tokens", type=int, default=16,
                   help="tokens a trace hash id stands for (bench serve's "
                   "--timed-trace-chunk-hash-size)")  # fmt: skip
    v.add_argument("--vllm-kv-tokens", type=int, default=0,
                   help="its KV pool in tokens (0: from RESULT's .server.log)")  # fmt: skip
    v.add_argument("--vllm-token-bytes", type=int, default=0,
                   help="KV bytes a token (0: from the log)")  # fmt: skip
    v.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="for the check's goodput")
    v.add_argument("--tpot-slo-ms", type=float, default=100.0, help="for the check's goodput")


def _apply_overrides(cfg: SimConfig, args: argparse.Namespace) -> SimConfig:
    sc = cfg.scaling
    for name in ("rate_scale", "length_scale", "max_output", "max_input"):
        v = getattr(args, name, None)
        if v is not None:
            if name in ("rate_scale", "length_scale") and not v > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
            sc = sc._replace(**{name: v})
    clusters = list(cfg.clusters)
    shape = {k: getattr(args, k) for k in ("prefill", "decode", "colocated")}
    if any(v is not None for v in shape.values()):
        base = clusters[0]
        if shape["colocated"]:
            merged = {"colocated": shape["colocated"], "prefill": shape["prefill"] or 0,
                      "decode": shape["decode"] or 0}  # fmt: skip
        else:
            merged = {
                "colocated": 0,
                "prefill": shape["prefill"] if shape["prefill"] is not None else base.prefill or 1,
                "decode": shape["decode"] if shape["decode"] is not None else base.decode or 1,
            }
        clusters = [dataclasses.replace(base, **merged)]
    if args.policy:
        clusters = [dataclasses.replace(c, policy=args.policy) for c in clusters]
    kind, budget = getattr(args, "colocated_kind", None), getattr(args, "vllm_budget", None)
    if budget is not None and (kind or "vllm") != "vllm":
        raise ValueError("--vllm-budget is for --colocated-kind vllm")
    if kind or budget is not None:
        opts = {"max_num_batched_tokens": budget} if budget is not None else {}
        clusters = [
            dataclasses.replace(
                c, colocated_kind=kind or c.colocated_kind,
                colocated_options={**c.colocated_options, **opts},
            ) if c.colocated else c
            for c in clusters
        ]  # fmt: skip
    names = ("ttft_slo_ms", "tbt_slo_ms", "tpot_slo_ms")
    slo = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    clusters = [dataclasses.replace(c, **slo) for c in clusters]
    rates = cfg.sweep
    if args.sweep:
        try:
            rates = tuple(float(x) for x in args.sweep.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--sweep: comma-separated numbers, got {args.sweep!r}") from None
        if not rates or min(rates) <= 0:
            raise ValueError("--sweep: rate scales must be > 0")
    return dataclasses.replace(
        cfg,
        clusters=clusters,
        scaling=sc,
        sweep=rates,
        profile=args.profile or cfg.profile,
        trace=args.trace or cfg.trace,
        target=args.target if args.target is not None else cfg.target,
    )


def simulate_cmd(args: argparse.Namespace) -> int:
    cfg = _apply_overrides(load_sim_config(args.config), args)
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1")
    profile = load_profile(cfg.profile)
    trace = cfg.trace or SHIPPED_TRACE
    reqs = load_trace(trace, args.format, args.limit)
    if not reqs:
        raise ValueError(f"{trace}: no requests")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.sweep:
        points = sweep(reqs, cfg.scaling, profile, cfg.clusters, cfg.sweep)
        table = format_sweep(points, cfg.target)
        png = plot_sweep(
            points,
            cfg.target,
            out / "sweep.png",
            title=f"{Path(trace).name} ({len(reqs)} requests), profile {profile.name}",
        )
        (out / "sweep.txt").write_text(table + "\n", encoding="utf-8")
        (out / "sweep.json").write_text(
            json.dumps(finite({"points": [p._asdict() for p in points]}), indent=2) + "\n",
            encoding="utf-8",
        )
        print(table)
        print(f"sweep in {out}/sweep.txt, plot in {png}")
        return 0
    arrivals = make_arrivals(reqs, cfg.scaling, profile.block_size)
    reports, by_label = [], {}
    for spec in cfg.clusters:
        r = simulate(arrivals, profile, spec)
        write_records(out / f"records-{spec.label}.jsonl", r.records)
        by_label[spec.label] = r.records
        reports.append(r.report)
        print(
            f"{spec.label}: {len(arrivals)} requests, {r.events} events in {r.wall_s:.2f} s "
            f"({r.events / max(r.wall_s, 1e-9):,.0f} events/s, "
            f"{len(arrivals) / max(r.wall_s, 1e-9):,.0f} requests/s), "
            f"{r.sim_s:.1f} s simulated"
        )
    table = format_reports(reports)
    png = plot_cdfs(
        by_label,
        cfg.clusters[0].ttft_slo_ms,
        cfg.clusters[0].tbt_slo_ms,
        out / "cdf.png",
        title=f"simulated: {Path(trace).name}, {len(arrivals)} requests, profile {profile.name}",
    )
    (out / "report.txt").write_text(table + "\n", encoding="utf-8")
    (out / "report.json").write_text(
        json.dumps(finite({"reports": [report_dict(r) for r in reports]}), indent=2) + "\n",
        encoding="utf-8",
    )
    print(table)
    print(f"records and report in {out}/, CDFs in {png}")
    return 0


def fit_vllm_cmd(args: argparse.Namespace) -> int:
    """`fit-profile --vllm-bench ...`: fit, check against every run given, write the YAML."""
    bs = args.vllm_block_size

    def read(spec: str):
        result, trace = bench_files(spec)
        return read_bench_run(result, trace, bs, args.vllm_hash_tokens)

    fit_runs = [read(s) for s in args.vllm_bench]
    held = [read(s) for s in args.vllm_holdout]
    kv, token_bytes = args.vllm_kv_tokens, args.vllm_token_bytes
    logs = [server_sizes(Path(r.name).with_suffix(".server.log")) for r in fit_runs]
    sizes = next((x for x in logs if x is not None), None)
    kv = kv or (sizes.kv_tokens if sizes else 0)
    token_bytes = token_bytes or (sizes.token_bytes if sizes else 0)
    if kv <= 0:
        raise ValueError("--vllm-kv-tokens: no server log beside the results states the pool")
    name = args.name or "vllm-cpu"
    profile, fit = fit_vllm_profile(fit_runs, name, args.vllm_budget, kv, token_bytes, bs,
                                    args.vllm_max_seqs)  # fmt: skip
    checks = check_runs(fit_runs + held, profile, {r.name for r in fit_runs}, args.ttft_slo_ms,
                        args.tpot_slo_ms)  # fmt: skip
    command = " ".join(
        ["halfmoon fit-profile"] + [f"--vllm-bench {s}" for s in args.vllm_bench]
        + [f"--vllm-holdout {s}" for s in args.vllm_holdout]
        + [f"--vllm-budget {args.vllm_budget}", f"--name {name}"]
        + [f"--{k.replace('_', '-')} {getattr(args, k)}" for k, default in (
            ("vllm_block_size", VLLM_CPU_BLOCK), ("vllm_max_seqs", VLLM_CPU_SEQS),
            ("vllm_hash_tokens", 16), ("vllm_kv_tokens", 0), ("vllm_token_bytes", 0))
           if getattr(args, k) != default]
        + ([f"--output {args.output}"] if args.output else [])
    )  # fmt: skip
    text = profile_yaml(profile, fit, checks, command)
    print(format_checks(checks))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"profile {name} written to {args.output} ({fit.busy_steps} steps fitted)")
    else:
        print(text, end="")
    return 0


def fit_profile_cmd(args: argparse.Namespace) -> int:
    if args.vllm_bench:
        return fit_vllm_cmd(args)
    if args.vllm_holdout:
        raise ValueError("--vllm-holdout checks a --vllm-bench fit: give --vllm-bench too")
    if not args.run_dir:
        raise ValueError("fit-profile: a replay folder, or --vllm-bench results")
    base = load_profile(args.base)
    profile, fit = fit_profile(args.run_dir, base, args.name)
    text = profile_yaml_text(profile)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text, encoding="utf-8")
        print(
            f"profile {profile.name} written to {args.output} "
            f"(decode from {fit.decode_rows} token gaps; see its sources)"
        )
    else:
        print(text, end="")
    return 0


__all__ = ["ClusterSpec", "PROFILE_DIR", "add_fit_args", "add_simulate_args"]
