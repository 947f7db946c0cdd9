"""The client library's request building and the CLI's error handling (no cluster needed)."""

import pytest

from client import build_request
from client.cli import main as cli_main


def test_build_request_takes_exactly_one_prompt_kind():
    r = build_request(
        "hello", max_tokens=5, temperature=0.5, stop=["\n"], policy="cache_off", cache_salt="t1"
    )
    assert r.WhichOneof("prompt") == "text" and r.text == "hello"
    assert (r.sampling.max_tokens, r.sampling.temperature, list(r.sampling.stop)) == (
        5,
        0.5,
        ["\n"],
    )
    assert (r.policy, r.cache_salt) == ("cache_off", "t1")
    r = build_request(token_ids=[3, 4, 5], ignore_eos=True, ttft_slo_ms=100, tbt_slo_ms=10)
    assert r.WhichOneof("prompt") == "token_ids" and list(r.token_ids.ids) == [3, 4, 5]
    assert r.sampling.ignore_eos and (r.ttft_slo_ms, r.tbt_slo_ms) == (100, 10)
    r = build_request(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert [(m.role, m.content) for m in r.chat.messages] == [
        ("system", "be brief"),
        ("user", "hi"),
    ]
    for bad in ({}, {"prompt": "a", "token_ids": [1]}, {"token_ids": [1], "messages": []}):
        with pytest.raises(ValueError, match="exactly one"):
            build_request(**bad)


def test_cli_reports_an_unreachable_cluster_in_one_line(free_port, capsys):
    assert cli_main(["status", "--address", f"127.0.0.1:{free_port}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: UNAVAILABLE") and "\n" not in err


def test_cli_replay_names_the_bad_trace_line(tmp_path, free_port, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{oops\n'
    )
    assert (
        cli_main(
            ["replay", str(trace), "--address", f"127.0.0.1:{free_port}", "--vocab-size", "300"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"{trace}:2:" in err and "Traceback" not in err
    assert cli_main(["replay", str(trace), "--time-scale", "0"]) == 2
    assert "--time-scale must be > 0" in capsys.readouterr().err
    assert (
        cli_main(
            ["replay", str(trace), "--compare-policies", "mooncake,mooncake", "--vocab-size", "300"]
        )
        == 2
    )
    assert "twice" in capsys.readouterr().err
