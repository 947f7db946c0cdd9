"""The simulator's parts on hand-built inputs, and whole runs on the shipped trace (no model,
no servers: seconds)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import pytest

from client.cli import main as cli_main
from client.traces import SHIPPED_TRACE, TraceRequest, load_trace
from conductor import POLICIES
from sim import (
    ClusterSpec,
    Profile,
    SweepPoint,
    TraceScaling,
    effective_capacity,
    load_profile,
    make_arrivals,
    simulate,
)
from sim.arrivals import SimRequest
from sim.cache import BlockCache
from sim.index import GlobalIndex

# A small, fast profile: 16-token blocks, 1 ms a prompt token, 10 ms a decode step (+1 ms a
# sequence), a 64-block pool.
TOY = Profile(
    name="toy",
    block_size=16,
    prefill_coef=(0.0, 1.0, 0.0),
    decode_coef=(10.0, 1.0, 0.0),
    block_bytes=1000,
    kv_blocks=64,
    max_batch=8,
    dram_blocks=256,
    ssd_blocks=256,
    network_gbps=1.0,
    dram_gbps=1.0,
    ssd_gbps=1.0,
)


def trace_req(i, t_ms, tokens, out, ids):
    return TraceRequest(i, float(t_ms), tokens, out, tuple(ids), i + 1)


def test_cache_evicts_leaves_first_demotes_and_promotes():
    index = GlobalIndex()
    c = BlockCache("n", index, fast_blocks=3, slow_blocks=2)
    c.insert((1, 2, 3))  # a chain: 3 is the only leaf
    c.insert((4,))  # dram full: the least recent leaf (3) goes to ssd, not its parent 1
    assert c.held((1, 2, 3)).blocks == 3 and c.held((1, 2, 3)).slow == 1
    assert c.demotions == 1
    c.use((1, 2, 3))  # an ssd hit is promoted (and something else demoted to make room)
    assert c.held((1, 2, 3)) == (3, 0) and c.promotions == 1
    assert c.held((4,)).slow == 1
    # every block held is in the index under the node
    assert index.longest_prefix((1, 2, 3)) == {"n": 3}
    c.insert((5, 6, 7))  # more than both tiers hold: some blocks leave the node entirely
    assert len(c) == 5 and c.dropped >= 2
    held = [k for k in (1, 2, 3, 4, 5, 6, 7) if c.held((k,)).blocks]
    for k in (1, 2, 3, 4, 5, 6, 7):
        assert (k in held) == bool(index.longest_prefix((k,)))


def test_index_longest_prefix_per_node():
    ix = GlobalIndex()
    for k in (1, 2, 3):
        ix.add(k, "a")
    for k in (1, 2):
        ix.add(k, "b")
    ix.add(9, "c")
    assert ix.longest_prefix((1, 2, 3, 4)) == {"a": 3, "b": 2}
    ix.remove(2, "a")
    assert ix.longest_prefix((1, 2, 3)) == {"a": 1, "b": 2}


def test_arrivals_share_keys_exactly_where_hash_ids_do():
    reqs = [
        trace_req(0, 0, 1024, 4, [7, 8]),
        trace_req(1, 1000, 1024, 4, [7, 9]),
        trace_req(2, 3000, 300, 4, [5]),
    ]
    arr = make_arrivals(reqs, TraceScaling(rate_scale=2.0), block_size=256)
    a, b, c = arr
    assert len(a.keys) == 4 and a.keys[:2] == b.keys[:2] and a.keys[2:] != b.keys[2:]
    assert len(c.keys) == 1 and c.keys[0] not in a.keys  # same position, other content
    assert [x.arrival_ms for x in arr] == [0.0, 500.0, 1500.0]
    # length-scaled: a hash id covers 8 tokens, a 16-token block spans two ids
    scaled = [trace_req(i, 0, 1536, 4, ids) for i, ids in enumerate(([7, 8, 1], [7, 8, 2], [7, 9]))]
    x, y, z = make_arrivals(scaled, TraceScaling(length_scale=8 / 512), block_size=16)
    assert len(x.keys) == 1 and x.keys == y.keys and z.keys != x.keys


def test_decode_admission_is_bounded_by_the_pool():
    # Four requests at once, each holding 2 blocks of prompt + 32 tokens: a 4-block pool admits
    # one at a time. As on the live cluster, the first token waits for admission: the others'
    # wait is in their TTFT, and every gap of every answer is a decode step.
    profile = TOY.__class__(**{**TOY.__dict__, "kv_blocks": 4})
    reqs = [trace_req(i, 0, 16, 33, [100 + i]) for i in range(4)]
    arr = make_arrivals(reqs, TraceScaling(length_scale=16 / 512), 16)
    r = simulate(arr, profile, ClusterSpec(policy="load_balance", ttft_slo_ms=0, tbt_slo_ms=0))
    done = [x for x in r.records if x.status == "ok"]
    assert len(done) == 4 and all(x.output_tokens == 33 for x in done)
    step = 10.0 + 1.0  # batch of one
    assert all(g == pytest.approx(step) for x in done for g in x.gaps_ms)
    ttfts = sorted(x.ttft_ms for x in done)
    assert ttfts[0] < 4 * 16 + 2 * step  # four 16-token prompts, then it joins at once
    assert ttfts[-1] > 3 * 32 * step  # the last waited for three answers to end
    # the policy saw the ones routed before it (still in prefill) ahead of it in the pool
    last = max(done, key=lambda x: x.ttft_ms)
    assert last.predicted_ttft_ms == pytest.approx(last.ttft_ms, rel=0.1)


def test_every_conductor_policy_runs_in_the_simulator():
    reqs = load_trace(SHIPPED_TRACE, limit=60)
    arr = make_arrivals(reqs, TraceScaling(length_scale=16 / 512, max_output=16), 16)
    for name in POLICIES:
        r = simulate(arr, TOY, ClusterSpec(prefill=2, decode=2, policy=name, ttft_slo_ms=0))
        assert r.report.requests == 60
        assert r.report.done + r.report.rejected == 60
        assert {x.prefill_worker for x in r.records if x.status == "ok"} <= {"p0", "p1"}
    on = simulate(arr, TOY, ClusterSpec(prefill=2, decode=2, policy="load_balance")).report
    off = simulate(arr, TOY, ClusterSpec(prefill=2, decode=2, policy="cache_off")).report
    assert on.prefill_tokens_saved > 0 and off.prefill_tokens_saved == 0
    assert off.prefill_tokens_computed > on.prefill_tokens_computed


def test_mooncake_rejects_early_and_what_it_admits_meets_the_slos():
    reqs = load_trace(SHIPPED_TRACE, limit=200)
    # Squeezed in time: far more work than one prefill instance can do within the SLO.
    scaling = TraceScaling(length_scale=16 / 512, max_output=32, max_input=600, rate_scale=8)
    arr = make_arrivals(reqs, scaling, 16)
    spec = ClusterSpec(prefill=1, decode=1, policy="mooncake", ttft_slo_ms=400, tbt_slo_ms=60)
    r = simulate(arr, TOY, spec)
    rep = r.report
    assert rep.rejected > 0 and rep.done > 0
    # Its predictions are the simulator's own models: what it admits meets both SLOs.
    assert rep.slo_attainment * rep.requests >= 0.95 * rep.done
    lb = simulate(arr, TOY, ClusterSpec(prefill=1, decode=1, policy="load_balance", **{
        "ttft_slo_ms": 400, "tbt_slo_ms": 60})).report  # fmt: skip
    assert lb.rejected == 0 and rep.slo_attainment > lb.slo_attainment
    # best-effort admission runs the conductor's own rule: the refused are served instead, and
    # each one served late makes the queue the next ones are predicted behind longer (so past
    # capacity early refusal is what keeps goodput)
    best = simulate(arr, TOY, dataclasses.replace(spec, admission="best_effort"))
    assert best.report.rejected == 0 and best.report.done == rep.requests
    assert best.best_effort >= rep.rejected
    assert best.report.goodput_rps < rep.goodput_rps
    with pytest.raises(ValueError, match="admission"):
        ClusterSpec(admission="sometimes")


def test_colocated_decode_stalls_behind_prefill():
    reqs = [trace_req(0, 0, 64, 40, [1])] + [trace_req(i, 100 + 20 * i, 512, 2, [10 + i])
                                             for i in range(1, 6)]  # fmt: skip
    arr = make_arrivals(reqs, TraceScaling(length_scale=64 / 512), 16)
    split = simulate(arr, TOY, ClusterSpec(prefill=1, decode=1, policy="load_balance"))
    coloc = simulate(arr, TOY, ClusterSpec(colocated=1, policy="load_balance"))
    worst = lambda r: max(next(x for x in r.records if x.index == 0).gaps_ms)  # noqa: E731
    assert worst(split) < 30  # decode steps only
    assert worst(coloc) > 60  # a 64-token prefill ran between two of its steps


def test_effective_capacity_interpolates_the_crossing():
    pts = [
        SweepPoint("x", s, r, a, 0, 0, 0.0, 0.0, 0.0)
        for s, r, a in ((1, 1.0, 1.0), (2, 2.0, 0.95), (3, 3.0, 0.85), (4, 4.0, 0.99))
    ]
    assert effective_capacity(pts, "x", 0.9) == pytest.approx(2.5)
    assert effective_capacity(pts, "x", 0.5) == 4.0  # never below the target
    assert effective_capacity(pts, "x", 1.01) == 0.0  # never reaches it


def test_shipped_profiles_load_and_bad_ones_are_named():
    p = load_profile("llama2-70b-8xa800")
    assert p.block_size == 512 and p.sources
    with pytest.raises(ValueError, match="no such file"):
        load_profile("no-such-profile")


def test_simulate_cli_writes_the_replay_report(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = cli_main(
        ["simulate", "--profile", "llama2-70b-8xa800", "--limit", "120", "--prefill", "2",
         "--decode", "2", "--ttft-slo-ms", "30000", "--output", str(out)]
    )  # fmt: skip
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())["reports"][0]
    assert rep["requests"] == 120 and rep["done"] > 0
    assert (out / "cdf.png").stat().st_size > 0
    assert "events/s" in capsys.readouterr().out
    rc = cli_main(["simulate", "--limit", "40", "--sweep", "0.5,1", "--output", str(out)])
    assert rc == 0 and (out / "sweep.png").is_file()
    assert cli_main(["simulate", "--rate-scale", "0", "--output", str(out)]) == 2
    assert "rate-scale" in capsys.readouterr().err
    assert cli_main(["simulate", "--profile", "nope", "--output", str(out)]) == 2


def test_records_report_ttft_as_prefill_queue_plus_compute():
    # One prefill instance, two requests at once: the second waits for the first.
    reqs = [trace_req(0, 0, 512, 2, [1]), trace_req(1, 0, 512, 2, [2])]
    arr = make_arrivals(reqs, TraceScaling(length_scale=160 / 512), 16)
    r = simulate(arr, TOY, ClusterSpec(policy="load_balance"))
    a, b = r.records
    assert a.ttft_ms == pytest.approx(160.0) and b.ttft_ms == pytest.approx(320.0)
    # the policy predicted exactly that (its model is the simulator's)
    assert b.predicted_ttft_ms == pytest.approx(320.0)
    assert not math.isnan(a.e2e_ms)


def test_answer_overhead_leaves_out_the_decode_admission_wait():
    from client.report import ReplayRecord
    from sim.fit import answer_cost, decode_join

    def rec(i, prefill_ms, answered_ms, ttft_ms):
        return ReplayRecord(
            index=i, policy="", arrival_s=i, sent_s=i, status="ok", error="", prompt_tokens=64,
            output_tokens=4, ttft_ms=ttft_ms, gaps_ms=[5.0] * 3, e2e_ms=ttft_ms + 15,
            cached_tokens={}, computed_tokens=64, prefill_worker="p", decode_worker="d",
            queue_ms=10.0, prefill_ms=prefill_ms, answered_ms=answered_ms,
        )  # fmt: skip

    # answers 2 ms after each round; the first tokens then waited 200-400 ms for decode room
    held = [rec(i, 50.0 + i, 62.0 + i, 262.0 + 100 * i) for i in range(3)]
    assert answer_cost(held) == pytest.approx((2.0, 0.0))  # one answer a forward: serial
    # records from before Usage carried the answer time: TTFT stands in for it
    old = [r._replace(answered_ms=0.0) for r in held]
    assert answer_cost(old) == pytest.approx((301.0, 0.0))  # the hold taken for overhead
    # the hold itself: 1.5 steps (5 ms each here) are the simulator's, the median rest is the
    # decode side's join time
    assert decode_join(held) == pytest.approx(299.0 - 7.5)  # holds 200, 299, 398 ms
    assert decode_join(old) == 0.0


def test_answers_of_one_forward_split_into_serial_cost_and_latency():
    from client.report import ReplayRecord
    from sim.fit import answer_cost

    def rec(i, sent_s, queue_ms, answered_ms):
        return ReplayRecord(
            index=i, policy="", arrival_s=sent_s, sent_s=sent_s, status="ok", error="",
            prompt_tokens=64, output_tokens=4, ttft_ms=answered_ms + 20, gaps_ms=[5.0] * 3,
            e2e_ms=answered_ms + 35, cached_tokens={}, computed_tokens=64, prefill_worker="p",
            decode_worker="d", queue_ms=queue_ms, prefill_ms=100.0, answered_ms=answered_ms,
        )  # fmt: skip

    # One forward ends 150 ms after the first was sent; its 4 answers reach the conductor 40 ms
    # after it (the reply's way) and 3 ms apart (each built in turn on the worker's thread).
    forward_end = 150.0
    recs = []
    for i in range(4):
        sent = 10.0 * i
        answer_at = forward_end + 3.0 * (i + 1) + 40.0
        recs.append(rec(i, sent / 1000.0, forward_end - 100.0 - sent, answer_at - sent))
    assert answer_cost(recs) == pytest.approx((3.0, 40.0))
    # the simulator charges the serial part on the instance, the latency on the way
    base = Profile(**{**TOY.__dict__, "max_batch_tokens": 1 << 20, "batch_gather_ms": 5.0})
    serial = Profile(**{**base.__dict__, "request_overhead_ms": 43.0})
    split = Profile(**{**base.__dict__, "request_overhead_ms": 3.0, "answer_latency_ms": 40.0})
    reqs = [trace_req(i, 2 * i, 160, 2, [10 + i]) for i in range(4)]  # 2 ms apart: one round
    arr = make_arrivals(reqs, TraceScaling(length_scale=1.0), 16)
    # the four arrive 2 ms apart: the round gathers them all (5 ms after the last), one forward
    # of 640 tokens at 1 ms a token
    forward_end = 3 * 2.0 + 5.0 + 640.0
    got = {}
    for prof in (serial, split):
        r = simulate(arr, prof, ClusterSpec(policy="load_balance"))
        got[prof.request_overhead_ms] = [x.sent_s * 1000.0 + x.ttft_ms for x in r.records]
    # serial: the answers leave 43 ms apart, each joins the decode batch on arrival
    assert got[43.0] == pytest.approx([forward_end + 43.0 * (k + 1) for k in range(4)])
    # split: the first answer as early, the rest 3 ms apart (plus up to two decode steps of 10-14
    # ms to join the batch at a step boundary), none 43 ms behind the one before
    assert got[3.0][0] == pytest.approx(forward_end + 43.0)
    assert max(got[3.0]) <= forward_end + 43.0 + 9.0 + 2 * 14.0


def test_a_simulated_round_gathers_only_while_it_is_small():
    base = Profile(**{**TOY.__dict__, "max_batch_tokens": 1 << 20, "batch_gather_ms": 5.0})
    arr = make_arrivals([trace_req(0, 0, 160, 2, [7])], TraceScaling(length_scale=1.0), 16)
    first = {}
    for small in (0, 100, 200):
        prof = Profile(**{**base.__dict__, "batch_gather_tokens": small})
        first[small] = simulate(arr, prof, ClusterSpec(policy="load_balance")).records[0].ttft_ms
    # 160 prompt tokens at 1 ms each; the lone request waits the 5 ms window only where its
    # round counts as small (no bound, or a bound above 160)
    assert first[100] == pytest.approx(160.0)
    assert first[0] == pytest.approx(165.0) and first[200] == pytest.approx(165.0)


def test_short_prompts_behind_long_ones_prefill_on_the_decode_instance():
    # a long prompt (0.9 s of prefill) every 2 s, and a short one (40 tokens) 100 ms after each:
    # on the prefill instance the short ones wait out the long prefill; on the decode instance
    # (the live policy's conditional disaggregation) they start at once, between its steps
    arr = []
    for i in range(10):
        t = 2000.0 * i
        arr.append(SimRequest(2 * i, t, 900, 4, tuple(range(1000 * i, 1000 * i + 56))))
        arr.append(SimRequest(2 * i + 1, t + 100.0, 40, 16, (10**6 + i, 10**6 + i + 1)))
    base = dict(prefill=1, decode=1, policy="mooncake", ttft_slo_ms=0, tbt_slo_ms=100)
    off = simulate(arr, TOY, ClusterSpec(**base))
    on = simulate(arr, TOY, ClusterSpec(**base, policy_options={"local_prefill_tokens": 64}))
    assert off.local_prefills == 0 and on.local_prefills == 10  # the short ones, each
    assert on.report.done == off.report.done == len(arr)

    def short_ttft(r):
        return statistics.median(x.ttft_ms for x in r.records if x.prompt_tokens == 40)

    assert short_ttft(off) > 700.0 and short_ttft(on) < 200.0
    local = [x for x in on.records if x.prompt_tokens == 40]
    assert all(x.prefill_worker == x.decode_worker == "d0" for x in local)
