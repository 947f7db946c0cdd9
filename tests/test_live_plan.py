"""`halfmoon plan --conductor`: the conductor keeps its recent requests as a trace (RecentTrace)
and the planner plans for that load. Requests sharing a prefix share their leading hash ids, a
refused request is kept with the answer it asked for, and the trace written is one `halfmoon
plan --trace` reads again. The plan simulates the cluster's own time models (each worker's
fitted model times the conductor's correction), written as a profile `--profile` reads again."""

from __future__ import annotations

import json
import random

import grpc
import pytest
from prometheus_client import CollectorRegistry

from client.api import Client
from client.cli import main as cli_main
from client.traces import load_trace
from conductor import ConductorConfig
from conductor.corrections import Correction
from conductor.fleet import Fleet
from conductor.metrics import ConductorMetrics
from conductor.recent import RecentRequests
from model import load_model
from protos import halfmoon_pb2 as pb
from sim import load_profile
from sim.live_trace import live_profile
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


def test_the_fleets_models_are_each_fitted_model_times_its_correction():
    config = ConductorConfig(prefill_workers=["127.0.0.1:1", "127.0.0.1:2"],
                             decode_workers=["127.0.0.1:3"])  # fmt: skip
    fleet = Fleet(config, "", ConductorMetrics(CollectorRegistry()))
    try:
        p0, p1, d = fleet.workers
        p0.load = pb.WorkerLoad(worker_id="p0", kind="prefill", prefill_coef=[10.0, 2.0, 0.0],
                                block_bytes=4096, total_blocks=64)  # fmt: skip
        p1.load = pb.WorkerLoad(worker_id="p1", kind="prefill")  # no model fitted yet
        d.load = pb.WorkerLoad(worker_id="d0", kind="decode", decode_coef=[20.0, 1.0, 0.001],
                               block_bytes=4096, total_blocks=900, max_batch=24)  # fmt: skip
        p0.healthy = p1.healthy = d.healthy = True
        for _ in range(Correction.MIN_SAMPLES):  # it measured 3x its model
            p0.correction.observe(300.0, 100.0, 1.0, p0.correction.epoch)
        models = {m.worker_id: m for m in fleet.models()}
        assert set(models) == {"p0", "d0"}
        assert models["p0"].correction == pytest.approx(3.0)
        assert list(models["p0"].coef) == pytest.approx([30.0, 6.0, 0.0])
        assert (models["d0"].correction, list(models["d0"].coef)) == (1.0, [20.0, 1.0, 0.001])
        assert (models["d0"].total_blocks, models["d0"].max_batch) == (900, 24)
        d.healthy = False  # one that stopped answering is left out
        assert [m.worker_id for m in fleet.models()] == ["p0"]
    finally:
        fleet.close()


def test_the_live_profile_is_the_workers_mean_model_over_the_named_profile():
    base = load_profile("smollm2-cpu")
    reply = pb.RecentTraceReply(block_size=base.block_size * 2, models=[
        pb.WorkerModel(worker_id="p0", kind="prefill", coef=[10.0, 1.0, 0.0], block_bytes=4096),
        pb.WorkerModel(worker_id="p1", kind="prefill", coef=[30.0, 3.0, 2e-6], block_bytes=4096),
        pb.WorkerModel(worker_id="d0", kind="decode", coef=[20.0, 0.5, 1e-4], block_bytes=4096,
                       total_blocks=900, max_batch=24),
        pb.WorkerModel(worker_id="d1", kind="decode", coef=[20.0, 0.5, 1e-4], block_bytes=4096,
                       total_blocks=700, max_batch=32),
    ])  # fmt: skip
    p = live_profile(reply, base, "host:1")
    assert p.name == "smollm2-cpu+live"
    assert p.prefill_coef == pytest.approx((20.0, 2.0, 1e-6))  # the mean prediction's model
    assert p.decode_coef == pytest.approx((20.0, 0.5, 1e-4))
    assert (p.kv_blocks, p.max_batch) == (700, 24)  # the smallest worker's
    assert (p.block_size, p.block_bytes) == (base.block_size * 2, 4096)
    # what the workers do not report stays the profile's; the sources say which is which
    assert (p.shared_host, p.dram_blocks, p.network_gbps) == (
        base.shared_host, base.dram_blocks, base.network_gbps
    )
    assert "host:1" in p.sources[-1] and p.sources[:-1] == base.sources
    # no fitted model of a role: the profile's coefficients for it
    bare = live_profile(pb.RecentTraceReply(block_size=base.block_size), base, "host:1")
    assert (bare.prefill_coef, bare.decode_coef) == (base.prefill_coef, base.decode_coef)


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
    # the answered ones with their TTFT as measured and as predicted when routed; none for the
    # refused one
    assert all(r.ttft_ms > 0 and r.predicted_ttft_ms > 0 for r in recs[:4])
    assert (recs[4].ttft_ms, recs[4].predicted_ttft_ms) == (0.0, 0.0)
    assert [len(r.hash_ids) for r in recs] == [len(p) // BS for p in prompts] + [3]
    # an equal prefix, equal leading ids (the refused request asked for the first prompt again)
    assert len({tuple(r.hash_ids[:3]) for r in recs[:3]} | {tuple(recs[4].hash_ids)}) == 1
    assert not set(recs[3].hash_ids) & set(recs[0].hash_ids)
    times = [r.timestamp_ms for r in recs]
    assert times[0] == 0.0 and times == sorted(times) and reply.window_s * 1000 >= times[-1]
    assert (reply.block_size, reply.ttft_slo_ms, reply.tbt_slo_ms) == (BS, 5000.0, 0.0)
    assert (reply.prefill_workers, reply.decode_workers) == (1, 1)
    assert [r.input_length for r in newest.requests] == [r.input_length for r in recs[-2:]]
    # each worker's time model as routing judges by it (fitted model times correction: both
    # move as the workers refit, see the Fleet test below)
    assert sorted(m.kind for m in reply.models) == ["decode", "prefill"]
    for m in reply.models:
        w = c.conductor.fleet.find(m.worker_id)
        assert len(m.coef) == 3 and min(m.coef) >= 0 < sum(m.coef) and m.correction > 0
        assert m.block_bytes == w.load.block_bytes > 0 and m.total_blocks == w.load.total_blocks
    decode = next(m for m in reply.models if m.kind == "decode")
    assert decode.max_batch == c.conductor.fleet.decode[0].load.max_batch > 0
    assert reply.refused_at_door == c.conductor.call_limit.refused == 0


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
    # simulated with the cluster's own models (its workers keep refitting: not compared with a
    # later RecentTrace), not the profile's
    simulated = result["live"]["models"]
    assert simulated["kv_blocks"] == c.conductor.fleet.decode[0].load.total_blocks
    assert result["profile"].endswith("+live")
    named = load_profile(result["profile"].removesuffix("+live"))
    assert simulated["prefill_coef"] != pytest.approx(list(named.prefill_coef))
    assert simulated["decode_coef"] != pytest.approx(list(named.decode_coef))
    # the trace and the models it planned with, as files the planner reads again
    trace, profile = tmp_path / "live_trace.jsonl", tmp_path / "live_profile.yaml"
    reqs = load_trace(trace)
    assert [r.input_length for r in reqs] == [len(p) for p in prompts] + [len(prompts[0])]
    assert load_profile(profile).prefill_coef == pytest.approx(simulated["prefill_coef"])
    again = ["plan", "--trace", str(trace), "--block-tokens", str(BS), "--instances", "2",
             "--rates", "1,4", "--baseline", "none", "--ttft-slo-ms", "5000", "--tbt-slo-ms", "0",
             "--profile", str(profile), "--output", str(tmp_path / "again")]  # fmt: skip
    assert cli_main(again) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["capacity_rps"] == (
        result["capacity_rps"]
    )
    # --models profile: the named profile's figures, as they are
    named_run = ["plan", "--conductor", c.address, "--models", "profile", "--rates", "1,4",
                 "--baseline", "none", "--output", str(tmp_path / "named")]  # fmt: skip
    assert cli_main(named_run) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["live"]["models"] is None and result["profile"] == named.name
    assert not (tmp_path / "named" / "live_profile.yaml").exists()


def test_bad_plan_sources_are_clear_errors(served, tmp_path, capsys):
    c, _ = served
    out = ["--output", str(tmp_path)]
    cases = [
        (["--conductor", c.address, "--trace", "x.jsonl"], "--trace and --conductor"),
        (["--conductor", c.address, "--recent", "-1"], "--recent"),
        (["--recent", "3", "--instances", "2"], "--recent: with --conductor only"),
        (["--models", "live", "--instances", "2"], "--models: with --conductor only"),
        ([], "--instances: required"),
        (["--conductor", c.address, "--tbt-slo-ms", "-1"], "--tbt-slo-ms must be >= 0"),
        (["--conductor", c.address, "--block-tokens", "0"], "--block-tokens must be >= 1"),
    ]
    for extra, message in cases:
        assert cli_main(["plan", *extra, *out]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (extra, err)
    assert not (tmp_path / "live_trace.jsonl").exists()  # nothing written for a bad call
