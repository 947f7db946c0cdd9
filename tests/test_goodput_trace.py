"""bench/goodput_trace.py: a Mooncake trace at a small model's scale keeps its prefix structure,
fits the context, and arrives at the rate asked for with its bursts kept."""

import json
import math

import pytest

from bench.goodput_trace import (
    chunk_tokens,
    convert,
    describe,
    read_trace,
    rescale_times,
    write_trace,
)


def _trace(tmp_path, rows):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_trace(path)


ROWS = [  # a shared 2-block prefix (ids 0, 1), a burst at 1000 ms, a lull before the last
    {"timestamp": 0, "input_length": 1200, "output_length": 50, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 1100, "output_length": 500, "hash_ids": [0, 1, 3]},
    {"timestamp": 1000, "input_length": 600, "output_length": 7, "hash_ids": [4, 5]},
    {"timestamp": 5000, "input_length": 40000, "output_length": 10, "hash_ids": list(range(6, 85))},
]


def test_lengths_scaled_and_prefix_structure_kept(tmp_path):
    out = convert(_trace(tmp_path, ROWS), requests=3, scale=16, rate=1.0, max_output=64)
    chunk = chunk_tokens(16)
    assert chunk == 32
    assert [r["input_length"] for r in out] == [75, 69, 38]  # ceil(L / 16)
    assert [r["output_length"] for r in out] == [50, 64, 7]  # capped at 64
    for r, row in zip(out, ROWS):
        assert r["hash_ids"] == row["hash_ids"]  # ids unchanged...
        assert len(r["hash_ids"]) == math.ceil(r["input_length"] / chunk)  # ...one per chunk
    # the first two share exactly their first two chunks, as in the original trace
    a, b = out[0]["hash_ids"], out[1]["hash_ids"]
    assert a[:2] == b[:2] and a[2] != b[2]


def test_long_prompt_cut_to_whole_chunks_within_context(tmp_path):
    out = convert(_trace(tmp_path, ROWS), requests=4, scale=16, rate=1.0, max_len=2048)
    long = out[3]
    assert long["truncated"] and not any(r["truncated"] for r in out[:3])
    assert long["input_length"] + long["output_length"] <= 2048
    assert long["input_length"] % 32 == 0  # its last chunk is whole, so shareable
    assert long["hash_ids"] == list(range(6, 6 + long["input_length"] // 32))  # leading ids kept
    assert describe(out, 16)["truncated"] == 1


def test_rate_rescaled_and_burstiness_kept(tmp_path):
    out = convert(_trace(tmp_path, ROWS), requests=4, scale=16, rate=2.0)
    ts = [r["timestamp"] for r in out]
    assert ts[0] == 0.0
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(500.0)  # 2 per second: 500 ms mean gap
    assert gaps[1] == 0.0  # the burst stays a burst
    assert gaps[2] == pytest.approx(4 * gaps[0])  # and the lull four times the first gap
    assert describe(out, 16)["rate"] == pytest.approx(2.0)
    assert rescale_times([3.0], 5.0) == [0.0]


def test_written_in_timed_trace_fields(tmp_path):
    out = convert(_trace(tmp_path, ROWS), requests=2, scale=8, rate=0.5)
    path = write_trace(out, tmp_path / "out" / "t.jsonl")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [sorted(x) for x in lines] == [
        ["hash_ids", "input_length", "output_length", "timestamp"]
    ] * 2
    assert lines[1]["timestamp"] == pytest.approx(2000.0)  # ms, for sec-multiplier 0.001


def test_bad_arguments(tmp_path):
    recs = _trace(tmp_path, ROWS)
    with pytest.raises(ValueError, match="divide"):
        convert(recs, requests=2, scale=3, rate=1.0)
    with pytest.raises(ValueError, match="no 9"):
        convert(recs, requests=9, scale=16, rate=1.0)
    with pytest.raises(ValueError, match="rate"):
        convert(recs, requests=2, scale=16, rate=0.0)
    with pytest.raises(ValueError, match="at once"):
        convert(recs, requests=2, start=1, scale=16, rate=1.0)
