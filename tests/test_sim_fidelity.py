"""halfmoon's simulator against halfmoon: a host whose prefill and decode workers take turns at
its CPUs (Profile.shared_host), and the shipped calibration and validation replays
(sim/data/halfmoon-smollm2, bench/sim_fidelity_runs.py) that bench/sim.py checks it on."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from sim import ClusterSpec, Profile, fit_profile, load_profile, simulate
from sim.arrivals import SimRequest
from sim.validate import compare_run

RUNS = Path(__file__).resolve().parent.parent / "sim" / "data" / "halfmoon-smollm2"

# 0.5 ms a prompt token; a decode step of 20 ms + 2 ms a sequence
HOST = Profile(
    name="host",
    block_size=16,
    prefill_coef=(0.0, 0.5, 0.0),
    decode_coef=(20.0, 2.0, 0.0),
    block_bytes=1000,
    kv_blocks=4096,
    max_batch=16,
    network_gbps=100.0,
)


def _req(i: int, t_ms: float, prompt: int, out: int) -> SimRequest:
    return SimRequest(i, t_ms, prompt, out, tuple(range(10**6 * i, 10**6 * i + prompt // 16)))


def test_a_prefill_on_the_hosts_cpus_paces_its_decode_steps_and_is_slowed_by_them():
    # a stream decoding 200 tokens, then a 4,000-token prompt (2 s of prefill) while it runs
    arr = [_req(0, 0.0, 32, 200), _req(1, 500.0, 4000, 2)]
    spec = ClusterSpec(ttft_slo_ms=60_000.0, tbt_slo_ms=200.0)  # decode keeps 160 ms a gap
    own = simulate(arr, HOST, spec).records
    shared = simulate(arr, dataclasses.replace(HOST, shared_host=True), spec).records
    # alone on its CPUs each gap is a step (22 ms); sharing them, gaps inside the prefill are
    # paced to the objective's slack (the step plus its wait: 160 ms)
    assert max(own[0].gaps_ms) < 30.0
    assert 150.0 <= max(shared[0].gaps_ms) <= 170.0
    # and the prefill, lengthened by the steps it lets run, answers later
    assert shared[1].ttft_ms > own[1].ttft_ms * 1.1


def test_a_step_waits_only_while_the_hosts_prefill_computes():
    # a short prompt (24 ms of prefill) arrives while a stream decodes: the step that finds it
    # computing waits out its rest, no other step waits
    arr = [_req(0, 0.0, 32, 100), _req(1, 30.0, 48, 100)]
    spec = ClusterSpec(ttft_slo_ms=60_000.0, tbt_slo_ms=200.0)
    own = simulate(arr, HOST, spec).records[0].gaps_ms
    shared = simulate(arr, dataclasses.replace(HOST, shared_host=True), spec).records[0].gaps_ms
    longer = [(a, b) for a, b in zip(own, shared) if abs(b - a) > 1e-6]
    assert len(longer) == 1 and 0 < longer[0][1] - longer[0][0] <= 24.0


def test_the_shipped_runs_refit_and_predict_out_of_sample():
    base = load_profile("smollm2-cpu")
    profile, fit = fit_profile(RUNS / "calibration", base, "calibrated")
    assert profile.shared_host  # both workers at one address: a local cluster
    assert fit.decode_rows > 100
    conductor = json.loads((RUNS / "conductor.json").read_text(encoding="utf-8"))
    trace = RUNS / "trace-validation.jsonl"
    alone = dataclasses.replace(profile, shared_host=False)
    for rate in ("rate-2", "rate-4", "rate-8"):
        (row,) = compare_run(RUNS / rate, profile, trace, conductor)
        assert row.real.requests == row.sim.requests == 60
        for err in (row.ttft_p50_error, row.ttft_p90_error, row.tpot_p50_error):
            assert math.isfinite(err)
    # At the highest rate the host's prefill keeps its CPUs for long stretches: the real
    # streams' TPOT is 3x what decoding alone gives; with the turns modelled the simulator is
    # far nearer.
    (shared,) = compare_run(RUNS / "rate-2", profile, trace, conductor)
    (own,) = compare_run(RUNS / "rate-2", alone, trace, conductor)
    assert own.tpot_p50_error < -0.5
    assert abs(shared.tpot_p50_error) < abs(own.tpot_p50_error) / 2
    # and without the conductor's settings (local prefill off) it routes unlike the real one
    (blind,) = compare_run(RUNS / "rate-8", profile, trace)
    (told,) = compare_run(RUNS / "rate-8", profile, trace, conductor)
    assert abs(told.ttft_p50_error) < abs(blind.ttft_p50_error)


def test_the_simulated_conductor_admits_and_judges_by_tpot():
    arr = [_req(i, 1000.0 * i, 32, 50) for i in range(5)]  # alone: 22 ms a gap
    tight = simulate(arr, HOST, ClusterSpec(ttft_slo_ms=60_000.0, tbt_slo_ms=0.0, tpot_slo_ms=10.0))
    assert tight.report.rejected == 5  # predicted 22 ms a token against 10: refused early
    assert all("time per output token" in r.error for r in tight.records)
    loose = simulate(arr, HOST, ClusterSpec(ttft_slo_ms=60_000.0, tbt_slo_ms=0.0, tpot_slo_ms=30.0))
    assert loose.report.slo_attainment == 1.0
    assert loose.report.tpot_ms.p50 == pytest.approx(22.0, rel=0.05)
    with pytest.raises(ValueError, match="tpot_slo_ms"):
        ClusterSpec(tpot_slo_ms=-1.0)


def test_prompts_prefilled_on_the_decode_instance_correct_the_next_ones_predictions():
    # Two streams on the decode instance, then a 6,000-token prompt that holds the host's
    # prefill for 3 s: short prompts prefilled on the decode instance meanwhile get its CPUs only
    # between paced steps and answer 10x later than predicted. As the live conductor does, the
    # simulated one measures them against their predictions (its `local` correction) and, once
    # four agree, predicts the next ones that much slower.
    shared = dataclasses.replace(HOST, shared_host=True)
    arr = [_req(0, 0.0, 32, 400), _req(1, 0.0, 32, 400), _req(2, 100.0, 6000, 2)]
    arr += [_req(3 + i, 200.0 + 150.0 * i, 16, 4) for i in range(14)]
    spec = ClusterSpec(ttft_slo_ms=60_000.0, tbt_slo_ms=200.0,
                       policy_options={"local_prefill_tokens": 64})  # fmt: skip
    local = [r for r in simulate(arr, shared, spec).records[3:] if r.prefill_worker == "d0"]
    assert len(local) == 14
    off = [r.ttft_ms / r.predicted_ttft_ms for r in local]
    assert min(off[:4]) > 5.0  # before the correction holds
    assert max(off[5:]) < 2.5  # after: what the first ones measured is in the prediction
