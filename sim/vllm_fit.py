"""A vLLM-baseline profile fitted from `vllm bench serve` runs (`--save-result --save-detailed`:
per request its TTFT, inter-token latencies and lengths) of a Mooncake-format trace, such as
`bench/goodput.py` writes (`vllm-<rate>.json` beside `trace-<rate>.jsonl` and the server's log).

The engine's steps are rebuilt from what the client saw: every step streams a token to each
sequence it carried at once, so the tokens of all requests, sorted, come in bursts (within a few
ms) separated by whole steps (tens of ms and more); a step is one burst, its time the span from
the burst before when the engine went on at once. Which sequences it decoded is seen (their
tokens); which prompt tokens it computed is replayed with vLLM's scheduler: the budget less the
step's decodes, prompts first come first served, their cached prefix (the trace's hash ids at
vLLM's block size) skipped, each prompt finishing in the step its first token came out of. A
request reaches the scheduler `intake_ms` after it was sent: the smallest value (on a 5 ms grid)
for which the fewest first tokens disagree with that replay. The step model (`step_ms`) is then
fitted by least squares with coefficients >= 0, Huber-weighted (a step slowed by a neighbour's
burst on the shared cores does not drag it)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from client.traces import load_trace
from servekit import reusable_blocks
from sim.arrivals import SimRequest, TraceScaling, make_arrivals
from sim.cache import BlockCache
from sim.index import GlobalIndex
from sim.profile import Profile

GAP_MS = 10.0  # tokens that reached the client this close together came out of one step
INTAKE_GRID_MS = tuple(float(x) for x in range(0, 101, 5))
VLLM_CPU_BLOCK = 128  # vLLM-CPU's default KV block size (platforms/cpu.py)
VLLM_CPU_SEQS = 128  # its max_num_seqs for the OpenAI server (engine/arg_utils.py)


class BenchRun(NamedTuple):
    name: str  # the result file
    trace: str  # the trace it replayed
    arrivals: list[SimRequest]  # the trace's requests, their prompt keys at vLLM's block size
    send_ms: list[float]  # when the client sent each request, from the first one
    ttft_ms: list[float]
    itl_ms: list[list[float]]  # each request's gaps between tokens
    latency_ms: list[float]  # each request's end to end
    output_tokens: list[int]
    duration_s: float  # bench serve's duration: the denominator of its goodput


def read_bench_run(
    result: str | Path, trace: str | Path, block_size: int, hash_tokens: int = 16
) -> BenchRun:
    """One `vllm bench serve` result (with --save-detailed) and the trace it replayed, whose
    hash ids stand for `hash_tokens` tokens each (its --timed-trace-chunk-hash-size)."""
    raw = json.loads(Path(result).read_text(encoding="utf-8"))
    missing = [k for k in ("ttfts", "itls", "start_times", "input_lens") if not raw.get(k)]
    if missing:
        raise ValueError(f"{result}: no {missing} (run bench serve with --save-detailed)")
    reqs = load_trace(trace, "mooncake")
    arrivals = make_arrivals(reqs, TraceScaling(trace_block_tokens=hash_tokens), block_size)
    n = len(raw["ttfts"])
    if [a.input_tokens for a in arrivals[:n]] != list(raw["input_lens"]):
        raise ValueError(f"{result}: its prompts' lengths are not those of {trace}'s requests")
    s0 = min(raw["start_times"])
    return BenchRun(
        str(result), str(trace), arrivals[:n], [(t - s0) * 1000.0 for t in raw["start_times"]],
        [t * 1000.0 for t in raw["ttfts"]], [[g * 1000.0 for g in x] for x in raw["itls"]],
        [t * 1000.0 for t in raw["latencies"]], list(raw["output_lens"]), float(raw["duration"]),
    )  # fmt: skip


class ServerSizes(NamedTuple):
    kv_tokens: int  # the engine's KV pool, tokens
    token_bytes: int  # KV bytes a token takes (all layers)


def server_sizes(log: str | Path) -> ServerSizes | None:
    """The KV pool vLLM's log states ("CPU KV cache size: N tokens", "(G/...) GiB for KV
    cache"); None when the log says neither."""
    path = Path(log)
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    tokens = re.search(r"KV cache size: ([\d,]+) tokens", text)
    gib = re.search(r"\(([\d.]+)/[\d.]+\) GiB for KV cache", text)
    if not tokens:
        return None
    kv = int(tokens.group(1).replace(",", ""))
    return ServerSizes(kv, int(float(gib.group(1)) * 2**30 // kv) if gib else 0)


class StepRow(NamedTuple):
    end_ms: float  # when its tokens reached the client
    ms: float  # its time: from the step before (busy) or from its first prompt's intake
    busy: bool  # the engine went on from the step before at once (ms is the step's own)
    decodes: int  # sequences it decoded a token of
    decode_context: int  # KV tokens those read (prompt + tokens so far, each)
    prefill_tokens: int  # prompt tokens it computed
    prefill_work: float  # sum over its chunks of tokens x the position the chunk ends at


class Rebuilt(NamedTuple):
    rows: list[StepRow]
    mismatches: int  # first tokens the scheduler replay could not place where they came out


def client_steps(run: BenchRun, gap_ms: float = GAP_MS) -> list[list[tuple[float, int, int]]]:
    """The tokens as (time, request, its token number), grouped into the steps they came from."""
    ev = []
    for i, (t0, ttft, itl) in enumerate(zip(run.send_ms, run.ttft_ms, run.itl_ms)):
        t = t0 + ttft
        ev.append((t, i, 0))
        for k, g in enumerate(itl, 1):
            t += g
            ev.append((t, i, k))
    ev.sort()
    steps: list[list[tuple[float, int, int]]] = []
    for e in ev:
        if steps and e[0] - steps[-1][-1][0] <= gap_ms:
            steps[-1].append(e)
        else:
            steps.append([e])
    return steps


def rebuild_steps(
    run: BenchRun, budget: int, block_size: int, kv_blocks: int, intake_ms: float,
    steps: list[list[tuple[float, int, int]]] | None = None,
) -> Rebuilt:  # fmt: skip
    """Each step's decodes (seen) and prefill (vLLM's scheduler replayed; see the module)."""
    steps = client_steps(run) if steps is None else steps
    n = len(run.send_ms)
    first = [0] * n
    last = [0] * n
    for si, st in enumerate(steps):
        for _, i, k in st:
            last[i] = si
            if k == 0:
                first[i] = si
    order = sorted(range(n), key=lambda i: run.send_ms[i])
    cache = BlockCache("vllm", GlobalIndex(), kv_blocks)
    pos: dict[int, int] = {}  # request -> prompt tokens in the pool so far
    rows, mismatches = [], 0
    going: set[int] = set()  # sequences the step before carried and left unfinished
    prev_end = 0.0
    for si, st in enumerate(steps):
        decoded = [(i, k) for _, i, k in st if k >= 1]
        ready = [i for i in order if first[i] >= si and (
            run.send_ms[i] + intake_ms <= prev_end or first[i] == si)]  # fmt: skip
        busy = bool(going & ({i for i, _ in decoded} | {i for i in ready if i in pos}))
        if busy or not ready:
            start = prev_end
        else:
            start = max(prev_end, min(run.send_ms[i] + intake_ms for i in ready))
        left = budget - len(decoded)
        tokens, work, chunked, hidden = 0, 0.0, [], False
        for i in ready:
            a = run.arrivals[i]
            if i not in pos:
                if left <= 0 and first[i] != si:
                    continue  # not admitted yet: its cached prefix is looked up when it is
                cap = reusable_blocks(len(a.keys), a.input_tokens, block_size)
                pos[i] = cache.held(a.keys[:cap]).blocks * block_size
            rem = a.input_tokens - pos[i]
            c = min(rem, max(left, 0))
            if first[i] == si:  # it finished here, whatever the replay says
                if c < rem and not decoded:  # steps before, with nothing to stream, unseen
                    hidden = True
                else:
                    mismatches += c < rem
                c = rem
            elif c == rem:  # the replay would finish it a step early: it was not in yet
                mismatches += 1
                c = 0
            if c <= 0:
                continue
            left -= c
            tokens += c
            work += c * (pos[i] + c)
            pos[i] += c
            chunked.append(i)
        for i in chunked:  # cached once the step has computed them, for the steps after
            cache.insert(run.arrivals[i].keys[: pos[i] // block_size])
        ctx = sum(run.arrivals[i].input_tokens + k for i, k in decoded)
        end = st[0][0]
        # a step hiding others is not fitted (its time is theirs too)
        rows.append(StepRow(end, end - start, busy and not hidden, len(decoded), ctx, tokens, work))
        going = {i for i in [i for i, _ in decoded] + chunked + [i for _, i, k in st if k == 0]
                 if last[i] > si}  # fmt: skip
        prev_end = end
    return Rebuilt(rows, mismatches)


def fit_intake(
    runs: list[BenchRun], budget: int, block_size: int, kv_blocks: int
) -> tuple[float, int]:
    """(intake ms, mismatches there): the smallest grid value with the fewest mismatches."""
    cached = [client_steps(r) for r in runs]
    best: tuple[int, float] | None = None
    for ms in INTAKE_GRID_MS:
        m = sum(rebuild_steps(r, budget, block_size, kv_blocks, ms, s).mismatches
                for r, s in zip(runs, cached))  # fmt: skip
        if best is None or m < best[0]:
            best = (m, ms)
    assert best is not None
    return best[1], best[0]


def step_features(r: StepRow) -> list[float]:
    """The step model's columns: decode_coef's (1, decodes, their context), then prefill_coef's
    (a step with prefill, its tokens, its work)."""
    has = 1.0 if r.prefill_tokens else 0.0
    return [1.0, r.decodes, r.decode_context, has, r.prefill_tokens, r.prefill_work]


def _nnls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0: a column whose coefficient comes out
    negative is dropped (held at 0) and the rest refitted, until none is."""
    free = list(range(x.shape[1]))
    sol = np.zeros(x.shape[1])
    sw = np.sqrt(w)
    while free:
        scale = np.maximum(np.abs(x[:, free]).max(axis=0), 1e-12)
        a = x[:, free] / scale * sw[:, None]
        s, *_ = np.linalg.lstsq(a, y * sw, rcond=None)
        s = s / scale
        if (s >= 0).all():
            sol[:] = 0.0
            sol[free] = s
            return sol
        free.pop(int(np.argmin(s)))
    return sol


def fit_step_model(rows: list[StepRow]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(decode_coef, prefill_coef) of `step_ms`, from the busy steps (Huber-weighted, >= 0)."""
    use = [r for r in rows if r.busy and r.ms > 0]
    if len(use) < 8:
        raise ValueError(f"only {len(use)} steps to fit: the runs are too short")
    x = np.array([step_features(r) for r in use], dtype=np.float64)
    y = np.array([r.ms for r in use], dtype=np.float64)
    w = np.ones(len(y))
    for _ in range(10):  # iteratively reweighted: Huber weights from the residuals' spread
        sol = _nnls(x, y, w)
        r = np.abs(y - x @ sol)
        mad = 1.4826 * float(np.median(r)) + 1e-6
        w = np.minimum(1.0, 1.345 * mad / np.maximum(r, 1e-12))
    c = [float(v) for v in sol]
    return (c[0], c[1], c[2]), (c[3], c[4], c[5])


class VllmFit(NamedTuple):
    intake_ms: float  # request sent -> the scheduler sees it
    mismatches: int  # first tokens the replay could not place, at that intake
    steps: int  # steps rebuilt, all runs
    busy_steps: int  # ... of which fitted (the engine went on from the step before)
    rows: list[StepRow]  # every step rebuilt, all runs


def fit_vllm(
    runs: list[BenchRun], budget: int, block_size: int, kv_blocks: int
) -> tuple[tuple[float, ...], tuple[float, ...], VllmFit]:
    """(decode_coef, prefill_coef, how) of the step model from the runs."""
    intake, mism = fit_intake(runs, budget, block_size, kv_blocks)
    rows = [row for r in runs
            for row in rebuild_steps(r, budget, block_size, kv_blocks, intake).rows]  # fmt: skip
    dec, pre = fit_step_model(rows)
    return dec, pre, VllmFit(intake, mism, len(rows), sum(r.busy for r in rows), rows)


def fit_vllm_profile(
    runs: list[BenchRun],
    name: str,
    budget: int,
    kv_tokens: int,
    token_bytes: int,
    block_size: int = VLLM_CPU_BLOCK,
    max_seqs: int = VLLM_CPU_SEQS,
) -> tuple[Profile, VllmFit]:
    """A profile for `ClusterSpec(colocated_kind="vllm")`: the fitted step model, the engine's
    budget (max_batch_tokens), max_num_seqs (max_batch), pool and block, the intake (as
    decode_join_ms: the time before a request can join the engine's batch)."""
    kv_blocks = kv_tokens // block_size
    dec, pre, fit = fit_vllm(runs, budget, block_size, kv_blocks)
    profile = Profile(
        name=name,
        block_size=block_size,
        prefill_coef=tuple(round(c, 9) for c in pre),  # type: ignore[arg-type]
        decode_coef=tuple(round(c, 9) for c in dec),  # type: ignore[arg-type]
        block_bytes=max(1, token_bytes * block_size),
        kv_blocks=kv_blocks,
        max_batch=max_seqs,
        chunk_size=budget,
        max_batch_tokens=budget,
        device_cache_blocks=kv_blocks,
        decode_join_ms=fit.intake_ms,
        sources=(
            "fitted by `halfmoon fit-profile --vllm-bench` (sim.vllm_fit) from the fit runs "
            f"below: {fit.steps} engine steps rebuilt from the client's token times ({GAP_MS:g} ms "
            f"apart = one step), their prefill replayed with vLLM's scheduler (budget {budget}, "
            f"block {block_size}, prefix cache), {fit.busy_steps} steps back to back fitted by "
            "Huber-weighted least squares with coefficients >= 0; the intake (decode_join_ms) "
            f"the smallest on a 5 ms grid leaving the fewest first tokens unplaced "
            f"({fit.mismatches})",
            *(f"{FIT_RUN}{r.name} (trace {r.trace})" for r in runs),
        ),
    )
    return profile, fit


def bench_files(spec: str) -> tuple[Path, Path]:
    """(result, trace) of "RESULT[,TRACE]"; without TRACE, bench/goodput.py's layout: the
    trace of `vllm-<rate>.json` is `trace-<rate>.jsonl` beside it."""
    result, _, trace = spec.partition(",")
    path = Path(result)
    if trace:
        return path, Path(trace)
    m = re.fullmatch(r"vllm-(.+)\.json", path.name)
    if not m:
        raise ValueError(f"{spec}: name its trace (RESULT,TRACE): not a vllm-<rate>.json")
    return path, path.with_name(f"trace-{m.group(1)}.jsonl")


FIT_RUN = "fit run: "  # a source line naming one run a profile was fitted on


def fitted_runs(profile: Profile) -> set[str]:
    """The result files a profile fitted by fit_vllm_profile names as its fit runs."""
    return {s[len(FIT_RUN) :].split(" ")[0] for s in profile.sources if s.startswith(FIT_RUN)}
