"""A prefill worker that takes turns at its host's CPUs with a decode worker (PrefillCandidate's
cpu_peers) computes at the share the decode's paced steps leave it: the policy's TTFT estimate,
and so admission, holds that share while the decode runs a batch (pure policy, scripted states;
the conductor's discovery of peers from the workers' turn locks on hand-built load reports)."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from conductor import (
    ClusterState,
    ConductorConfig,
    DecodeCandidate,
    MissesObjectives,
    PrefillCandidate,
    RequestInfo,
    make_policy,
)
from conductor.corrections import Correction
from conductor.fleet import Fleet, PrefillBooking
from conductor.metrics import ConductorMetrics
from conductor.state import cluster_state
from protos import halfmoon_pb2 as pb

BS = 16
QUEUE_MS = 100.0
PREFILL_COEF = (5.0, 1.0, 0.0)  # 5 ms a forward + 1 ms a token
DECODE_COEF = (10.0, 2.0, 0.0)  # a step: 10 ms + 2 ms a sequence
TBT_MS = 100.0  # paced at 0.8 of it: 80 ms a period


def prefill(peers=()):
    return PrefillCandidate("p", ("node",), QUEUE_MS, PREFILL_COEF, cpu_peers=peers)


def decode(wid, running, offered=-1.0):
    return DecodeCandidate(wid, running, 1000, 1000, 0, DECODE_COEF, offered_slack_ms=offered)


def prefill_part(decision):
    """The prefill's own share of the TTFT estimate (the decode admission after it left out)."""
    return decision.predicted_ttft_ms - decision.predicted_admission_ms


def choose(peers, running, ttft=0.0, tbt=TBT_MS, tpot=0.0, tokens=500, offered=-1.0):
    # "d" shares the prefill's CPUs; the request decodes on idle "e" (within its objectives
    # however long d's batch is)
    decodes = [decode("d", running, offered), decode("e", 0)]
    s = ClusterState([prefill(peers)], decodes, {}, BS, 1000)
    return make_policy("mooncake").choose(RequestInfo(tokens, 8, ttft, tbt, tpot_slo_ms=tpot), s)


def test_a_peers_running_batch_slows_the_prefill_to_the_share_its_pacing_leaves():
    alone = prefill_part(choose((), 4))
    assert alone == pytest.approx(QUEUE_MS + 5 + 500)
    # 4 sequences: steps of 18 ms in each 80 ms period, the prefill the other 62
    shared = prefill_part(choose(("d",), 4))
    assert shared == pytest.approx((QUEUE_MS + 5 + 500) * 80 / 62)
    # a longer batch leaves less: 30 sequences step 70 ms of the 80
    assert prefill_part(choose(("d",), 30)) == pytest.approx((QUEUE_MS + 505) * 80 / 10)
    # and never less than a tenth of the CPUs
    assert prefill_part(choose(("d",), 60)) == pytest.approx((QUEUE_MS + 505) * 10)


def test_slack_the_streams_banked_runs_at_full_speed_first():
    # streams ahead of their objective (mean pacing) offer 300 ms before their next step
    assert prefill_part(choose(("d",), 4, offered=300.0)) == pytest.approx(
        300 + (QUEUE_MS + 505 - 300) * 80 / 62
    )
    # more banked than the work: none of it waits for a step
    assert prefill_part(choose(("d",), 4, offered=5000.0)) == pytest.approx(QUEUE_MS + 505)


def test_no_batch_or_no_objective_to_pace_by_leaves_the_prefill_every_cpu():
    assert prefill_part(choose(("d",), 0)) == pytest.approx(QUEUE_MS + 505)
    assert prefill_part(choose(("d",), 4, tbt=0.0)) == pytest.approx(QUEUE_MS + 505)
    # paced by the stricter objective set: TPOT 50 ms -> 40 ms periods, 22 of them the prefill's
    assert prefill_part(choose(("d",), 4, tpot=50.0)) == pytest.approx((QUEUE_MS + 505) * 40 / 22)


def test_admission_refuses_what_the_shared_cpus_cannot_prefill_in_time():
    # 605 ms at full speed, 781 ms beside a batch of 4: a 700 ms objective
    assert choose((), 4, ttft=700.0).prefill == "p"
    with pytest.raises(MissesObjectives, match="predicted TTFT 781 ms"):
        choose(("d",), 4, ttft=700.0)


def _load(kind, wid, nodes, turns):
    coef = {"prefill_coef": PREFILL_COEF} if kind == "prefill" else {"decode_coef": DECODE_COEF}
    return pb.WorkerLoad(worker_id=wid, kind=kind, nodes=nodes, cpu_turns=turns, block_bytes=1000,
                         block_size=BS, total_blocks=100, free_blocks=100, **coef)  # fmt: skip


@pytest.mark.parametrize(
    "decode_nodes, decode_turns, peers",
    [
        (["host-a"], "/dev/shm/halfmoon-cpus-0-1.lock", ("d",)),  # same host, same CPUs
        (["host-b"], "/dev/shm/halfmoon-cpus-0-1.lock", ()),  # same CPU ids, another host
        (["host-a"], "/dev/shm/halfmoon-cpus-2-3.lock", ()),  # one host, CPUs of its own
        (["host-a"], "", ()),  # no turns taken
    ],
)
def test_the_conductor_finds_peers_by_turn_lock_and_host(decode_nodes, decode_turns, peers):
    config = ConductorConfig(prefill_workers=["127.0.0.1:1"], decode_workers=["127.0.0.1:2"])
    fleet = Fleet(config, "", ConductorMetrics(CollectorRegistry()))
    try:
        p, d = fleet.prefill[0], fleet.decode[0]
        p.load = _load("prefill", "p", ["host-a", "p-dev"], "/dev/shm/halfmoon-cpus-0-1.lock")
        d.load = _load("decode", "d", decode_nodes, decode_turns)
        p.healthy = d.healthy = True
        s = cluster_state(fleet, {}, config)
        assert s.prefill[0].cpu_peers == peers
    finally:
        fleet.close()


def test_a_prefill_queue_is_scaled_by_its_correction_once():
    # The worker's report (its own model) is scaled by its correction; a request routed after
    # the report was booked as the corrected model predicted it, and counts as booked.
    config = ConductorConfig(prefill_workers=["127.0.0.1:1"], decode_workers=[])
    fleet = Fleet(config, "", ConductorMetrics(CollectorRegistry()))
    try:
        p = fleet.prefill[0]
        for _ in range(Correction.MIN_SAMPLES):  # measured twice what the model said
            p.correction.observe(200.0, 100.0, 1.0, p.correction.epoch)
        assert p.correction.ratio == pytest.approx(2.0)
        p.load = _load("prefill", "p", ["host-a"], "")
        p.load.predicted_queue_ms = 400.0
        p.healthy = True
        p.report_at = time.perf_counter()
        p.inflight["later"] = PrefillBooking(sent_at=p.report_at, compute_ms=300.0, tokens=64)
        queue_ms = cluster_state(fleet, {}, config).prefill[0].queue_ms
        assert queue_ms == pytest.approx(2.0 * 400.0 + 300.0, abs=5.0)
    finally:
        fleet.close()
