"""`halfmoon replay TRACE`: replay a trace slice once per policy and write records, report and
PNG."""

from __future__ import annotations

import argparse
import json
import math
import secrets
from pathlib import Path
from typing import NamedTuple

from client.api import Client
from client.plot import plot_cdfs
from client.replay import ReplaySettings, replay
from client.report import (
    ReplayRecord,
    Report,
    compute_report,
    end_s,
    format_reports,
    report_dict,
    write_records,
)
from client.synth import Scaling, block_tokens, make_prompts
from client.traces import load_trace

FALLBACK_VOCAB = 256  # token ids below this exist in every vocabulary we serve
WARMUP_REQUESTS = 4  # requests each run starts with, under a salt of their own (not reported)


class ReplayResult(NamedTuple):
    """What a replay wrote and found."""

    reports: list[Report]  # one per policy, in the order replayed
    output_dir: Path  # records-<policy>.jsonl, report.json, report.txt
    png: Path  # TTFT and TBT CDFs per policy
    table: str  # the reports side by side, as printed


def cluster_vocab_size(address: str) -> int:
    """The served model's vocabulary size when the conductor reports it, else a safe small range."""
    with Client(address) as c:
        reply = c.status()
    return int(getattr(reply, "vocab_size", 0) or 0) or FALLBACK_VOCAB


def replay_trace(
    address: str,
    trace: str | Path,
    *,
    fmt: str = "auto",
    limit: int | None = None,
    scaling: Scaling | None = None,
    policies: list[str] = ("",),
    ttft_slo_ms: float = 2000.0,
    tbt_slo_ms: float = 200.0,
    tpot_slo_ms: float = 0.0,
    output_dir: str | Path = "runs/replay",
    vocab_size: int = 0,
    seed: int = 0,
    progress: bool = True,
    repeats: int = 1,
    warmup: int = WARMUP_REQUESTS,
) -> ReplayResult:
    """Replay the same slice `repeats` times per policy, the policies in alternating order
    (A B C, then C B A, ...) so that none always runs on the warmer cluster. Each run starts
    from the same state: the same `warmup` requests (the slice's first prompts under a salt of
    their own: the compute paths warm, their blocks never match the run's), then a cleared
    cache, then the slice under the run's own cache salt. A policy's report is over all its
    runs, end to end (its goodput: met requests over the runs' summed durations)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    scaling = scaling or Scaling()
    reqs = load_trace(trace, fmt, limit)
    if not reqs:
        raise ValueError(f"{trace}: no requests")
    prompts = make_prompts(reqs, scaling, vocab_size or cluster_vocab_size(address), seed)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(4)
    by_policy: dict[str, list[ReplayRecord]] = {p: [] for p in policies}
    runs = []
    for rep in range(repeats):
        for policy in policies if rep % 2 == 0 else list(reversed(policies)):
            name = policy or "default"
            if warmup:
                replay(address, prompts[:warmup], ReplaySettings(
                    policy=policy, cache_salt=f"warmup-{tag}-{rep}-{name}", progress=False,
                    ttft_slo_ms=ttft_slo_ms, tbt_slo_ms=tbt_slo_ms, tpot_slo_ms=tpot_slo_ms,
                ))  # fmt: skip
            with Client(address) as c:
                c.clear_cache()
            settings = ReplaySettings(
                policy=policy,
                cache_salt=f"replay-{tag}-{rep}-{name}",
                ttft_slo_ms=ttft_slo_ms,
                tbt_slo_ms=tbt_slo_ms,
                tpot_slo_ms=tpot_slo_ms,
                progress=progress,
                desc=name if repeats == 1 else f"{name} ({rep + 1}/{repeats})",
            )
            records = replay(address, prompts, settings)
            run = compute_report(records, ttft_slo_ms, tbt_slo_ms, policy, tpot_slo_ms=tpot_slo_ms)
            runs.append({"policy": policy, "repeat": rep, "goodput_rps": run.goodput_rps,
                         "slo_attainment": run.slo_attainment})  # fmt: skip
            # the runs end to end: this one's times from where the policy's last one ended
            done = by_policy[policy]
            offset = end_s(done)
            done.extend(r._replace(sent_s=r.sent_s + offset) for r in records)
    reports = []
    for policy, records in by_policy.items():
        write_records(out / f"records-{policy or 'default'}.jsonl", records)
        reports.append(
            compute_report(records, ttft_slo_ms, tbt_slo_ms, policy, tpot_slo_ms=tpot_slo_ms)
        )
    png = plot_cdfs(
        by_policy,
        ttft_slo_ms,
        tbt_slo_ms,
        out / "cdf.png",
        title=f"{Path(trace).name}: {len(prompts)} requests, time x{scaling.time_scale:g}, "
        f"{scaling.trace_block_tokens}-token trace block -> {block_tokens(scaling)} tokens",
    )
    table = format_reports(reports)
    (out / "report.txt").write_text(table + "\n", encoding="utf-8")
    summary = {
        "trace": str(trace),
        "requests": len(prompts),
        "scaling": scaling._asdict(),
        "reports": [report_dict(r) for r in reports],
        "repeats": repeats,
        "runs": runs,  # each run's goodput and attainment, in the order they ran
        # the workers' last load reports (fitted time models, pool sizes) and the stores' tiers:
        # what `halfmoon fit-profile` turns into a simulator profile alongside the records
        "cluster": cluster_status(address),
    }
    (out / "report.json").write_text(
        json.dumps(_finite(summary), indent=2) + "\n", encoding="utf-8"
    )
    return ReplayResult(reports, out, png, table)


def cluster_status(address: str) -> dict:
    """The conductor's Status reply as a dict (workers' load reports, stores' tiers)."""
    from google.protobuf.json_format import MessageToDict

    with Client(address) as c:
        reply = c.status()
    return MessageToDict(reply, preserving_proto_field_name=True)


def _finite(x):
    """JSON without NaN: missing figures become null."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def parse_policies(compare: str, policy: str) -> list[str]:
    policies = [p.strip() for p in compare.split(",") if p.strip()] if compare else [policy]
    if len(set(policies)) != len(policies):
        raise ValueError(f"--compare-policies names a policy twice: {compare}")
    return policies


def run(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1")
    for name in ("time_scale", "length_scale"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    for name in ("tbt_slo_ms", "tpot_slo_ms"):
        if not getattr(args, name, 0.0) >= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0 = not judged)")
    scaling = Scaling(
        length_scale=args.length_scale,
        time_scale=args.time_scale,
        max_output=args.max_output,
        max_input=getattr(args, "max_input", None),
    )
    result = replay_trace(
        args.address,
        args.trace,
        fmt=args.format,
        limit=args.limit,
        scaling=scaling,
        policies=parse_policies(args.compare_policies, args.policy),
        ttft_slo_ms=args.ttft_slo_ms,
        tbt_slo_ms=args.tbt_slo_ms,
        tpot_slo_ms=getattr(args, "tpot_slo_ms", 0.0) or 0.0,
        output_dir=args.output,
        vocab_size=getattr(args, "vocab_size", 0) or 0,
        seed=getattr(args, "seed", 0) or 0,
        repeats=getattr(args, "repeats", 1) or 1,
    )
    print(result.table)
    print(f"records and report in {result.output_dir}/, CDFs in {result.png}")
    print(json.dumps(_finite({"reports": [report_dict(r) for r in result.reports]})))
    return 0
