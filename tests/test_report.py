"""The replay report on hand-made records whose answers are worked out by hand."""

import math

import pytest

from client import (
    ReplayRecord,
    compute_report,
    format_reports,
    plot_cdfs,
    read_records,
    request_tbt,
    write_records,
)


def rec(
    index,
    status="ok",
    ttft=100.0,
    gaps=(),
    prompt=64,
    out=None,
    cached=None,
    computed=None,
    sent=0.0,
    e2e=1000.0,
    policy="p",
):
    cached = cached or {}
    return ReplayRecord(
        index=index,
        policy=policy,
        arrival_s=sent,
        sent_s=sent,
        status=status,
        error="" if status == "ok" else "RESOURCE_EXHAUSTED: busy",
        prompt_tokens=prompt,
        output_tokens=(len(gaps) + 1 if status == "ok" else 0) if out is None else out,
        ttft_ms=ttft if status == "ok" else math.nan,
        gaps_ms=list(gaps),
        e2e_ms=e2e,
        cached_tokens={t: cached.get(t, 0) for t in ("device", "dram", "ssd", "remote")},
        computed_tokens=prompt - sum(cached.values()) if computed is None else computed,
        prefill_worker="prefill-0",
        decode_worker="decode-0",
    )


def test_request_tbt_is_mean_of_slowest_tenth():
    assert request_tbt([]) == 0.0
    assert request_tbt([7.0]) == 7.0
    assert request_tbt([10.0] * 9 + [100.0]) == 100.0  # 10 gaps: the slowest 1
    assert request_tbt([10.0] * 9 + [100.0, 50.0]) == 75.0  # 11 gaps: ceil(1.1) = the slowest 2
    assert request_tbt(list(range(1, 21))) == 19.5  # 20 gaps: mean of 20 and 19


def test_report_on_known_records():
    records = [
        # meets both SLOs (TTFT 100 <= 500; TBT = mean(slowest 1 of 9 gaps) = 40 <= 50)
        rec(0, ttft=100.0, gaps=[10.0] * 8 + [40.0], prompt=100, cached={"device": 32, "dram": 16}),
        # TTFT too slow
        rec(1, ttft=3000.0, gaps=[5.0, 5.0], prompt=50, cached={"ssd": 16}, sent=1.0, e2e=2500.0),
        # TBT too slow on its worst gap (mean gap 14.5 would pass, the slowest 10% does not)
        rec(2, ttft=500.0, gaps=[5.0] * 9 + [100.0], prompt=50, cached={"remote": 16}),
        # rejected early: counts against attainment, not in latencies or hit rate
        rec(3, status="rejected", prompt=80, sent=0.5),
    ]
    r = compute_report(records, ttft_slo_ms=500.0, tbt_slo_ms=50.0)
    assert (r.policy, r.requests, r.done, r.rejected, r.errors) == ("p", 4, 3, 1, 0)
    assert r.slo_attainment == 0.25
    # TTFTs 100, 500, 3000 -> p50 500, p90 500 + 0.8 * 2500, p99 500 + 0.98 * 2500
    assert r.ttft_ms.p50 == pytest.approx(500.0)
    assert r.ttft_ms.p90 == pytest.approx(2500.0)
    assert r.ttft_ms.p99 == pytest.approx(2950.0)
    # per-request TBT 40, 5, 100
    assert r.tbt_ms.p50 == pytest.approx(40.0)
    assert r.tbt_ms.p90 == pytest.approx(40.0 + 0.8 * 60.0)
    assert r.prompt_tokens == 200
    assert r.hit_rate == pytest.approx(80 / 200)
    assert r.hit_rate_by_tier == pytest.approx(
        {"device": 0.16, "dram": 0.08, "ssd": 0.08, "remote": 0.08}
    )
    assert (r.prefill_tokens_saved, r.prefill_tokens_computed) == (80, 120)
    assert r.output_tokens == 10 + 3 + 11
    assert r.duration_s == pytest.approx(3.5)  # first send at 0, last end at 1.0 + 2.5
    assert r.output_tokens_per_s == pytest.approx(24 / 3.5)
    assert r.goodput_rps == pytest.approx(1 / 3.5)  # one request met both, over 3.5 s
    looser = compute_report(records, ttft_slo_ms=5000.0, tbt_slo_ms=100.0)
    assert looser.slo_attainment == 0.75
    assert looser.goodput_rps == pytest.approx(3 / 3.5)
    assert "goodput req/s" in format_reports([r, looser])


def test_empty_and_all_rejected():
    r = compute_report([rec(0, status="rejected"), rec(1, status="error")], 100.0, 100.0)
    assert (r.done, r.rejected, r.errors, r.slo_attainment, r.hit_rate) == (0, 1, 1, 0.0, 0.0)
    assert math.isnan(r.ttft_ms.p50)
    assert compute_report([], 1.0, 1.0).requests == 0


def test_records_round_trip_table_and_png(tmp_path):
    a = [rec(i, ttft=100.0 + 10 * i, gaps=[5.0, 6.0 + i], policy="mooncake") for i in range(20)]
    b = [rec(i, ttft=300.0 + 30 * i, gaps=[9.0, 9.0 + i], policy="cache_off") for i in range(19)]
    b.append(rec(19, status="rejected", policy="cache_off"))
    write_records(tmp_path / "a.jsonl", a)
    back = read_records(tmp_path / "a.jsonl")
    assert back == a
    table = format_reports([compute_report(a, 400.0, 20.0), compute_report(b, 400.0, 20.0)])
    assert "mooncake" in table and "cache_off" in table and "19 / 1 / 0" in table
    png = plot_cdfs({"mooncake": a, "cache_off": b}, 400.0, 20.0, tmp_path / "out" / "cdf.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_prediction_error_against_the_measures():
    # predicted TTFT 100 / 150 / 0 (no estimate) against measured 100 / 100 / 100; TBT by
    # Mooncake's definition (a lone gap is the TBT) against the estimates.
    records = [
        rec(0, ttft=100.0, gaps=[20.0])._replace(predicted_ttft_ms=100.0, predicted_tbt_ms=10.0),
        rec(1, ttft=100.0, gaps=[20.0])._replace(predicted_ttft_ms=150.0, predicted_tbt_ms=30.0),
        rec(2, ttft=100.0, gaps=[20.0]),
        rec(3, status="rejected"),
    ]
    r = compute_report(records, 1000.0, 100.0)
    assert r.ttft_prediction.requests == 2  # the one without an estimate and the rejected left out
    assert r.ttft_prediction.median_abs == pytest.approx(0.25)
    assert r.ttft_prediction.median == pytest.approx(0.25)  # over-predicted on the whole
    assert r.ttft_prediction.p90_abs == pytest.approx(0.45)
    assert r.tbt_prediction.median_abs == pytest.approx(0.5)
    assert r.tbt_prediction.median == pytest.approx(0.0)  # one under by half, one over by half
    # predicted / measured 1.0 and 1.5
    assert (r.ttft_prediction.ratio_p50, r.ttft_prediction.ratio_p90) == pytest.approx((1.25, 1.45))
    text = format_reports([r])
    assert "TTFT pred. error" in text and "25% / 45% (+25%)" in text
    assert "1.25 / 1.45" in text


def test_records_from_before_the_prediction_fields_still_read(tmp_path):
    path = tmp_path / "r.jsonl"
    write_records(path, [rec(0, gaps=[5.0])])
    lines = path.read_text().splitlines()
    import json

    old = json.loads(lines[0])
    for k in ("predicted_ttft_ms", "predicted_tbt_ms", "queue_ms"):
        old.pop(k)
    path.write_text(json.dumps(old) + "\n")
    (r,) = read_records(path)
    assert r.predicted_ttft_ms == 0.0
    assert compute_report([r], 1000.0, 100.0).ttft_prediction.requests == 0


def test_request_tpot_is_the_mean_gap_as_the_benchmark_client_counts_it():
    from client import request_tpot

    # (end-to-end - TTFT) / (output tokens - 1): (1000 - 100) / 9
    assert request_tpot(rec(0, ttft=100.0, gaps=[10.0] * 9)) == pytest.approx(100.0)
    assert request_tpot(rec(0, ttft=100.0, gaps=[])) == 0.0  # one token: no gap


def test_a_report_judged_by_tpot():
    records = [
        # 10 tokens in 400 ms after the first: TPOT 300 / 9 = 33.3, but its slowest gap (TBT) 100
        rec(0, ttft=100.0, gaps=[25.0] * 8 + [100.0], e2e=400.0),
        # steady, 11 gaps of 60: TPOT 60 (e2e 100 + 660)
        rec(1, ttft=100.0, gaps=[60.0] * 11, e2e=760.0),
        rec(2, status="rejected"),
    ]
    # TBT alone: neither meets 50 ms (100 and 60)
    by_tbt = compute_report(records, 500.0, 50.0)
    assert by_tbt.slo_attainment == 0.0 and by_tbt.tpot_slo_ms == 0.0
    # TPOT alone (TBT 0: not judged): the first meets 50 ms, the steady one does not
    by_tpot = compute_report(records, 500.0, 0.0, tpot_slo_ms=50.0)
    assert by_tpot.slo_attainment == pytest.approx(1 / 3)
    assert by_tpot.tpot_slo_ms == 50.0
    assert by_tpot.tpot_ms.p50 == pytest.approx((300.0 / 9 + 60.0) / 2)
    # both judged: a request meets every one set
    assert compute_report(records, 500.0, 150.0, tpot_slo_ms=50.0).slo_attainment == pytest.approx(
        1 / 3
    )
    assert compute_report(records, 500.0, 80.0, tpot_slo_ms=50.0).slo_attainment == 0.0
    table = format_reports([by_tbt, by_tpot])
    assert "TPOT p50/p90/p99 ms" in table
    assert "(TTFT<=500, TBT<=50 ms)" in table and "(TTFT<=500, TPOT<=50 ms)" in table
    # the positional fields before it are where they were: a report built by position still is
    assert by_tpot._fields.index("tpot_ms") > by_tpot._fields.index("prefilled_on_decode")
