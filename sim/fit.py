"""A profile fitted from a real run: `halfmoon replay` output (records-*.jsonl, and report.json's
`cluster`, the workers' last load reports). Prefill: the workers' own per-forward fit (rounds
rebuilt from the records when there is none), plus the answer cost (serial and latency) the records
show; decode: each token gap against the batch and context of that moment, rebuilt from every
request's decode interval on the same worker."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from client.report import ReplayRecord, read_records
from servekit import DecodeTimeModel, PrefillTimeModel
from sim.profile import Profile

log = logging.getLogger(__name__)

MAX_GAP_ROWS = 4000  # decode gaps a fit takes (evenly spread over the run)


def answered_ms(r: ReplayRecord) -> float:
    """Sent to the prefill's answer. The first token is held after that until the decode worker
    admits the sequence, a wait the simulator's decode side models itself; records written
    before Usage carried the answer time fall back to TTFT (which then includes that wait)."""
    return r.answered_ms if r.answered_ms > 0 else r.ttft_ms


class Fit(NamedTuple):
    prefill_coef: tuple[float, float, float]
    decode_coef: tuple[float, float, float]
    prefill_rows: int
    decode_rows: int


ROUND_GAP_MS = 30.0  # requests whose rounds start this close together shared one round


def fit_prefill(
    records: list[ReplayRecord], prior, chunk_size: int
) -> tuple[tuple[float, ...], int]:
    """The live worker computes in rounds: the requests waiting when a round starts go through
    batched forwards of up to `chunk_size` tokens each, and the round ends with the last one's
    answer. Rounds are rebuilt from the records (a request's round starts when its queue wait
    ends, on its worker), and each round's length, per forward, is fitted against its tokens
    and tokens*context per forward."""
    by_worker: dict[str, list[tuple[float, float, int, int]]] = {}
    for r in records:
        if r.status != "ok" or math.isnan(r.ttft_ms) or r.computed_tokens <= 0:
            continue
        start = r.sent_s * 1000.0 + r.queue_ms
        by_worker.setdefault(r.prefill_worker, []).append(
            (start, r.sent_s * 1000.0 + answered_ms(r), r.computed_tokens, r.prompt_tokens)
        )
    model = PrefillTimeModel(prior=prior, window=1 << 20, min_samples=4)
    rounds = 0
    for jobs in by_worker.values():
        jobs.sort()
        groups: list[list[tuple[float, float, int, int]]] = []
        for j in jobs:
            if groups and j[0] - groups[-1][0][0] <= ROUND_GAP_MS:
                groups[-1].append(j)
            else:
                groups.append([j])
        for g in groups:
            chunk = chunk_size or max(c for _, _, c, _ in g)
            forwards = max(-(-c // chunk) for _, _, c, _ in g)
            tokens = sum(c for _, _, c, _ in g)
            work = 0.0  # sum over forwards of tokens * the position each chunk ends at
            for _, _, c, n in g:
                pos = n - c
                while pos < n:
                    e = min(n, pos + chunk)
                    work += (e - pos) * e
                    pos = e
            ms = max(e for _, e, _, _ in g) - min(s for s, _, _, _ in g)
            if ms <= 0:
                continue
            model.observe(ms / forwards, tokens / forwards, work / tokens)
            rounds += 1
    return tuple(model.coef), rounds


def prefill_windows(records: list[ReplayRecord]) -> list[tuple[float, float]]:
    """When the prefill workers computed (ms from the replay's start): each request's round on
    a prefill worker, from its queue wait's end for its round's time."""
    return sorted(
        (r.sent_s * 1000.0 + r.queue_ms, r.sent_s * 1000.0 + r.queue_ms + r.prefill_ms)
        for r in records
        if r.status == "ok" and r.prefill_ms > 0 and r.prefill_worker != r.decode_worker
    )


def fit_decode(
    records: list[ReplayRecord], prior, busy: Sequence[tuple[float, float]] = ()
) -> tuple[tuple[float, ...], int]:
    """Each gap but a request's first (that one holds its admission and KV pull) against the
    batch and KV tokens its worker held at that moment; gaps within a `busy` window (the host's
    prefill computing on the same CPUs: the simulator adds that wait itself) left out."""
    by_worker: dict[str, list[ReplayRecord]] = {}
    for r in records:
        if r.status == "ok" and len(r.gaps_ms) > 1 and not math.isnan(r.ttft_ms):
            by_worker.setdefault(r.decode_worker, []).append(r)
    rows: list[tuple[float, int, float]] = []
    for recs in by_worker.values():
        # each request's decode: (start, end, prompt, tokens over that time)
        spans = []
        for r in recs:
            start = r.sent_s * 1000.0 + r.ttft_ms
            spans.append((start, start + sum(r.gaps_ms), r.prompt_tokens, len(r.gaps_ms)))
        for r in recs:
            t = r.sent_s * 1000.0 + r.ttft_ms
            for g in r.gaps_ms[:1]:
                t += g
            for g in r.gaps_ms[1:]:
                mid = t + g / 2
                t += g
                if any(b0 <= mid <= b1 for b0, b1 in busy):
                    continue
                batch, context = 0, 0.0
                for s0, s1, prompt, tokens in spans:
                    if s0 <= mid <= s1:
                        batch += 1
                        context += prompt + tokens * (mid - s0) / max(s1 - s0, 1e-9)
                if batch:
                    rows.append((g, batch, context))
    if len(rows) > MAX_GAP_ROWS:
        step = len(rows) / MAX_GAP_ROWS
        rows = [rows[int(i * step)] for i in range(MAX_GAP_ROWS)]
    model = DecodeTimeModel(prior=prior, window=1 << 20, min_samples=4)
    for g, b, c in rows:
        model.observe(g, b, c)
    return tuple(model.coef), len(rows)


class AnswerCost(NamedTuple):
    serial_ms: float  # per answer, on the worker's thread: the next answer and round wait for it
    latency_ms: float  # per answer, on its way to the conductor: holds nothing of the worker's


def answer_cost(records: list[ReplayRecord]) -> AnswerCost:
    """The time a request's answer takes beyond its forwards, split in two. Requests answered by
    one forward report the same round time, and the worker answers them in turn (blocks written
    out, the reply built): their answers arrive a serial cost apart, the first one serial cost
    plus the reply's latency after the forward. Per group of two or more: the spread of its
    answers over its size less one, and the first answer's extra less that; the medians over
    groups. With no such group the least extra of each forward's answers is taken as serial
    (no latency), the median over forwards (0 if unknown)."""
    groups: dict[tuple[str, float], list[float]] = {}
    for r in records:
        if r.status != "ok" or r.prefill_ms <= 0 or math.isnan(r.ttft_ms):
            continue
        key = (r.prefill_worker, round(r.prefill_ms, 3))
        # answered after the forward's end (sent + queue wait + round = the forward's end)
        groups.setdefault(key, []).append(answered_ms(r) - r.queue_ms - r.prefill_ms)
    if not groups:
        return AnswerCost(0.0, 0.0)
    shared = [sorted(x) for x in groups.values() if len(x) >= 2]  # each forward's, in order
    if not shared:
        return AnswerCost(max(0.0, _median([min(x) for x in groups.values()])), 0.0)
    serial = max(0.0, _median([(x[-1] - x[0]) / (len(x) - 1) for x in shared]))
    latency = max(0.0, _median([x[0] for x in shared]) - serial)
    return AnswerCost(serial, latency)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def decode_join(records: list[ReplayRecord]) -> float:
    """The time a sequence takes to join its decode batch beyond what the simulator's decode side
    already charges. The live first token is held from the prefill's answer until the decode
    worker admits the sequence: it is taken in at a step boundary, its blocks pulled while the
    batch steps on, and it joins at the first boundary after that, so a hold is half a step on
    average, then a step, then whatever the pull and the calls take beyond it. Per request: its
    hold less 1.5 times its first gap (a step of the batch it joined); the median (0 if
    unknown: records from before Usage carried the answer time)."""
    xs = [
        r.ttft_ms - r.answered_ms - 1.5 * r.gaps_ms[0]
        for r in records
        if r.status == "ok" and r.answered_ms > 0 and r.gaps_ms and not math.isnan(r.ttft_ms)
    ]
    return max(0.0, _median(xs)) if xs else 0.0


def read_run(run_dir: str | Path) -> tuple[list[ReplayRecord], dict]:
    """Every records-*.jsonl of a replay output folder, and the cluster status ({} if none)."""
    d = Path(run_dir)
    files = sorted(d.glob("records-*.jsonl"))
    if not files:
        raise ValueError(f"{d}: no records-*.jsonl (the output folder of `halfmoon replay`)")
    records = [r for f in files for r in read_records(f)]
    cluster: dict = {}
    if (d / "report.json").is_file():
        cluster = json.loads((d / "report.json").read_text(encoding="utf-8")).get("cluster") or {}
    if not cluster and (d / "cluster.json").is_file():  # written apart by earlier tools
        cluster = json.loads((d / "cluster.json").read_text(encoding="utf-8"))
    if not cluster:
        log.warning(
            "%s: report.json holds no cluster status; the time models and pool sizes come "
            "from the records and the base profile",
            d,
        )
    return records, cluster


def _loads(cluster: dict, kind: str) -> list[dict]:
    return [
        w.get("load", {})
        for w in cluster.get("workers", [])
        if w.get("load", {}).get("kind") == kind
    ]


def _mean_coef(loads: list[dict], key: str) -> tuple[float, float, float] | None:
    coefs = [tuple(ld[key]) for ld in loads if len(ld.get(key, ())) == 3]
    if not coefs:
        return None
    c0, c1, c2 = (sum(c[i] for c in coefs) / len(coefs) for i in range(3))
    return c0, c1, c2


def fit_profile(run_dir: str | Path, base: Profile, name: str = "") -> tuple[Profile, Fit]:
    """`base` with the time models (and the pool and store sizes) of the run."""
    records, cluster = read_run(run_dir)
    pre, dec = _loads(cluster, "prefill"), _loads(cluster, "decode")
    # The workers' own fits anchor the records' fits (the ridge prior).
    p_prior = _mean_coef(pre, "prefill_coef") or base.prefill_coef
    d_prior = _mean_coef(dec, "decode_coef") or base.decode_coef
    worker_coef = _mean_coef(pre, "prefill_coef")
    p_coef: tuple[float, ...]
    if worker_coef is not None:
        # The workers' own per-forward fit is the model the simulator charges per forward;
        # rebuilding rounds from client-side times is the fallback (it cannot see which requests
        # shared a forward).
        p_coef, p_rows = worker_coef, len(pre)
    else:
        p_coef, p_rows = fit_prefill(records, p_prior, base.chunk_size)
    answer = answer_cost(records)
    join = decode_join(records)
    # Workers at one address share its CPUs (a local cluster: they take turns at them)
    hosts = {str(w.get("address", "")).rsplit(":", 1)[0] for w in cluster.get("workers", [])}
    shared = len(hosts) == 1 and bool(pre) and bool(dec)
    d_coef, d_rows = fit_decode(records, d_prior, prefill_windows(records) if shared else ())
    if worker_coef is None and p_rows < 4:
        log.warning("only %d prefill rounds: the prefill model leans on the base profile", p_rows)
    if d_rows < 4:
        log.warning("only %d token gaps: the decode model is the workers' own", d_rows)
    sizes = {}
    if dec:
        sizes["kv_blocks"] = int(dec[0].get("total_blocks", base.kv_blocks))
        sizes["max_batch"] = int(dec[0].get("max_batch", 0) or base.max_batch)
    if pre:
        sizes["block_bytes"] = int(pre[0].get("block_bytes", base.block_bytes))
        sizes["block_size"] = int(pre[0].get("block_size", base.block_size))
        if pre[0].get("device_node"):
            sizes["device_cache_blocks"] = int(pre[0].get("total_blocks", 0))
    for store in cluster.get("stores", [])[:1]:
        bb = sizes.get("block_bytes", base.block_bytes)
        for tier in store.get("tiers", []):
            key = {"dram": "dram_blocks", "ssd": "ssd_blocks"}.get(tier.get("tier"))
            if key:
                sizes[key] = int(int(tier.get("capacity_bytes", 0)) // bb)
    if shared:
        sizes["shared_host"] = True
    fitted = Fit(p_coef, d_coef, p_rows, d_rows)  # type: ignore[arg-type]
    profile = Profile(
        **{
            **base.__dict__,
            **sizes,
            "name": name or base.name,
            "prefill_coef": tuple(round(c, 9) for c in p_coef),
            "request_overhead_ms": round(answer.serial_ms, 3),
            "answer_latency_ms": round(answer.latency_ms, 3),
            "decode_join_ms": round(join, 3),
            "decode_coef": tuple(round(c, 9) for c in d_coef),
            "sources": (
                f"fitted by `halfmoon fit-profile` from {run_dir}: prefill "
                + (
                    f"the mean of {p_rows} workers' own per-forward fits"
                    if worker_coef is not None
                    else f"from {p_rows} rounds rebuilt from the records"
                )
                + ", the per-answer serial cost and latency from the spread and the first of "
                "the answers each forward gave (the time to the prefill's answer less queue "
                "wait and prefill round), the decode join the median first-token hold "
                f"beyond 1.5 steps, decode from {d_rows} token gaps against the "
                "batch and context rebuilt from the records; pool and store sizes from the "
                "workers' load reports",
                *base.sources,
            ),
        }
    )
    return profile, fitted
