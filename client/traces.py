"""Request-trace loaders: Mooncake's JSONL and Azure's LLM inference CSV."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's released traces
# More tokens than any context window: a length beyond it is a broken line, not a request (and
# would make replay build a prompt of that size).
MAX_TRACE_TOKENS = 1 << 24

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
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v != int(v) or not minimum <= v <= MAX_TRACE_TOKENS:
        raise TraceError(
            f"{where}: {name!r} must be an integer in [{minimum}, {MAX_TRACE_TOKENS}], got {v!r}"
        )
    return int(v)


# Bytes that are not UTF-8 decode to these (surrogateescape), so each line is checked in turn:
# the first bad line is the one named, whatever is wrong with it.
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


def _text(path: str | Path) -> str:
    return Path(path).read_bytes().decode("utf-8", errors="surrogateescape")


def _check_utf8(text: str, where: str) -> None:
    if _NOT_UTF8.search(text):
        raise TraceError(f"{where}: not UTF-8 text")


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Mooncake JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`."""
    out: list[TraceRequest] = []
    with io.StringIO(_text(path), newline="\n") as f:  # lines end at \n only (as grep counts)
        for lineno, raw in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not raw.strip(" \t\r\n"):  # blank as JSON sees it (str.strip takes more)
                continue
            where = f"{path}:{lineno}"
            _check_utf8(raw, where)
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
            except (ValueError, RecursionError) as e:  # a 5000-digit number, arrays nested deep
                raise TraceError(f"{where}: not a trace record ({e})") from None
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
        seconds = float(value)
    except ValueError:
        return datetime.fromisoformat(value.strip()).timestamp()
    if not math.isfinite(seconds):
        raise ValueError(f"not a time: {value!r}")
    return seconds


def _rows(reader, path: str | Path):
    """(line, row) of a csv reader; a line the csv module refuses is a TraceError naming it."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise TraceError(f"{path}:{reader.line_num}: not a CSV row ({e})") from None
        yield reader.line_num, row


def load_azure(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Azure LLM inference CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`; no prefix sharing."""
    out: list[TraceRequest] = []
    next_id = 0
    t0: float | None = None
    with io.StringIO(_text(path), newline="\n") as f:  # lines end at \n only (as grep counts)
        reader = _rows(csv.reader(f), path)
        header = next(reader, None)
        cols = [c.strip() for c in (header[1] if header else [])]
        need = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if any(c not in cols for c in need):
            raise TraceError(
                f"{path}:1: expected a header with {','.join(need)}, got {','.join(cols)!r}"
            )
        pos = [cols.index(c) for c in need]
        for lineno, row in reader:
            if limit is not None and len(out) >= limit:
                break
            if not row or not "".join(row).strip():
                continue
            where = f"{path}:{lineno}"
            _check_utf8("".join(row), where)
            if len(row) < len(cols):
                raise TraceError(f"{where}: expected {len(cols)} columns, got {len(row)}")
            try:
                t = _azure_time(row[pos[0]])
            except (ValueError, OverflowError, OSError):  # not a time, or none a clock holds
                raise TraceError(f"{where}: bad TIMESTAMP {row[pos[0]]!r}") from None
            vals = {}
            for name, p, minimum in (("ContextTokens", pos[1], 1), ("GeneratedTokens", pos[2], 0)):
                try:
                    vals[name] = int(row[p])
                except ValueError:
                    raise TraceError(
                        f"{where}: {name} must be an integer, got {row[p]!r}"
                    ) from None
                if not minimum <= vals[name] <= MAX_TRACE_TOKENS:
                    raise TraceError(
                        f"{where}: {name} must be in [{minimum}, {MAX_TRACE_TOKENS}], "
                        f"got {vals[name]}"
                    )
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
