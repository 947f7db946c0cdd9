"""Request-trace loaders: Mooncake's JSONL and Azure's LLM inference CSV."""

from __future__ import annotations

import csv
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Callable, NamedTuple

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's released traces

# Mooncake's released synthetic trace (Apache-2.0), installed with this package: see data/README.md.
SHIPPED_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl"


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


class TraceRequest(NamedTuple):
    """One request of a trace, as the trace states it (unscaled)."""

    index: int  # position in the trace (0-based, after sorting by time)
    timestamp_ms: float  # arrival, ms from the start of the trace
    input_length: int  # prompt tokens
    output_length: int  # answer tokens
    hash_ids: tuple[
        int, ...
    ]  # one id per trace block of the prompt; equal leading ids = equal prefix
    line: int  # 1-based line in the file, for messages


def _int_field(obj: dict, name: str, where: str, minimum: int) -> int:
    if name not in obj:
        raise TraceError(f"{where}: missing field {name!r}")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < minimum:
        raise TraceError(f"{where}: {name!r} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Mooncake JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object")
            ts = obj.get("timestamp")
            if (
                isinstance(ts, bool)
                or not isinstance(ts, (int, float))
                or not math.isfinite(ts)
                or ts < 0
            ):
                raise TraceError(f"{where}: 'timestamp' must be a number of ms >= 0, got {ts!r}")
            inp = _int_field(obj, "input_length", where, 1)
            outp = _int_field(obj, "output_length", where, 0)
            ids = obj.get("hash_ids", [])
            if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in ids
            ):
                raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
            out.append(TraceRequest(0, float(ts), inp, outp, tuple(ids), lineno))
    return _sorted(out)


def _azure_time(value: str) -> float:
    """Seconds: an ISO date-time (Azure's format) or a plain number of seconds."""
    try:
        return float(value)
    except ValueError:
        return datetime.fromisoformat(value.strip()).timestamp()


def load_azure(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Azure LLM inference CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`; no prefix sharing."""
    out: list[TraceRequest] = []
    next_id = 0
    t0: float | None = None
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        cols = [c.strip() for c in header or []]
        need = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if any(c not in cols for c in need):
            raise TraceError(
                f"{path}:1: expected a header with {','.join(need)}, got {','.join(cols)!r}"
            )
        pos = [cols.index(c) for c in need]
        for row in reader:
            lineno = reader.line_num
            if limit is not None and len(out) >= limit:
                break
            if not row or not "".join(row).strip():
                continue
            where = f"{path}:{lineno}"
            if len(row) < len(cols):
                raise TraceError(f"{where}: expected {len(cols)} columns, got {len(row)}")
            try:
                t = _azure_time(row[pos[0]])
            except ValueError:
                raise TraceError(f"{where}: bad TIMESTAMP {row[pos[0]]!r}") from None
            vals = {}
            for name, p, minimum in (("ContextTokens", pos[1], 1), ("GeneratedTokens", pos[2], 0)):
                try:
                    vals[name] = int(row[p])
                except ValueError:
                    raise TraceError(
                        f"{where}: {name} must be an integer, got {row[p]!r}"
                    ) from None
                if vals[name] < minimum:
                    raise TraceError(f"{where}: {name} must be >= {minimum}, got {vals[name]}")
            t0 = t if t0 is None else t0
            n_blocks = -(-vals["ContextTokens"] // MOONCAKE_BLOCK_TOKENS)
            ids = tuple(
                range(next_id, next_id + n_blocks)
            )  # fresh ids: Azure's trace has no content
            next_id += n_blocks
            out.append(
                TraceRequest(
                    0,
                    (t - t0) * 1000.0,
                    vals["ContextTokens"],
                    vals["GeneratedTokens"],
                    ids,
                    lineno,
                )
            )
    return _sorted(out)


def _sorted(reqs: list[TraceRequest]) -> list[TraceRequest]:
    reqs = sorted(reqs, key=lambda r: r.timestamp_ms)  # stable: equal times keep file order
    return [r._replace(index=i) for i, r in enumerate(reqs)]


LOADERS: dict[str, Callable[..., list[TraceRequest]]] = {
    "mooncake": load_mooncake,
    "azure": load_azure,
}


def load_trace(path: str | Path, fmt: str = "auto", limit: int | None = None) -> list[TraceRequest]:
    """Load a trace by format name; `auto` picks Azure for .csv, Mooncake otherwise."""
    if fmt == "auto":
        fmt = "azure" if str(path).lower().endswith(".csv") else "mooncake"
    if fmt not in LOADERS:
        raise ValueError(f"unknown trace format {fmt!r} (known: {', '.join(LOADERS)})")
    if not Path(path).is_file():
        raise FileNotFoundError(f"no trace file at {path}")
    return LOADERS[fmt](path, limit=limit)
