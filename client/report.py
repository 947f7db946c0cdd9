"""Replay records and the report computed from them (latency percentiles, SLO attainment, cache
hits)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

TIERS = ("device", "dram", "ssd", "remote")
WORST_GAP_SHARE = 0.10  # Mooncake's TBT: the mean of a request's slowest 10% of token gaps


class ReplayRecord(NamedTuple):
    """One replayed request, as written to records.jsonl."""

    index: int  # the trace request's index
    policy: str  # routing policy it was sent with ("" = the conductor's default)
    arrival_s: float  # planned send time, s from the start of the replay
    sent_s: float  # actual send time, s from the start of the replay
    status: str  # ok | rejected | error
    error: str  # the gRPC status and message when not ok
    prompt_tokens: int
    output_tokens: int  # tokens received
    ttft_ms: float  # client side: sent -> first token (nan when none came)
    gaps_ms: list[
        float
    ]  # time between consecutive tokens (server clock when it gave per-token times)
    e2e_ms: float  # sent -> last message
    cached_tokens: dict[str, int]  # prompt tokens whose KV came from a cache, by tier (TIERS)
    computed_tokens: int  # prompt tokens the prefill worker computed
    prefill_worker: str
    decode_worker: str
    predicted_ttft_ms: float = 0.0  # the routing policy's estimate (0 = none)
    predicted_tbt_ms: float = 0.0  # the routing policy's TBT estimate (0 = none)
    queue_ms: float = 0.0  # time it waited in the prefill worker's queue
    prefill_ms: float = 0.0  # its prefill round's first forward to its own last forward
    # sent -> the prefill's answer at the conductor (0 = not reported): TTFT less the wait for
    # the decode worker to admit it
    answered_ms: float = 0.0


class Percentiles(NamedTuple):
    p50: float
    p90: float
    p99: float


class PredictionError(NamedTuple):
    """How far the policy's estimates were from what was measured, over answered requests that
    carried one: relative error (predicted - measured) / measured."""

    requests: int  # answered requests with an estimate
    median_abs: float  # median of |relative error| (nan when none)
    p90_abs: float  # 90th percentile of |relative error|
    median: float  # median of the signed error: > 0 the policy over-predicted
    # predicted / measured, its median and 90th percentile: how admission's estimates sit
    # against what accepted requests then measured (1.3 at p90: 30% over for one in ten)
    ratio_p50: float = math.nan
    ratio_p90: float = math.nan


NO_ERROR = PredictionError(0, math.nan, math.nan, math.nan)
NO_PERCENTILES = Percentiles(math.nan, math.nan, math.nan)


def prediction_error(pairs: Iterable[tuple[float, float]]) -> PredictionError:
    """The error of (predicted, measured) pairs; pairs with no estimate or measure are skipped."""
    rel = np.asarray(
        [(p - m) / m for p, m in pairs if p > 0 and m > 0 and not math.isnan(m)], dtype=np.float64
    )
    if rel.size == 0:
        return NO_ERROR
    a, ratio = np.abs(rel), rel + 1.0  # (p - m) / m + 1 = p / m
    return PredictionError(
        int(rel.size),
        float(np.median(a)),
        float(np.percentile(a, 90)),
        float(np.median(rel)),
        float(np.median(ratio)),
        float(np.percentile(ratio, 90)),
    )


class Report(NamedTuple):
    """What a replay of one policy achieved."""

    policy: str
    requests: int  # sent
    done: int  # finished with an answer
    rejected: int  # refused early (RESOURCE_EXHAUSTED)
    errors: int  # failed otherwise
    ttft_ms: Percentiles  # over done requests
    tbt_ms: Percentiles  # over done requests, each request's TBT as Mooncake defines it
    ttft_slo_ms: float
    tbt_slo_ms: float  # 0 = TBT not judged
    # share of all requests meeting every SLO judged (rejected/failed ones do not)
    slo_attainment: float
    # goodput: requests meeting every SLO per second of the replay (first send -> last answer)
    goodput_rps: float
    prompt_tokens: int  # over done requests
    hit_rate: float  # cached prompt tokens / prompt tokens
    hit_rate_by_tier: dict[str, float]  # the same, per tier
    prefill_tokens_computed: int
    prefill_tokens_saved: int  # prompt tokens taken from a cache instead of computed
    output_tokens: int
    duration_s: float  # first send -> last answer
    output_tokens_per_s: float
    ttft_prediction: PredictionError = NO_ERROR  # the policy's TTFT estimate against the measure
    tbt_prediction: PredictionError = NO_ERROR  # its TBT estimate against the request's TBT
    # done requests whose prompt its decode worker prefilled (conditional disaggregation)
    prefilled_on_decode: int = 0
    # over done requests, each request's TPOT as vLLM's benchmark counts it (request_tpot)
    tpot_ms: Percentiles = NO_PERCENTILES
    tpot_slo_ms: float = 0.0  # 0 = TPOT not judged


def request_tbt(gaps_ms: Iterable[float]) -> float:
    """A request's TBT: the mean of its slowest 10% token gaps (at least one gap); 0 when it has
    none."""
    g = sorted(gaps_ms, reverse=True)
    if not g:
        return 0.0
    k = max(1, math.ceil(len(g) * WORST_GAP_SHARE))
    return float(sum(g[:k]) / k)


def request_tpot(r: ReplayRecord) -> float:
    """A request's TPOT as vLLM's benchmark counts it: (end-to-end - TTFT) / (output tokens - 1),
    the mean gap after the first token; 0 for an answer of one token (nan where it has no TTFT)."""
    if r.output_tokens < 2:
        return 0.0
    return float((r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1))


def percentiles(values: Iterable[float]) -> Percentiles:
    """p50/p90/p99 with linear interpolation (numpy's default); nan when empty."""
    v = np.asarray([x for x in values if not math.isnan(x)], dtype=np.float64)
    if v.size == 0:
        return Percentiles(math.nan, math.nan, math.nan)
    p = np.percentile(v, [50, 90, 99])
    return Percentiles(float(p[0]), float(p[1]), float(p[2]))


def meets_slo(
    r: ReplayRecord, ttft_slo_ms: float, tbt_slo_ms: float, tpot_slo_ms: float = 0.0
) -> bool:
    """Answered, its TTFT within `ttft_slo_ms`, and its TBT and TPOT within theirs where those
    are judged (> 0)."""
    return (
        r.status == "ok"
        and r.ttft_ms <= ttft_slo_ms
        and (tbt_slo_ms <= 0 or request_tbt(r.gaps_ms) <= tbt_slo_ms)
        and (tpot_slo_ms <= 0 or request_tpot(r) <= tpot_slo_ms)
    )


def end_s(records: Iterable[ReplayRecord]) -> float:
    """When the last of `records` ended (its send plus its end-to-end time), s from the replay's
    start; 0 for none."""
    ends = [r.sent_s + (0.0 if math.isnan(r.e2e_ms) else r.e2e_ms / 1000.0) for r in records]
    return max(ends, default=0.0)


def compute_report(
    records: list[ReplayRecord],
    ttft_slo_ms: float,
    tbt_slo_ms: float,
    policy: str = "",
    *,
    tpot_slo_ms: float = 0.0,
) -> Report:
    """The report of `records` judged by the objectives given (TBT's and TPOT's: 0 = not
    judged)."""
    done = [r for r in records if r.status == "ok"]
    prompt = sum(r.prompt_tokens for r in done)
    by_tier = {t: sum(r.cached_tokens.get(t, 0) for r in done) for t in TIERS}
    saved = sum(by_tier.values())
    out_tokens = sum(r.output_tokens for r in done)
    met = sum(meets_slo(r, ttft_slo_ms, tbt_slo_ms, tpot_slo_ms) for r in records)
    duration = end_s(records) - min(r.sent_s for r in records) if records else 0.0
    return Report(
        policy=policy or (records[0].policy if records else ""),
        requests=len(records),
        done=len(done),
        rejected=sum(r.status == "rejected" for r in records),
        errors=sum(r.status == "error" for r in records),
        ttft_ms=percentiles(r.ttft_ms for r in done),
        tbt_ms=percentiles(request_tbt(r.gaps_ms) for r in done),
        ttft_slo_ms=ttft_slo_ms,
        tbt_slo_ms=tbt_slo_ms,
        slo_attainment=met / len(records) if records else 0.0,
        goodput_rps=met / duration if duration > 0 else 0.0,
        prompt_tokens=prompt,
        hit_rate=saved / prompt if prompt else 0.0,
        hit_rate_by_tier={t: (n / prompt if prompt else 0.0) for t, n in by_tier.items()},
        prefill_tokens_computed=sum(r.computed_tokens for r in done),
        prefill_tokens_saved=saved,
        output_tokens=out_tokens,
        duration_s=duration,
        output_tokens_per_s=out_tokens / duration if duration > 0 else 0.0,
        ttft_prediction=prediction_error((r.predicted_ttft_ms, r.ttft_ms) for r in done),
        tbt_prediction=prediction_error(
            (r.predicted_tbt_ms, request_tbt(r.gaps_ms)) for r in done if r.gaps_ms
        ),
        prefilled_on_decode=sum(bool(r.decode_worker) and r.prefill_worker == r.decode_worker
                                for r in done),  # fmt: skip
        tpot_ms=percentiles(request_tpot(r) for r in done),
        tpot_slo_ms=tpot_slo_ms,
    )


def format_reports(reports: list[Report]) -> str:
    """The reports side by side, one column per policy."""

    def pct(p: Percentiles) -> str:
        return " / ".join("-" if math.isnan(x) else f"{x:.0f}" for x in p)

    rows: list[tuple[str, list[str]]] = [
        ("policy", [r.policy or "(default)" for r in reports]),
        ("requests", [str(r.requests) for r in reports]),
        ("done / rejected / errors", [f"{r.done} / {r.rejected} / {r.errors}" for r in reports]),
        ("TTFT p50/p90/p99 ms", [pct(r.ttft_ms) for r in reports]),
        ("TBT p50/p90/p99 ms", [pct(r.tbt_ms) for r in reports]),
        ("TPOT p50/p90/p99 ms", [pct(r.tpot_ms) for r in reports]),
        ("SLO attainment", [f"{100 * r.slo_attainment:.1f}% ({_objectives(r)})" for r in reports]),
        ("goodput req/s (SLOs met)", [f"{r.goodput_rps:.2f}" for r in reports]),
        ("prefix hit rate", [f"{100 * r.hit_rate:.1f}%" for r in reports]),
    ]
    for t in TIERS:
        rows.append((f"  from {t}", [f"{100 * r.hit_rate_by_tier[t]:.1f}%" for r in reports]))

    def err(e: PredictionError) -> str:
        if not e.requests:
            return "-"
        return f"{100 * e.median_abs:.0f}% / {100 * e.p90_abs:.0f}% ({100 * e.median:+.0f}%)"

    def ratio(e: PredictionError) -> str:
        return f"{e.ratio_p50:.2f} / {e.ratio_p90:.2f}" if e.requests else "-"

    rows += [
        ("TTFT pred. error p50/p90 (bias)", [err(r.ttft_prediction) for r in reports]),
        ("TBT pred. error p50/p90 (bias)", [err(r.tbt_prediction) for r in reports]),
        ("TTFT predicted/measured p50/p90", [ratio(r.ttft_prediction) for r in reports]),
        ("prefilled on the decode worker", [str(r.prefilled_on_decode) for r in reports]),
        ("prefill tokens computed", [str(r.prefill_tokens_computed) for r in reports]),
        ("prefill tokens saved", [str(r.prefill_tokens_saved) for r in reports]),
        ("output tokens/s", [f"{r.output_tokens_per_s:.1f}" for r in reports]),
        ("duration s", [f"{r.duration_s:.1f}" for r in reports]),
    ]
    w0 = max(len(k) for k, _ in rows)
    widths = [max(len(v[i]) for _, v in rows) for i in range(len(reports))]
    lines = []
    for k, vals in rows:
        lines.append("  ".join([k.ljust(w0)] + [v.rjust(w) for v, w in zip(vals, widths)]).rstrip())
    return "\n".join(lines)


def _objectives(r: Report) -> str:
    """The objectives a report judged by, as `TTFT<=2000, TPOT<=100 ms`."""
    judged = [("TTFT", r.ttft_slo_ms), ("TBT", r.tbt_slo_ms), ("TPOT", r.tpot_slo_ms)]
    return ", ".join(f"{name}<={ms:.0f}" for name, ms in judged if ms > 0 or name == "TTFT") + " ms"


def write_records(path: str | Path, records: Iterable[ReplayRecord]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r._asdict()) + "\n")


def read_records(path: str | Path) -> list[ReplayRecord]:
    with open(path, encoding="utf-8") as f:
        return [ReplayRecord(**json.loads(line)) for line in f if line.strip()]


def report_dict(r: Report) -> dict:
    d = r._asdict()
    d["ttft_ms"] = r.ttft_ms._asdict()
    d["tbt_ms"] = r.tbt_ms._asdict()
    d["tpot_ms"] = r.tpot_ms._asdict()
    d["ttft_prediction"] = r.ttft_prediction._asdict()
    d["tbt_prediction"] = r.tbt_prediction._asdict()
    return d
