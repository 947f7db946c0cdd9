"""`halfmoon plan --conductor`: the conductor keeps its recent requests as a trace (RecentTrace)
and the planner plans for that load. Requests sharing a prefix share their leading hash ids, a
refused request is kept with the answer it asked for, and the trace written is one `halfmoon
plan --trace` reads again."""

from __future__ import annotations

import json
import random

import grpc
import pytest

from client.api import Client
from client.cli import main as cli_main
from client.traces import load_trace
from conductor import ConductorConfig
from conductor.recent import RecentRequests
from model import load_model
from tests.serving_cluster import Cluster, request

BS = 16


def test_the_ring_keeps_the_newest_in_arrival_order():
    ring = RecentRequests(3)
    a, b = b"\x01" * 32, b"\x02" * 32
    for i, arrived in enumerate([5.0, 1.0, 3.0, 4.0]):  # they end out of arrival order
        ring.add(arrived, 10 + i, i, [a, b][: i % 3], refused=i == 3)
    reply = ring.reply(0, BS)
    # the first to end fell out; the rest in arrival order
    assert [r.input_length for r in reply.requests] == [11, 12, 13]
    assert [r.timestamp_ms for r in reply.requests] == [0.0, 2000.0, 3000.0]
    assert [r.refused for r in reply.requests] == [False, False, True]
    assert list(reply.requests[1].hash_ids) == [0x0101010101010101, 0x0202020202020202]
    assert [r.input_length for r in ring.reply(2, BS).requests] == [12, 13]
    # 0 keeps nothing
    off = RecentRequests(0)
    off.add(1.0, 5, 1, [a])
    assert not off.reply(0, BS).requests
    with pytest.raises(ValueError, match="recent_requests"):
        ConductorConfig(recent_requests=-1)


@pytest.fixture(scope="module")
def served():
    """A cluster of one prefill and one decode worker of a tiny model, offered three prompts that
    share a 3-block prefix, one of their own, and one refused (its TTFT objective cannot be met)."""
    lm = load_model("tiny-random")
    rng = random.Random(9)
    shared = [rng.randrange(3, 259) for _ in range(3 * BS)]
    prompts = [shared + [rng.randrange(3, 259) for _ in range(5 + i)] for i in range(3)]
    prompts.append([rng.randrange(3, 259) for _ in range(2 * BS + 1)])
    with Cluster(lm, conductor={"ttft_slo_ms": 5000.0, "tbt_slo_ms": 0.0}) as c:
        for p in prompts:
            c.generate(token_ids=p, max_tokens=4)
        with pytest.raises(grpc.RpcError) as err:
            list(c.stub.Generate(request(token_ids=prompts[0], max_tokens=7, ttft_slo_ms=0.001)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        yield c, prompts


def test_recent_trace_holds_what_the_cluster_was_offered(served):
    c, prompts = served
    with Client(c.address) as client:
        reply = client.recent_trace()
        newest = client.recent_trace(limit=2)
    recs = reply.requests
    assert [r.input_length for r in recs] == [len(p) for p in prompts] + [len(prompts[0])]
    assert [r.output_length for r in recs] == [4, 4, 4, 4, 7]
    assert [r.refused for r in recs] == [False] * 4 + [True]
    assert [len(r.hash_ids) for r in recs] == [len(p) // BS for p in prompts] + [3]
    # an equal prefix, equal leading ids (the refused request asked for the first prompt again)
    assert len({tuple(r.hash_ids[:3]) for r in recs[:3]} | {tuple(recs[4].hash_ids)}) == 1
    assert not set(recs[3].hash_ids) & set(recs[0].hash_ids)
    times = [r.timestamp_ms for r in recs]
    assert times[0] == 0.0 and times == sorted(times) and reply.window_s * 1000 >= times[-1]
    assert (reply.block_size, reply.ttft_slo_ms, reply.tbt_slo_ms) == (BS, 5000.0, 0.0)
    assert (reply.prefill_workers, reply.decode_workers) == (1, 1)
    assert [r.input_length for r in newest.requests] == [r.input_length for r in recs[-2:]]


def test_plan_for_the_live_load(served, tmp_path, capsys):
    c, prompts = served
    args = ["plan", "--conductor", c.address, "--rates", "1,4", "--baseline", "none",
            "--output", str(tmp_path)]  # fmt: skip
    assert cli_main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["instances"] == 2  # the cluster's workers
    assert result["live"]["requests"] == 5 and result["live"]["refused"] == 1
    assert (result["ttft_slo_ms"], result["tbt_slo_ms"]) == (5000.0, 0.0)  # the cluster's
    assert set(result["capacity_rps"]) == {"1P:1D"}
    # the trace it planned for, as a file the planner reads again at the cluster's block size
    trace = tmp_path / "live_trace.jsonl"
    reqs = load_trace(trace)
    assert [r.input_length for r in reqs] == [len(p) for p in prompts] + [len(prompts[0])]
    again = ["plan", "--trace", str(trace), "--block-tokens", str(BS), "--instances", "2",
             "--rates", "1,4", "--baseline", "none", "--ttft-slo-ms", "5000", "--tbt-slo-ms", "0",
             "--output", str(tmp_path / "again")]  # fmt: skip
    assert cli_main(again) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["capacity_rps"] == (
        result["capacity_rps"]
    )


def test_bad_plan_sources_are_clear_errors(served, tmp_path, capsys):
    c, _ = served
    out = ["--output", str(tmp_path)]
    cases = [
        (["--conductor", c.address, "--trace", "x.jsonl"], "--trace and --conductor"),
        (["--conductor", c.address, "--recent", "-1"], "--recent"),
        (["--recent", "3", "--instances", "2"], "--recent: with --conductor only"),
        ([], "--instances: required"),
        (["--conductor", c.address, "--tbt-slo-ms", "-1"], "--tbt-slo-ms must be >= 0"),
        (["--conductor", c.address, "--block-tokens", "0"], "--block-tokens must be >= 1"),
    ]
    for extra, message in cases:
        assert cli_main(["plan", *extra, *out]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (extra, err)
    assert not (tmp_path / "live_trace.jsonl").exists()  # nothing written for a bad call
