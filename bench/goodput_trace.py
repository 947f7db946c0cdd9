"""A Mooncake trace at a small model's scale, for `bench/goodput.py`: a slice of its requests with
the prompt lengths divided by `--scale` (and the tokens each hash id stands for divided alike, so
equal ids still mean an equal prefix of the same share of the prompt), the answers capped, and the
arrival times stretched or squeezed to a mean of `--rate` requests a second (the gaps keep their
shape: bursts stay bursts). Written in Mooncake's own format (timestamp in ms, input_length,
output_length, hash_ids), which vLLM's `bench serve --dataset-name timed_trace` reads with
`--timed-trace-chunk-hash-size <512 / scale> --timed-trace-sec-multiplier 0.001`.

    .venv/bin/python bench/goodput_trace.py --out runs/goodput/trace.jsonl \
        [--trace client/data/mooncake_synthetic_trace.jsonl] [--requests 100] [--scale 32]
        [--rate 1.0]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.traces import (  # noqa: E402
    MOONCAKE_BLOCK_TOKENS,
    SHIPPED_TRACE,
    TraceRequest,
    load_trace,
)


def default_trace() -> Path:
    """The Mooncake synthetic trace as the client package ships it (the same file as the one
    the issue names under shared/traces)."""
    return SHIPPED_TRACE


def read_trace(path: str | Path) -> list[TraceRequest]:
    """The trace's requests in arrival order, checked line by line (client.load_trace)."""
    return load_trace(path, fmt="mooncake")


def chunk_tokens(scale: int) -> int:
    """Tokens per hash id at `scale`: a whole number, so that every id still stands for one
    equal-sized run of tokens (a partial last chunk as in the original)."""
    if scale < 1 or MOONCAKE_BLOCK_TOKENS % scale:
        raise ValueError(
            f"scale must divide {MOONCAKE_BLOCK_TOKENS} (1, 2, 4, ..., 512), got {scale}"
        )
    return MOONCAKE_BLOCK_TOKENS // scale


def scale_request(rec: TraceRequest, scale: int, max_output: int, max_len: int) -> dict:
    """One request at `scale`: its prompt ceil(input_length / scale) tokens over the same hash ids
    (ceil(ceil(L / s) / (512 / s)) = ceil(L / 512), so the id count is unchanged), its answer
    capped at `max_output`; a prompt that would not fit `max_len` beside its answer is cut to the
    whole chunks that do (its leading ids, and so its shared prefix, kept). `truncated` says so."""
    chunk = chunk_tokens(scale)
    output = max(1, min(rec.output_length, max_output))
    tokens = max(1, math.ceil(rec.input_length / scale))
    ids = list(rec.hash_ids)[: math.ceil(tokens / chunk)]
    room = max_len - output
    truncated = tokens > room
    if truncated:
        tokens = room // chunk * chunk or room  # whole chunks: the last id stays shareable
        ids = ids[: math.ceil(tokens / chunk)]
    return {
        "timestamp": rec.timestamp_ms,
        "input_length": tokens,
        "output_length": output,
        "hash_ids": ids,
        "truncated": truncated,
    }


def rescale_times(times_ms: list[float], rate: float) -> list[float]:
    """Arrival times (ms, from 0) with a mean gap of 1 / `rate` s: every gap multiplied by one
    factor, so the trace's bursts and lulls keep their relative sizes."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if len(times_ms) < 2:
        return [0.0 for _ in times_ms]
    t0, span = times_ms[0], times_ms[-1] - times_ms[0]
    if span <= 0:
        raise ValueError("the slice's requests all arrive at once: no rate to rescale")
    factor = (len(times_ms) - 1) * 1000.0 / (rate * span)
    return [round((t - t0) * factor, 3) for t in times_ms]


def convert(
    records: list[TraceRequest],
    requests: int,
    scale: int,
    rate: float,
    max_output: int = 256,
    max_len: int = 2048,
    start: int = 0,
) -> list[dict]:
    """`requests` requests from index `start` (of `records` in arrival order), scaled
    (scale_request) and re-timed to `rate` requests a second (rescale_times)."""
    if max_output >= max_len:
        raise ValueError(f"max_output {max_output} leaves no room for a prompt in {max_len}")
    picked = records[start : start + requests]
    if len(picked) < requests:
        raise ValueError(f"the trace has {len(records)} requests: no {requests} from {start}")
    out = [scale_request(r, scale, max_output, max_len) for r in picked]
    for r, t in zip(out, rescale_times([r["timestamp"] for r in out], rate)):
        r["timestamp"] = t
    return out


def write_trace(records: list[dict], path: str | Path) -> Path:
    """The requests as jsonl in the fields `timed_trace` reads (our own `truncated` left out)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = ("timestamp", "input_length", "output_length", "hash_ids")
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({k: r[k] for k in keys}) + "\n")
    return path


def describe(records: list[dict], scale: int) -> dict:
    """What the converted slice asks of a server: mean lengths, its rate, how much of it was cut,
    and the share of its prompt tokens in chunks seen earlier in the slice (what a prefix cache
    can save at best)."""
    chunk = chunk_tokens(scale)
    seen: set[int] = set()
    reused = total = 0
    for r in records:
        for i, h in enumerate(r["hash_ids"]):
            size = min(chunk, r["input_length"] - i * chunk)
            total += size
            reused += size if h in seen else 0
            seen.add(h)
    n = len(records)
    span_s = (records[-1]["timestamp"] - records[0]["timestamp"]) / 1000.0 if n > 1 else 0.0
    return {
        "requests": n,
        "scale": scale,
        "chunk_tokens": chunk,
        "mean_input": round(sum(r["input_length"] for r in records) / n, 1),
        "max_input": max(r["input_length"] for r in records),
        "mean_output": round(sum(r["output_length"] for r in records) / n, 1),
        "truncated": sum(bool(r.get("truncated")) for r in records),
        "reused_token_share": round(reused / total, 3) if total else 0.0,
        "rate": round((n - 1) / span_s, 4) if span_s else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", default=str(default_trace()), help="Mooncake-format jsonl")
    ap.add_argument("--out", required=True, help="the converted trace (jsonl)")
    ap.add_argument("--requests", type=int, default=100, help="requests in the slice")
    ap.add_argument("--start", type=int, default=0, help="index of the slice's first request")
    ap.add_argument("--scale", type=int, default=32, help="prompt lengths divided by this")
    ap.add_argument("--rate", type=float, default=1.0, help="mean arrivals a second")
    ap.add_argument("--max-output", type=int, default=256, help="answer length cap (tokens)")
    ap.add_argument("--max-len", type=int, default=2048, help="prompt + answer at most")
    args = ap.parse_args(argv)
    recs = convert(
        read_trace(args.trace), args.requests, args.scale, args.rate, args.max_output,
        args.max_len, args.start,
    )  # fmt: skip
    write_trace(recs, args.out)
    print(json.dumps({"out": args.out, **describe(recs, args.scale)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
