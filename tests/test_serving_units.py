"""Small pieces of the serving packages without a cluster: incremental text, the device tier,
configs, the conductor's identity and what it logs."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
import pytest

from conductor import Conductor, ConductorConfig, IncrementalText
from conductor.stream import RequestStream
from decode_node import DecodeConfig
from kvstore.client import DeviceTier
from model import load_model
from prefill_node import PrefillConfig
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from servekit import config_from_dict, config_from_yaml


@pytest.fixture(scope="module")
def tok():
    return load_model("tiny-random").tokenizer


def test_incremental_text_matches_whole_decode(tok):
    text = "héllo wörld, ünïcode ✓ and more"
    ids = tok.encode(text)
    inc = IncrementalText(tok.decode)
    parts = [inc.add([t]) for t in ids] + [inc.finish()]
    assert "".join(parts) == tok.decode(ids)
    assert all("\ufffd" not in p for p in parts)  # half a character is never sent


def test_incremental_text_cuts_stop_strings(tok):
    ids = tok.encode("one two STOP three")
    inc = IncrementalText(tok.decode, stop=["STOP"])
    out = ""
    for t in ids:
        out += inc.add([t])
        if inc.stopped:
            break
    out += inc.finish()
    assert inc.stopped and out == "one two "


def test_device_tier_pins_and_evicts_children_first():
    dt = DeviceTier()
    keys = [b"a", b"b", b"c"]
    assert dt.insert(keys, [5, 6, 7]) == []
    assert dt.insert([b"a"], [1]) == [1]  # already held: the caller keeps its block
    assert dt.match([b"a", b"b", b"x"]) == [5, 6]
    assert dt.evict(3) == [7]  # a and b are pinned
    dt.release([b"a", b"b"])
    assert dt.evict(1) == [6]  # the child before its parent
    assert dt.lookup([b"a", b"b"]) == 1


def test_configs_from_dicts_and_yaml(tmp_path):
    cfg = config_from_dict(PrefillConfig, {"worker_id": "p9", "chunk_size": 64})
    assert cfg.worker_id == "p9" and cfg.chunk_size == 64
    with pytest.raises(ValueError, match="unknown key"):
        config_from_dict(DecodeConfig, {"num_blokcs": 4})
    with pytest.raises(ValueError, match="chunk_size"):
        PrefillConfig(chunk_size=20)
    path = tmp_path / "c.yaml"
    path.write_text("conductor:\n  policy: load_balance\n  prefill_workers: [127.0.0.1:1]\n")
    c = config_from_yaml(ConductorConfig, path, "conductor")
    assert c.policy == "load_balance" and c.prefill_workers == ["127.0.0.1:1"]


def test_conductor_loads_no_weights_and_reports_its_identity():
    # Built from config alone: tokenizer and fingerprint, never the weights.
    f32 = Conductor(ConductorConfig(model="tiny-random"))
    bf16 = Conductor(ConductorConfig(model="tiny-random", dtype="bfloat16"))
    st = f32.Status(pb.StatusRequest(), None)
    assert st.model == "tiny-random" and st.kv_dtype == "float32"
    assert st.model_fingerprint == f32.fingerprint and st.conductor_rss_bytes > 0
    assert bf16.Status(pb.StatusRequest(), None).kv_dtype == "bfloat16"
    # The KV dtype is part of the block keys' model part: a bf16 block is not a float32 block.
    assert f32.fingerprint != bf16.fingerprint
    # And it is what a float32 worker of the same model (16-token blocks) reports.
    assert f32.fingerprint == load_model("tiny-random").fingerprint
    with pytest.raises(ValueError, match="dtype"):
        ConductorConfig(dtype="float64")


class _ForeignPrefill(pb_grpc.PrefillWorkerServicer):
    """A prefill worker that answers Load with another model's fingerprint."""

    def Load(self, request, context):
        return pb.WorkerLoad(worker_id="p-foreign", kind="prefill", model_fingerprint="f" * 32)


def test_a_worker_of_another_model_stays_out_of_routing(caplog):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PrefillWorkerServicer_to_server(_ForeignPrefill(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    c = Conductor(ConductorConfig(model="tiny-random", prefill_workers=[f"127.0.0.1:{port}"]))
    try:
        with caplog.at_level(logging.WARNING, logger="conductor"):
            for _ in range(3):
                c.refresh_loads()
        warnings = [r.getMessage() for r in caplog.records if "fingerprint" in r.getMessage()]
        assert len(warnings) == 1  # once per worker, not once per report
        assert "f" * 32 in warnings[0] and c.fingerprint in warnings[0]
        assert (
            c.registry.get_sample_value("halfmoon_worker_mismatch_total", {"worker": "p-foreign"})
            == 3
        )
        ws = c.Status(pb.StatusRequest(), None).workers[0]
        assert not ws.healthy
    finally:
        c._on_stop()
        server.stop(0)


def test_unreachable_store_and_index_are_logged_and_counted(caplog):
    dead = "127.0.0.1:1"  # nothing listens there
    c = Conductor(
        ConductorConfig(
            model="tiny-random",
            store_addresses=[dead],
            load_timeout_s=0.5,
            index_url="redis://127.0.0.1:1/0",
        )
    )
    try:
        with caplog.at_level(logging.WARNING, logger="conductor"):
            st = c.Status(pb.StatusRequest(), None)
            assert st.stores[0].address == dead and not st.stores[0].tiers
            assert c.prefixes.matches([b"k" * 16]) == {} and c.prefixes.matches([b"k" * 16]) == {}
        errors = "halfmoon_conductor_errors_total"
        assert c.registry.get_sample_value(errors, {"what": "store_status"}) == 1
        # The first failure is a lookup error; the second finds the index skipped for
        # index_retry_s (a down index costs one timeout per retry period, not one per request).
        assert c.registry.get_sample_value(errors, {"what": "index_lookup"}) == 1
        assert c.registry.get_sample_value(errors, {"what": "index_skipped"}) == 1
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert dead in logged and logged.count("index lookup failed") == 1  # once an outage
    finally:
        c._on_stop()


def test_a_request_meets_its_objectives_only_within_both(tok):
    def stream(ttft_ms, times, ttft_slo_ms=500.0, tbt_slo_ms=50.0):
        text = IncrementalText(tok.decode)
        s = RequestStream("r", [1], "mooncake", pb.SamplingParams(), "", text)
        s.ttft_ms, s.times = ttft_ms, times
        s.ttft_slo_ms, s.tbt_slo_ms = ttft_slo_ms, tbt_slo_ms
        return s

    assert stream(100.0, [100.0, 120.0, 140.0]).met_slos()
    assert not stream(600.0, [600.0, 610.0]).met_slos()  # TTFT late
    # TBT is the mean of the slowest 10% of gaps: one 80 ms gap among ten misses 50 ms
    assert not stream(100.0, [100.0 + 10 * i for i in range(10)] + [270.0]).met_slos()
    assert stream(600.0, [600.0, 700.0], ttft_slo_ms=0.0, tbt_slo_ms=0.0).met_slos()  # none set
    assert stream(100.0, [100.0]).met_slos()  # one token: no gap to miss


def test_a_request_judged_by_tpot_meets_it_on_its_mean_gap(tok):
    def stream(times, tbt_slo_ms=0.0, tpot_slo_ms=30.0):
        text = IncrementalText(tok.decode)
        s = RequestStream("r", [1], "mooncake", pb.SamplingParams(), "", text)
        s.ttft_ms, s.times = times[0], times
        s.ttft_slo_ms, s.tbt_slo_ms, s.tpot_slo_ms = 500.0, tbt_slo_ms, tpot_slo_ms
        return s

    # nine 10 ms gaps and one of 200: TPOT (mean gap) 29 ms, TBT (slowest 10%) 200 ms
    bursty = [100.0 + 10 * i for i in range(10)] + [390.0]
    assert stream(bursty).met_slos()  # TPOT alone: met
    assert not stream(bursty, tbt_slo_ms=50.0).met_slos()  # TBT judged too: missed
    assert not stream(bursty, tpot_slo_ms=25.0).met_slos()  # a stricter TPOT: missed
    assert stream([100.0]).met_slos()  # one token: no gap to miss


def test_the_decode_worker_is_paced_by_the_objective_that_applies(tok):
    from conductor.fleet import DecodeWorker
    from conductor.relay import decode_request
    from conductor.routing import Routed

    worker = DecodeWorker("127.0.0.1:1")  # its channel connects lazily: never here
    try:
        routed = Routed("mooncake", None, worker, "", 0, True, 0.0, 0.0)
        s = RequestStream("r", [1, 2], "mooncake", pb.SamplingParams(max_tokens=4), "",
                          IncrementalText(tok.decode))  # fmt: skip
        reply = pb.PrefillReply(first_token=5)
        for tbt, tpot, paced in ((100.0, 0.0, 100.0), (0.0, 80.0, 80.0), (100.0, 80.0, 80.0),
                                 (50.0, 80.0, 50.0), (0.0, 0.0, 0.0)):  # fmt: skip
            s.tbt_slo_ms, s.tpot_slo_ms = tbt, tpot
            assert decode_request(s, routed, [1, 2], reply).tbt_slo_ms == paced
    finally:
        worker.channel.close()


def test_request_stream_resumes_without_repeating_a_token(tok):
    sp = pb.SamplingParams(max_tokens=5)
    s = RequestStream("r", [10, 11, 12], "mooncake", sp, "", IncrementalText(tok.decode))
    assert s.prompt() == [10, 11, 12] and s.tokens_left() == 5
    first = s.start(pb.PrefillReply(first_token=40))
    assert list(first.token_ids) == [40] and s.times == [s.ttft_ms]
    # Worker times are rebased to end now and never run before the previous token.
    s.arrived -= 1.0  # a second later
    msg, gaps = s.add(pb.DecodeResponse(token_ids=[41, 42], token_times_ms=[5.0, 9.0]))
    assert list(msg.token_ids) == [41, 42] and len(gaps) == 2 and min(gaps) >= 0.0
    assert msg.token_times_ms[1] - msg.token_times_ms[0] == pytest.approx(4.0)
    s.add(
        pb.DecodeResponse(token_ids=[43], token_times_ms=[-1e9])
    )  # its clock's origin is not ours
    assert s.times == sorted(s.times) and s.out == [40, 41, 42, 43]
    # The decode worker is lost: prefill all but the last token sent, decode on from it.
    assert s.prompt() == [10, 11, 12, 40, 41, 42]
    assert s.tokens_left() == 2 and s.decode_sampling().max_tokens == 2
    assert sp.max_tokens == 5  # the client's parameters stay as sent


def test_a_refit_worker_model_carries_what_was_learned_over_in_the_new_models_terms():
    from conductor.corrections import Correction as _Correction

    c = _Correction()
    c.follow_model(10.0)
    for _ in range(_Correction.MIN_SAMPLES):
        c.observe(measured_ms=2.0, predicted_ms=10.0, applied=1.0, epoch=c.epoch)  # 5x high
    assert c.ratio == pytest.approx(0.2)
    c.follow_model(10.05)  # no refit: within MODEL_DRIFT
    assert c.ratio == pytest.approx(0.2)
    old = c.epoch
    c.follow_model(2.5)  # refit: the model now says about what was measured
    assert c.epoch == old + 1
    # what was learned is kept, as the new model would have predicted it: 2.0 over 2.5
    assert c.ratio == pytest.approx(0.8)
    # Requests routed by the old model finish after the refit: their estimates (10 ms) are
    # re-expressed in the new model's terms (2.5), so they confirm the ratio, not undo it.
    for _ in range(2 * _Correction.MIN_SAMPLES):
        c.observe(measured_ms=2.0, predicted_ms=10.0, applied=1.0, epoch=old)
    assert c.ratio == pytest.approx(0.8) and c.stale == 0
    for _ in range(4 * _Correction.MIN_SAMPLES):
        c.observe(measured_ms=3.0, predicted_ms=2.5, applied=1.0, epoch=c.epoch)
    assert c.ratio == pytest.approx(1.2, rel=0.01)
    # an estimate made against a model too many refits ago is dropped, not guessed at
    for i in range(_Correction.EPOCHS_KEPT + 2):  # ending on the 2.5 ms model
        c.follow_model(2.5 * (1.1 if i % 2 == 0 else 1.0))
    c.observe(measured_ms=100.0, predicted_ms=1.0, applied=1.0, epoch=old)
    assert c.stale == 1 and c.ratio == pytest.approx(1.2, rel=0.05)


def test_a_decode_model_is_compared_where_the_worker_serves():
    from conductor.corrections import model_reference_ms

    load = pb.WorkerLoad(decode_coef=[1.0, 0.5, 0.001], max_batch=4)
    # a step of 4 sequences of 512 tokens: 1 + 4 * 0.5 + 2048 * 0.001
    assert model_reference_ms("decode", load) == pytest.approx(5.048)
    load = pb.WorkerLoad(decode_coef=[1.0, 0.5, 0.001])  # no batch bound: 8 sequences
    assert model_reference_ms("decode", load) == pytest.approx(9.096)
    assert model_reference_ms("prefill", pb.WorkerLoad(prefill_coef=[2.0, 0.1, 0.0])) == 53.2


def test_a_correction_is_a_ratio_of_sums_so_short_requests_overheads_do_not_scale_long_ones():
    from conductor.corrections import Correction as _Correction

    c = _Correction()
    # short prompts: 10 ms predicted, 30 measured (a fixed 20 ms of RPCs and hand-offs); one
    # long one, 1,000 predicted and 1,050 measured
    for _ in range(3):
        c.observe(measured_ms=30.0, predicted_ms=10.0, applied=1.0, epoch=c.epoch)
    c.observe(measured_ms=1050.0, predicted_ms=1000.0, applied=1.0, epoch=c.epoch)
    # a mean of ratios would say ~2.5 and scale the next long prompt's 1,000 ms to 2,500
    assert 1.0 < c.ratio < 1.2
    # one request far off counts at most 5x its prediction
    c.observe(measured_ms=1e6, predicted_ms=1000.0, applied=1.0, epoch=c.epoch)
    assert c.ratio <= _Correction.BOUNDS[1]


def test_a_correction_learned_long_ago_is_not_applied_and_its_next_measure_starts_afresh():
    from conductor.corrections import Correction as _Correction

    c = _Correction()
    t = 1000.0
    assert not c.checked()  # no served request has checked the model: a predicted miss probes
    for i in range(_Correction.MIN_SAMPLES):  # a neighbour's burst: everything 4x slow
        c.observe(measured_ms=40.0, predicted_ms=10.0, applied=1.0, epoch=c.epoch, now=t + i)
    assert c.ratio_at(t + 5) == pytest.approx(4.0) and c.checked()
    # nothing measured since (every request refused on it): no longer applied, the model alone
    # judges; the model stays checked, so a miss it predicts is a refusal, not a probe
    later = t + _Correction.STALE_S + 10
    assert c.ratio_at(later) == 1.0 and not c.current(later) and c.checked()
    # the next measurement is the first of a fresh start, not 1 of 5 against the old 4x
    c.observe(measured_ms=11.0, predicted_ms=10.0, applied=1.0, epoch=c.epoch, now=later)
    assert c.restarts == 1 and c.samples == 1 and c.ratio_at(later) == 1.0
    for i in range(1, _Correction.MIN_SAMPLES):
        c.observe(measured_ms=11.0, predicted_ms=10.0, applied=1.0, epoch=c.epoch, now=later + i)
    assert c.ratio_at(later + 5) == pytest.approx(1.1) and c.current(later + 5)


def test_a_decode_model_is_corrected_by_its_mean_step_and_its_tbt_tail_apart():
    from conductor import DecodeCandidate, RequestInfo
    from conductor.estimates import decode_estimate
    from conductor.fleet import DecodeWorker

    w = DecodeWorker("127.0.0.1:1")  # nothing is called: its channel connects lazily
    try:
        for _ in range(4):  # streams: mean step 20 ms as predicted, slowest 10% at 40 against 20
            w.correction.observe(20.0, 20.0, 1.0, w.correction.epoch)
            w.tail.observe(40.0, 20.0, 1.0, w.tail.epoch)
            w.pace.observe(30.0, 20.0, 1.0, w.pace.epoch)  # wall-clock gaps of 30
        assert w.correction.ratio == pytest.approx(1.0)  # every step is not taken as 2x
        assert (w.tbt_scale, w.wait_scale) == pytest.approx((2.0, 1.5))
        d = DecodeCandidate("d", 0, 100, 100, 0, (20.0, 0.0, 0.0), tbt_scale=w.tbt_scale)
        est = decode_estimate(d, RequestInfo(16, 8, 0.0, 0.0), 16)
        assert (est.tpot_ms, est.tbt_ms) == pytest.approx((20.0, 40.0))
    finally:
        w.channel.close()


def test_a_prompt_the_decode_worker_prefills_is_estimated_as_its_own_measured():
    from conductor import ClusterState, DecodeCandidate, PrefillCandidate, RequestInfo, make_policy
    from conductor.fleet import DecodeWorker

    w = DecodeWorker("127.0.0.1:1")  # nothing is called: its channel connects lazily
    try:
        for _ in range(4):  # its own prefills took twice what they were routed by
            w.local.observe(100.0, 50.0, 1.0, w.local.epoch)
        assert w.local.ratio == pytest.approx(2.0)
    finally:
        w.channel.close()
    pol = make_policy("mooncake", local_prefill_tokens=64)

    def choose(local_scale: float):
        d = DecodeCandidate("d", 0, 100, 100, 0, (10.0, 1.0, 0.0), nodes=("d-node",),
                            local_scale=local_scale)  # fmt: skip
        p = PrefillCandidate("a", ("a-node",), 30.0, (0.0, 1.0, 0.0))  # 30 ms of queue there
        return pol.choose(RequestInfo(48, 8, 0.0, 0.0), ClusterState([p], [d], {}, 16, 1000))

    # 48 ms there against 78 on the prefill worker: the decode worker takes it ...
    assert choose(1.0).prefill_on_decode and choose(1.0).predicted_ttft_ms == pytest.approx(48.0)
    # ... until its own prefills are measured at twice that: 96 ms, the prefill worker's 78 win
    assert not choose(w.local.ratio).prefill_on_decode
