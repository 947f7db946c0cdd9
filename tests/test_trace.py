"""Trace loaders (the shipped Mooncake trace, Azure CSV, malformed lines) and hash-id -> token
runs."""

import json
import math

import pytest

from client import SHIPPED_TRACE as SHIPPED
from client import (
    Scaling,
    TraceError,
    TraceRequest,
    load_azure,
    load_mooncake,
    load_trace,
    make_prompts,
    prompt_tokens,
)


def test_shipped_mooncake_trace():
    assert SHIPPED.is_file()  # package data of `client`: in every checkout and every install
    reqs = load_trace(SHIPPED)
    lines = [json.loads(x) for x in SHIPPED.read_text().splitlines() if x.strip()]
    assert len(reqs) == len(lines) == 3993
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(reqs, reqs[1:]))
    # every request has one id per 512-token block, as the trace's README states
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in reqs)
    by_line = {r.line: r for r in reqs}
    for lineno in (1, 2, 1000, 3993):
        obj, r = lines[lineno - 1], by_line[lineno]
        assert (r.timestamp_ms, r.input_length, r.output_length, list(r.hash_ids)) == (
            obj["timestamp"],
            obj["input_length"],
            obj["output_length"],
            obj["hash_ids"],
        )
    head = load_trace(SHIPPED, limit=7)
    assert head == reqs[:7]


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize(
    "bad, words",
    [
        ('{"timestamp": 5, "input_length": 3', "not valid JSON"),
        ("[1, 2, 3]", "JSON object"),
        ('{"timestamp": 5, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": -1, "input_length": 3, "output_length": 1, "hash_ids": []}', "timestamp"),
        (
            '{"timestamp": "soon", "input_length": 3, "output_length": 1, "hash_ids": []}',
            "timestamp",
        ),
        ('{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        (
            '{"timestamp": 1, "input_length": 2.5, "output_length": 1, "hash_ids": []}',
            "input_length",
        ),
        (
            '{"timestamp": 1, "input_length": 3, "output_length": true, "hash_ids": []}',
            "output_length",
        ),
        (
            '{"timestamp": 1, "input_length": 3, "output_length": 1, "hash_ids": [1, "x"]}',
            "hash_ids",
        ),
    ],
)
def test_mooncake_malformed_line_names_its_line(tmp_path, bad, words):
    p = _write(tmp_path, "t.jsonl", GOOD + "\n" + bad + "\n" + GOOD)
    with pytest.raises(TraceError) as e:
        load_mooncake(p)
    assert f"{p}:3:" in str(e.value) and words in str(e.value)


def test_mooncake_limit_stops_before_a_later_bad_line(tmp_path):
    p = _write(tmp_path, "t.jsonl", GOOD * 2 + "garbage\n")
    assert len(load_trace(p, limit=2)) == 2
    with pytest.raises(TraceError, match=":3:"):
        load_trace(p)


def test_azure_csv(tmp_path):
    p = _write(
        tmp_path,
        "azure.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,1100,20\n"
        "2023-11-16 18:15:47.1805900,300,7\n"
        "2023-11-16 18:15:46.9805900,50,0\n",
    )
    reqs = load_trace(p)  # .csv -> the Azure loader
    assert [(r.line, r.input_length, r.output_length) for r in reqs] == [
        (2, 1100, 20),
        (4, 50, 0),
        (3, 300, 7),
    ]
    assert [round(r.timestamp_ms, 3) for r in reqs] == [0.0, 300.0, 500.0]
    assert [len(r.hash_ids) for r in reqs] == [3, 1, 1]
    ids = [h for r in reqs for h in r.hash_ids]
    assert len(ids) == len(
        set(ids)
    )  # the Azure trace has no content: no two requests share a prefix


@pytest.mark.parametrize(
    "row, words",
    [
        ("2023-11-16 18:15:47,abc,3", "ContextTokens"),
        ("not-a-time,10,3", "TIMESTAMP"),
        ("2023-11-16 18:15:47,10", "columns"),
        ("2023-11-16 18:15:47,10,-1", "GeneratedTokens"),
    ],
)
def test_azure_malformed_line_names_its_line(tmp_path, row, words):
    p = _write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,5,5\n" + row + "\n")
    with pytest.raises(TraceError) as e:
        load_azure(p)
    assert f"{p}:3:" in str(e.value) and words in str(e.value)


def test_azure_bad_header_and_unknown_format(tmp_path):
    p = _write(tmp_path, "a.csv", "time,in,out\n1,2,3\n")
    with pytest.raises(TraceError, match=":1:"):
        load_trace(p)
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(p, fmt="parquet")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.jsonl")


def _req(index, ids, n, out=4, ts=0.0):
    return TraceRequest(index, ts, n, out, tuple(ids), index + 1)


def test_equal_hash_ids_give_equal_prefixes():
    s = Scaling(length_scale=16 / 512)  # a 512-token trace block becomes 16 tokens
    a = prompt_tokens(_req(0, [1, 2, 3], 1500), s, vocab_size=1000)
    b = prompt_tokens(_req(1, [1, 2, 9], 1536), s, vocab_size=1000)
    c = prompt_tokens(_req(2, [7, 2, 3], 1536), s, vocab_size=1000)
    assert len(a) == round(1500 / 32) == 47 and len(b) == 48
    assert a[:32] == b[:32] and a[32:] != b[32:47]
    assert a[:16] != c[:16]  # ids are a chain: another first id, another content
    assert a == prompt_tokens(_req(5, [1, 2, 3], 1500), s, vocab_size=1000)  # deterministic
    assert a != prompt_tokens(_req(0, [1, 2, 3], 1500), s, vocab_size=1000, seed=1)
    assert all(10 <= t < 1000 for t in a + b + c)


def test_short_id_list_is_padded_uniquely_and_capped():
    s = Scaling(length_scale=1 / 32, max_input=40)
    a = prompt_tokens(
        _req(0, [4], 2048), s, vocab_size=500
    )  # 64 tokens wanted, 16 from ids, capped at 40
    b = prompt_tokens(_req(1, [4], 2048), s, vocab_size=500)
    assert len(a) == len(b) == 40 and a[:16] == b[:16] and a[16:] != b[16:]
    with pytest.raises(ValueError, match="vocab_size"):
        prompt_tokens(_req(0, [4], 20), s, vocab_size=5)


def test_make_prompts_scales_time_and_caps_output():
    reqs = [
        _req(0, [1], 512, out=100, ts=1000.0),
        _req(1, [2], 512, out=3, ts=3000.0),
        _req(2, [3], 512, out=0, ts=4000.0),
    ]
    ps = make_prompts(
        reqs, Scaling(length_scale=1 / 32, time_scale=0.5, max_output=8), vocab_size=300
    )
    assert [p.arrival_s for p in ps] == [0.0, 1.0, 1.5]
    assert [p.max_tokens for p in ps] == [8, 3, 1]
    assert [len(p.token_ids) for p in ps] == [16, 16, 16]
