"""The live conductor's predictions on a small overloaded slice (tiny-random, 1 prefill + 1
decode, a burst of 60 requests from the shipped trace): what the `mooncake` policy accepts meets
its SLOs, it still accepts some, and the replay report carries the prediction error.

The first pass (load_balance, no rejection) only warms the workers' fitted time models: a cold
worker reports its prior, and the policy would judge the burst by that."""

from __future__ import annotations

import math

import pytest
from serving_cluster import Cluster

from client import SHIPPED_TRACE, Scaling, replay_trace
from client.report import read_records, request_tbt
from model import load_model

TTFT_SLO_MS = 600.0
TBT_SLO_MS = 100.0
# A shared 2-core machine jitters: an accepted request counts as meeting its SLOs within this
# factor of them, and most (not all) of them must.
SLACK = 1.5
MET_SHARE = 0.8


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    out = tmp_path_factory.mktemp("predictions")
    lm = load_model("tiny-random")
    # 4 sequences a step, an 80-block pool: the decode side makes the burst wait as well
    with Cluster(lm, decode={"num_blocks": 80, "max_batch": 4}) as c:
        result = replay_trace(
            c.address,
            SHIPPED_TRACE,
            # 60, not 40: at 40 a fast 2-core machine once served the burst so nearly in time
            # that serving everything met as many SLOs (0.45) as the mooncake policy did; at 60
            # the queue builds past the TTFT SLO and stays there (load_balance 0.10-0.17 against
            # 0.25-0.35 in six runs on that machine)
            limit=60,
            scaling=Scaling(length_scale=128 / 512, time_scale=0.02, max_output=32, max_input=512),
            policies=["load_balance", "mooncake"],
            ttft_slo_ms=TTFT_SLO_MS,
            tbt_slo_ms=TBT_SLO_MS,
            output_dir=out,
            progress=False,
        )
    return result, read_records(out / "records-mooncake.jsonl")


def test_mooncake_accepts_what_it_can_serve_within_the_slos(replayed):
    result, records = replayed
    rep = next(r for r in result.reports if r.policy == "mooncake")
    lb = next(r for r in result.reports if r.policy == "load_balance")
    # overloaded: serving everything misses the TTFT SLO for most of the burst
    assert lb.ttft_ms.p50 > TTFT_SLO_MS
    done = [r for r in records if r.status == "ok"]
    rejected = [r for r in records if r.status == "rejected"]
    assert rejected and all("RESOURCE_EXHAUSTED" in r.error for r in rejected)
    assert len(done) >= 4  # it still serves a share of the burst, not none
    met = [
        r
        for r in done
        if r.ttft_ms <= SLACK * TTFT_SLO_MS and request_tbt(r.gaps_ms) <= SLACK * TBT_SLO_MS
    ]
    assert len(met) >= MET_SHARE * len(done), [(r.ttft_ms, request_tbt(r.gaps_ms)) for r in done]
    # and it meets more SLOs than serving everything does
    assert rep.slo_attainment > lb.slo_attainment


def test_the_report_carries_the_prediction_error(replayed):
    result, records = replayed
    rep = next(r for r in result.reports if r.policy == "mooncake")
    done = [r for r in records if r.status == "ok"]
    assert all(r.predicted_ttft_ms > 0 and r.predicted_tbt_ms > 0 for r in done)
    assert rep.ttft_prediction.requests == len(done)
    assert math.isfinite(rep.ttft_prediction.median_abs)
    assert math.isfinite(rep.tbt_prediction.median_abs)
    assert "TTFT pred. error p50/p90 (bias)" in result.table
