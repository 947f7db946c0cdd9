"""Routing policies and timing models on hand-built cluster states (pure objects, no servers)."""

from __future__ import annotations

import random

import pytest

from conductor import (
    ClusterState,
    DecodeCandidate,
    Link,
    MissesObjectives,
    PrefillCandidate,
    Rejected,
    RequestInfo,
    admit,
    make_policy,
)
from kvstore.links import LinkModel
from servekit import DecodeTimeModel, PrefillTimeModel

BS = 16
BLOCK_BYTES = 1_000_000  # 1 MB a block: 1 ms a block at the default 1 GB/s


def prefill(wid, queue_ms=0.0, coef=(0.0, 1.0, 0.0), healthy=True):
    # 1 ms per computed token, so TTFT arithmetic in the tests stays readable.
    return PrefillCandidate(wid, (f"{wid}-node",), queue_ms, coef, healthy)


def decode(wid, running=0, free=100, total=100, context=0, coef=(10.0, 1.0, 0.0), healthy=True):
    return DecodeCandidate(wid, running, free, total, context, coef, healthy)


def state(prefills, decodes, matches, device_nodes=()):
    return ClusterState(prefills, decodes, matches, BS, BLOCK_BYTES, frozenset(device_nodes))


def req(tokens=160, max_tokens=16, ttft=0.0, tbt=0.0, tpot=0.0):
    return RequestInfo(tokens, max_tokens, ttft, tbt, tpot_slo_ms=tpot)


def test_mooncake_prefers_the_worker_holding_the_prefix():
    s = state([prefill("a"), prefill("b")], [decode("d")], {"b-node": 8})
    d = make_policy("mooncake").choose(req(), s)
    assert d.prefill == "b" and d.fetch_from == "" and d.reuse_blocks == 8
    # 160 tokens, 128 cached: 32 computed at 1 ms each.
    assert d.predicted_ttft_ms == pytest.approx(32.0)


def test_mooncake_weighs_queueing_against_cache():
    # b holds 8 blocks but is busy: computing 144 tokens on a (144 ms) beats 500 + 32 ms on b.
    s = state(
        [prefill("a"), prefill("b", queue_ms=500.0)], [decode("d")], {"a-node": 1, "b-node": 8}
    )
    # Fetching b's prefix is never worth it.
    pol = make_policy("mooncake", kvcache_balancing_threshold=100.0)
    d = pol.choose(req(), s)
    assert (d.prefill, d.fetch_from, d.reuse_blocks) == ("a", "", 1)
    assert d.predicted_ttft_ms == pytest.approx(144.0)


def test_transfer_decision_around_the_threshold():
    # a holds 4 blocks itself, node x holds 7 elsewhere; b (busy) holds nothing.
    s = state([prefill("a"), prefill("b", queue_ms=10_000)], [decode("d")], {"a-node": 4, "x": 7})
    fetch = lambda t: make_policy("mooncake", kvcache_balancing_threshold=t)  # noqa: E731
    below = fetch(2.0).choose(req(), s)  # 7 <= 2*4: compute what its own tiers lack
    assert (below.prefill, below.fetch_from, below.fetch_blocks) == ("a", "", 0)
    assert below.reuse_blocks == 4
    assert below.predicted_ttft_ms == pytest.approx(160 - 64)
    at = fetch(7 / 4).choose(req(), s)  # 7 == 1.75*4: not beyond the threshold, no fetch
    assert (at.fetch_from, at.fetch_blocks) == ("", 0)
    above = fetch(1.5).choose(req(), s)  # 7 > 1.5*4: fetch from the remote store node
    assert (above.prefill, above.fetch_from, above.fetch_blocks) == ("a", "x", 7)
    assert above.reuse_blocks == 7
    # 160 - 112 tokens computed + 3 blocks moved at 1 ms each.
    assert above.predicted_ttft_ms == pytest.approx(48 + 3)


def test_the_transfer_estimate_uses_the_bytes_a_cachegen_fetch_moved():
    # Worker a's last CacheGen fetch moved 0.1 MB per block (1 MB raw): the same 3-block fetch
    # is predicted at 0.3 ms, not 3 ms; worker b (raw blocks) still costs 3 ms.
    a = PrefillCandidate("a", ("a-node",), 0.0, (0.0, 1.0, 0.0), True, 100_000.0)
    s = state([a], [decode("d")], {"a-node": 4, "x": 7})
    d = make_policy("mooncake", kvcache_balancing_threshold=1.5).choose(req(), s)
    assert (d.fetch_from, d.fetch_blocks) == ("x", 7)
    assert d.predicted_ttft_ms == pytest.approx(48 + 0.3)
    s = state([prefill("a")], [decode("d")], {"a-node": 4, "x": 7})
    d = make_policy("mooncake", kvcache_balancing_threshold=1.5).choose(req(), s)
    assert d.predicted_ttft_ms == pytest.approx(48 + 3)


def test_a_fetch_goes_over_the_link_as_measured_and_only_when_faster():
    # a holds 4 blocks, node x holds 9: fetching moves 5 blocks of 1 MB, computing them instead
    # costs 80 tokens at 1 ms (the last 16 are computed either way).
    s = lambda *links: state(  # noqa: E731
        [prefill("a")._replace(links=links)], [decode("d")], {"a-node": 4, "x": 9}
    )
    pol = make_policy("mooncake", kvcache_balancing_threshold=1.5)
    # Not measured yet: the default speed (1 GB/s: 5 ms), said in the decision.
    d = pol.choose(req(), s())
    assert (d.fetch_from, d.fetch_blocks, d.reuse_blocks) == ("x", 9, 9)
    assert d.predicted_ttft_ms == pytest.approx(5 + 16) and d.assumed_link == "x"
    # A measured fast link: 2 ms of round trips + 5 MB at 0.5 MB/ms = 12 ms, still the faster.
    fast = Link("x", 2.0, 500_000.0)
    d = pol.choose(req(), s(fast))
    assert (d.fetch_from, d.assumed_link) == ("x", "")
    assert d.predicted_ttft_ms == pytest.approx(12 + 16)
    # A slow one: 2 + 100 ms against 80 ms of compute: nothing moves, the 4 own blocks are
    # reused and the rest computed.
    slow = Link("x", 2.0, 50_000.0)
    d = pol.choose(req(), s(slow))
    assert (d.fetch_from, d.fetch_blocks, d.reuse_blocks) == ("", 0, 4)
    assert d.predicted_ttft_ms == pytest.approx(160 - 64)
    # A link measured from another node says nothing of x's.
    assert pol.choose(req(), s(slow._replace(node="y"))).assumed_link == "x"
    # Each side of the crossover (5 MB in 80 ms: 0.0625 MB/ms).
    for rate, fetches in ((0.0632, True), (0.0618, False)):
        d = pol.choose(req(), s(Link("x", 0.0, rate * 1e6)))
        assert (d.fetch_from == "x") is fetches, rate
    # Below the threshold no fetch is weighed, however fast the link.
    d = make_policy("mooncake", kvcache_balancing_threshold=3.0).choose(req(), s(fast))
    assert (d.fetch_from, d.assumed_link) == ("", "")


def test_the_transfer_estimate_counts_the_bytes_a_block_moves_at_the_stores_codec():
    # int8 blocks move 0.25 MB each where the pool's are 1 MB: on a 0.05 MB/ms link the 5 blocks
    # take 25 ms, not 100, and fetching wins again.
    a = prefill("a")._replace(links=(Link("x", 0.0, 50_000.0),), fetch_block_bytes=250_000.0)
    d = make_policy("mooncake").choose(req(), state([a], [decode("d")], {"a-node": 4, "x": 9}))
    assert (d.fetch_from, d.predicted_ttft_ms) == ("x", pytest.approx(25 + 16))


def test_a_link_model_follows_the_link_it_measures():
    # A fetch pays a lookup's round trip, then the transfer's own and the bytes; small warm-up
    # fetches (mostly round trips) must not make larger ones look slow.
    m = LinkModel()
    m.add(lookup_ms=2.0, nbytes=40_000, transfer_ms=2.0 + 40_000 / 50_000)  # 50 MB/s flowing
    speed = m.speed()
    assert speed.fixed_ms == pytest.approx(4.0) and speed.bytes_per_ms == pytest.approx(50_000)
    assert speed.fixed_ms + 1_000_000 / speed.bytes_per_ms == pytest.approx(24.0)
    # The link becomes 100x slower: one fetch over it is enough to say so.
    m.add(lookup_ms=2.0, nbytes=40_000, transfer_ms=2.0 + 40_000 / 500)
    assert m.speed().bytes_per_ms < 1_000 and m.speed().fetches == 2
    # and back: a few fetches
    for _ in range(4):
        m.add(lookup_ms=2.0, nbytes=40_000, transfer_ms=2.0 + 40_000 / 50_000)
    assert m.speed().bytes_per_ms > 25_000
    # nothing moved: nothing learnt
    m.add(lookup_ms=2.0, nbytes=0, transfer_ms=5.0)
    assert m.speed().fetches == 6


def test_a_device_pool_is_never_a_fetch_source():
    # Each worker lists its own device pool among its nodes; a's holds the longest prefix.
    a = PrefillCandidate("a", ("a-node", "a-dev"), 10_000.0, (0.0, 1.0, 0.0))
    b = PrefillCandidate("b", ("b-node", "b-dev"), 0.0, (0.0, 1.0, 0.0))
    devs = {"a-dev", "b-dev"}
    pol = make_policy("mooncake")
    # b (idle) cannot read a's device memory: it fetches the shorter prefix a store node holds.
    d = pol.choose(req(), state([a, b], [decode("d")], {"a-dev": 9, "x": 3}, devs))
    assert (d.prefill, d.fetch_from, d.fetch_blocks, d.reuse_blocks) == ("b", "x", 3, 3)
    # With no store node holding it, b computes everything and fetches nothing.
    d = pol.choose(req(), state([a, b], [decode("d")], {"a-dev": 9}, devs))
    assert (d.prefill, d.fetch_from, d.fetch_blocks, d.reuse_blocks) == ("b", "", 0, 0)
    # a's own device pool counts toward a's own match: no fetch, 9 blocks reused.
    idle_a = a._replace(queue_ms=0.0)
    d = pol.choose(req(), state([idle_a, b], [decode("d")], {"a-dev": 9, "x": 3}, devs))
    assert (d.prefill, d.fetch_from, d.fetch_blocks, d.reuse_blocks) == ("a", "", 0, 9)
    # Every other fetch candidate: never a device node, whatever the threshold.
    for threshold in (0.0, 1.0, 1.5, 100.0):
        for matches in ({"a-dev": 9, "b-dev": 5}, {"a-dev": 9, "x": 2}, {"b-dev": 9, "x": 1}):
            d = make_policy("mooncake", kvcache_balancing_threshold=threshold).choose(
                req(), state([a, b], [decode("d")], matches, devs)
            )
            assert d.fetch_from not in devs
            assert (d.fetch_from == "") == (d.fetch_blocks == 0)


def test_reuse_leaves_one_token_to_compute():
    s = state([prefill("a")], [decode("d")], {"a-node": 10})
    d = make_policy("mooncake").choose(req(tokens=160), s)  # 160 tokens = exactly 10 blocks
    assert d.reuse_blocks == 9


def test_decode_choice_is_the_least_loaded_within_tbt():
    decs = [decode("d1", running=5), decode("d2", running=2), decode("d3", running=0, free=1)]
    d = make_policy("mooncake").choose(req(), state([prefill("a")], decs, {}))
    assert d.decode == "d2"  # d3 is idle but has no room for 11 blocks right now
    assert d.predicted_tbt_ms == pytest.approx(10 + 3)


def test_rejections():
    pol = make_policy("mooncake")
    s = state([prefill("a", queue_ms=900.0)], [decode("d", running=50)], {})
    with pytest.raises(Rejected, match="TTFT"):
        pol.choose(req(ttft=1000.0), s)  # 900 + 160 > 1000
    # 50 running, 61 ms steps: it joins after half the step in flight and the next one
    with pytest.raises(Rejected, match="admission wait"):
        pol.choose(req(ttft=1100.0), s)  # 1060 + 30.5 + 61 > 1100
    assert pol.choose(req(ttft=1200.0), s).predicted_ttft_ms == pytest.approx(1151.5)
    with pytest.raises(Rejected, match="between tokens"):
        pol.choose(req(tbt=50.0), s)  # 10 + 51 > 50
    with pytest.raises(Rejected, match="KV pool") as exc:
        pol.choose(req(tokens=2000), state([prefill("a")], [decode("d", total=100)], {}))
    assert not isinstance(exc.value, MissesObjectives)  # no pair at all: nothing to retry
    with pytest.raises(Rejected, match="prefill") as exc:
        pol.choose(req(), state([prefill("a", healthy=False)], [decode("d")], {}))
    assert not isinstance(exc.value, MissesObjectives)
    # The baselines never reject on SLOs.
    assert make_policy("load_balance").choose(req(ttft=1.0, tbt=1.0), s).prefill == "a"


def test_a_missed_objective_says_by_how_much_and_when_to_retry():
    pol = make_policy("mooncake")
    s = state([prefill("a", queue_ms=2500.0)], [decode("d", running=50)], {})
    with pytest.raises(MissesObjectives) as exc:
        pol.choose(req(ttft=1000.0), s)  # 2500 + 160 = 2660: 1660 ms over
    assert exc.value.over_ms == pytest.approx(1660.0) and exc.value.retry_after_s == 2
    with pytest.raises(MissesObjectives) as exc:
        pol.choose(req(tbt=60.5), s)  # steps of 61 ms: half a millisecond over
    assert exc.value.over_ms == pytest.approx(0.5) and exc.value.retry_after_s == 1
    assert "61 ms" in str(exc.value)
    # without objectives the same state has a pair: what best-effort admission serves it on
    assert pol.choose(req(), s).prefill == "a"


def test_a_kivi_window_is_not_counted_against_the_decode_pool():
    # 101 + 40 tokens: 9 blocks in a full-precision pool; with a 16-token KIVI window kept apart,
    # at most (141 - 16) // 16 = 7 packed blocks (what the decode worker reserves)
    pol = make_policy("load_balance")
    small = [decode("d", free=7, total=7)]
    with pytest.raises(Rejected, match="large enough for 9 blocks"):
        pol.choose(req(tokens=101, max_tokens=40), state([prefill("a")], small, {}))
    kivi = state([prefill("a")], small, {})._replace(window_tokens=16)
    assert pol.choose(req(tokens=101, max_tokens=40), kivi).decode == "d"
    with pytest.raises(Rejected, match="large enough for 8 blocks"):
        pol.choose(req(tokens=101, max_tokens=56), kivi)


def test_baselines():
    s = state(
        [prefill("a", queue_ms=5.0), prefill("b", queue_ms=1.0)],
        [decode("d1", running=3), decode("d2")],
        {"a-node": 9},
    )
    lb = make_policy("load_balance").choose(req(), s)
    assert (lb.prefill, lb.decode, lb.use_cache) == ("b", "d2", True)
    off = make_policy("cache_off").choose(req(), s)
    assert (off.prefill, off.use_cache, off.reuse_blocks) == ("b", False, 0)
    randoms = [make_policy("random", seed=i).choose(req(), s) for i in range(20)]
    assert {d.prefill for d in randoms} == {"a", "b"}
    # The baselines never fetch remotely: their workers use their own tiers only.
    for d in [lb, off, *randoms]:
        assert (d.fetch_from, d.fetch_blocks) == ("", 0)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")


def test_timing_models_fit_measurements():
    rng = random.Random(0)
    true = (3.0, 0.5, 0.001)
    m = PrefillTimeModel(prior=(0.0, 0.0, 0.0))
    for _ in range(200):
        tokens = rng.randrange(16, 1024)
        ctx = tokens + rng.randrange(0, 1024)
        m.observe(true[0] + true[1] * tokens + true[2] * tokens * ctx, tokens, ctx)
    assert m.predict(100, 300) == pytest.approx(3 + 50 + 30, rel=0.05)
    assert m.predict(1000, 2000) == pytest.approx(3 + 500 + 2000, rel=0.05)
    before = m.predict(1000, 2000)
    m.observe(50_000.0, 1000, 2000)  # one step stalled by a neighbour's burst
    assert m.predict(1000, 2000) == pytest.approx(before, rel=0.02)


def test_timing_model_does_not_extrapolate_from_a_few_noisy_points():
    # The failure this guards against: a handful of warm-up steps at short contexts and one slow
    # step at a longer one made a plain fit predict seconds per token at 1k context (and reject
    # requests).
    d = DecodeTimeModel(prior=(20.0, 2.0, 0.0))
    for ctx in (25, 26, 27, 31, 32, 33, 34):
        d.observe(60.0, 1, ctx)
    d.observe(500.0, 1, 257)
    assert d.samples == 8
    assert 40.0 < d.predict(1, 1024) < 120.0
    # The batch never varied: its coefficient stays near the prior.
    assert d.coef[1] == pytest.approx(2.0, rel=0.05)


def test_admission_wait_is_in_ttft_and_tbt_is_the_step_of_the_batch_it_joins():
    from conductor.estimates import decode_estimate

    # The conductor holds the first token until the decode worker admits the sequence, so the
    # wait for pool room is TTFT. No free block: the request (32 + 16 tokens = 3 blocks) waits
    # until the sequence ending in 10 steps frees its 5; the other runs 50 more. Each step costs
    # 10 + 1*batch ms.
    d = DecodeCandidate(
        "d", 2, 0, 10, 200, (10.0, 1.0, 0.0), True, seqs=((100, 10, 5), (100, 50, 5))
    )
    r = req(tokens=32, max_tokens=16)
    est = decode_estimate(d, r, BS)
    assert est.admission_wait_ms == pytest.approx(10 * 12.0)  # 10 steps of two
    assert est.step_ms == pytest.approx(12.0)  # it joins the one left: a batch of two
    # every gap of its answer is a step of that batch of two: no gap holds the wait
    assert est.tbt_ms == pytest.approx(12.0)
    # a prefill answering before the pool has room waits for it, then for the step it joins at
    # (the one left running: 11 ms); one answering later waits half a step in flight on average
    assert est.ttft_ms(50.0) == pytest.approx(120.0 + 11.0)
    assert est.ttft_ms(200.0) == pytest.approx(200.0 + 5.5 + 11.0)
    # room now: the step in flight (two running, 12 ms) half on average, the pull alongside the
    # next one, then a batch of three (13 ms) until the first sequence ends
    roomy = d._replace(free_blocks=10)
    est = decode_estimate(roomy, r, BS)
    assert est.admission_wait_ms == 0.0 and est.step_ms == pytest.approx(13.0)
    assert est.tbt_ms == pytest.approx(13.0)
    assert est.ttft_ms(100.0) == pytest.approx(100.0 + 6.0 + 12.0)
    # a pull longer than a step (2 prompt blocks at 9 ms) ends off a boundary: half a step more
    est = decode_estimate(roomy._replace(pull_ms_per_block=9.0), r, BS)
    assert est.ttft_ms(100.0) == pytest.approx(100.0 + 6.0 + 18.0 + 6.0)
    # a prefill answering after both running sequences have ended (10 steps of 12 ms, 40 of
    # 11): the worker is idle by then and admits it at once
    assert est.ttft_ms(1000.0) == pytest.approx(1000.0 + 18.0)
    # an idle worker admits at once: the pull only
    idle = DecodeCandidate("i", 0, 10, 10, 0, (10.0, 1.0, 0.0), True, pull_ms_per_block=9.0)
    est = decode_estimate(idle, r, BS)
    assert est.ttft_ms(100.0) == pytest.approx(118.0) and est.tbt_ms == pytest.approx(11.0)


def test_tbt_estimate_follows_the_context_the_batch_grows_to():
    from conductor.estimates import decode_estimate

    # 1 ms a step per 100 KV tokens: a long answer alongside a long-running sequence sees the
    # context grow; Mooncake's TBT (slowest 10%) is near its end, above the first step's cost.
    d = DecodeCandidate("d", 1, 100, 100, 1000, (0.0, 0.0, 0.01), True, seqs=((1000, 400, 10),))
    est = decode_estimate(d, req(tokens=100, max_tokens=300), BS)
    assert est.step_ms == pytest.approx(11.0)
    assert est.tbt_ms == pytest.approx(0.01 * (1000 + 100 + 2 * 299), rel=0.02)


def test_mooncake_steers_around_a_decode_worker_that_would_make_it_wait():
    busy = DecodeCandidate("a", 1, 0, 10, 100, (10.0, 1.0, 0.0), True, seqs=((100, 400, 10),))
    idle = DecodeCandidate("b", 3, 10, 10, 300, (10.0, 1.0, 0.0), True, seqs=())
    s = state([prefill("p")], [busy, idle], {})
    d = make_policy("mooncake").choose(req(tokens=32, max_tokens=16, tbt=100.0), s)
    assert d.decode == "b"
    # On the busy one it waits 400 steps (11 ms) for pool room after a 32 ms prefill: that is
    # its TTFT, and its steps alone in the batch are 11 ms, well within the TBT SLO.
    alone = state([prefill("p")], [busy], {})
    d = make_policy("mooncake").choose(req(tokens=32, max_tokens=16, tbt=100.0), alone)
    assert d.predicted_ttft_ms == pytest.approx(4400.0)
    assert d.predicted_admission_ms == pytest.approx(4400.0 - 32.0)
    assert d.predicted_tbt_ms == pytest.approx(11.0)
    with pytest.raises(Rejected, match="TTFT .* admission wait"):
        make_policy("mooncake").choose(req(tokens=32, max_tokens=16, ttft=1000.0), alone)


def _local_state(prefill_queue_ms=0.0, decode_running=0, matches=None):
    """One prefill worker (1 ms a token) and one decode worker on host node d-node."""
    d = decode("d", running=decode_running)._replace(nodes=("d-node",))
    return state([prefill("a", queue_ms=prefill_queue_ms)], [d], matches or {})


def test_a_short_prompt_is_prefilled_on_the_decode_worker_a_long_one_is_not():
    pol = make_policy("mooncake", local_prefill_tokens=64)
    # 48 tokens, both idle: no queue and no transfer either way; the decode worker serves it
    short = pol.choose(req(tokens=48), _local_state())
    assert short.prefill_on_decode and short.prefill == "" and short.decode == "d"
    assert short.predicted_prefill_ms == pytest.approx(48.0)
    long = pol.choose(req(tokens=160), _local_state())
    assert not long.prefill_on_decode and long.prefill == "a"
    # off by default: the same short prompt goes to the prefill worker
    assert make_policy("mooncake").choose(req(tokens=48), _local_state()).prefill == "a"


def test_a_mostly_cached_prompt_counts_only_what_is_left_to_compute():
    pol = make_policy("mooncake", local_prefill_tokens=64)
    # 160 tokens, 8 blocks (128 tokens) on the decode host's store: 32 to compute there
    d = pol.choose(req(tokens=160), _local_state(matches={"d-node": 8}))
    assert d.prefill_on_decode and d.reuse_blocks == 8
    assert d.predicted_prefill_ms == pytest.approx(32.0)
    # the same blocks on the prefill worker's node only: 160 to compute on the decode worker
    assert not pol.choose(req(tokens=160), _local_state(matches={"a-node": 8})).prefill_on_decode


def test_the_decode_worker_takes_a_short_prompt_stuck_behind_a_long_prefill_queue():
    pol = make_policy("mooncake", local_prefill_tokens=64)
    # the prefill worker has 3 s of work queued: the 48-token prompt would wait for all of it
    d = pol.choose(req(tokens=48, ttft=2000.0, tbt=100.0), _local_state(prefill_queue_ms=3000.0))
    assert d.prefill_on_decode and d.predicted_ttft_ms < 2000.0
    # a long one is refused (no prefill worker meets it, and it is not the decode worker's)
    with pytest.raises(MissesObjectives):
        pol.choose(req(tokens=160, ttft=2000.0), _local_state(prefill_queue_ms=3000.0))


def test_a_running_batch_slows_a_prefill_on_its_decode_worker_to_the_cpu_it_leaves():
    pol = make_policy("mooncake", local_prefill_tokens=64)
    idle = pol.choose(req(tokens=48, tbt=100.0), _local_state())
    assert idle.prefill_on_decode and idle.predicted_ttft_ms == pytest.approx(48.0)
    busy = pol.choose(req(tokens=48, tbt=100.0), _local_state(decode_running=20))
    # 21 sequences, 31 ms steps, 80 of each 100 ms kept for them: the prefill gets 49 ms in 80,
    # so its 48 ms take 78.4, and it joins the batch at a step boundary (half a step)
    assert busy.prefill_on_decode
    assert busy.predicted_ttft_ms == pytest.approx(48.0 * 80 / 49 + 15.5)
    # the prefill worker's way costs as much here (48 ms, then the join): a slower decode CPU
    # share tips it
    slower = make_policy("mooncake", local_prefill_tokens=64, tbt_pace_fraction=0.5)
    assert slower.choose(req(tokens=48, tbt=100.0), _local_state(decode_running=20)).prefill == "a"


def test_a_resumed_request_is_never_prefilled_on_its_decode_worker():
    pol = make_policy("mooncake", local_prefill_tokens=64)
    info = req(tokens=48)._replace(resumed=True)
    assert pol.choose(info, _local_state()).prefill == "a"
    # and a cluster without a prefill model to predict by sends nothing there
    no_prefill = state([], [decode("d")._replace(nodes=("d-node",))], {})
    with pytest.raises(Rejected):
        pol.choose(req(tokens=48), no_prefill)


def test_a_miss_predicted_by_an_unchecked_model_on_an_idle_worker_is_a_probe():
    pol = make_policy("mooncake")
    # idle prefill worker whose model says 160 ms against a 100 ms objective
    fresh = state([prefill("a")._replace(checked=False)], [decode("d")], {})
    d, how = admit(pol, req(ttft=100.0), fresh)
    assert how == "probe" and d.prefill == "a"  # served: its outcome checks the model
    # a checked model is believed: refused (or best-effort where so configured)
    checked = state([prefill("a")], [decode("d")], {})
    with pytest.raises(MissesObjectives):
        admit(pol, req(ttft=100.0), checked)
    assert admit(pol, req(ttft=100.0), checked, "best_effort")[1] == "best_effort"
    # a busy worker's miss comes from its queue as much as its model: refused
    busy = state([prefill("a", queue_ms=500.0)._replace(checked=False)], [decode("d")], {})
    with pytest.raises(MissesObjectives):
        admit(pol, req(ttft=100.0), busy)
    # the same for a decode worker's TBT: idle and unchecked, a probe
    slow = state([prefill("a")], [decode("d", coef=(300.0, 1.0, 0.0))._replace(checked=False)], {})
    assert admit(pol, req(tbt=100.0), slow)[1] == "probe"
    # ... but not past what a correction could bring within the objective (5x): refused
    with pytest.raises(MissesObjectives):
        admit(pol, req(ttft=30.0), fresh)  # 160 ms predicted, 30 ms asked
    with pytest.raises(MissesObjectives):
        admit(pol, req(tbt=50.0), slow)  # 301 ms
    assert admit(pol, req(), checked)[1] == "admitted"


# A batch that thins out under the answer: each step costs 10 + 10*batch ms, one sequence running
# with 4 tokens to go. An 11-token answer (10 gaps) joins it at once: 4 gaps at a batch of two
# (30 ms), then 6 alone (20 ms). Its TBT (the slowest 10%, one gap) is 30 ms, its TPOT (the mean
# gap) (4 * 30 + 6 * 20) / 10 = 24 ms.
THINNING = DecodeCandidate("d", 1, 100, 100, 100, (10.0, 10.0, 0.0), True, seqs=((100, 4, 2),))


def test_tpot_estimate_is_the_mean_step_and_never_above_the_tbt():
    from conductor.estimates import decode_estimate

    est = decode_estimate(THINNING, req(tokens=32, max_tokens=11), BS)
    assert est.tbt_ms == pytest.approx(30.0)
    assert est.tpot_ms == pytest.approx(24.0)
    # a long answer (its steps sampled at points over its life) and the totals-only estimate
    long = decode_estimate(THINNING, req(tokens=32, max_tokens=300), BS)
    assert 20.0 < long.tpot_ms < long.tbt_ms <= 30.0
    totals = decode_estimate(decode("t", running=2, context=50), req(tokens=32), BS)
    assert totals.tpot_ms == totals.tbt_ms == pytest.approx(10.0 + 3.0)  # a batch of three
    # the context growing under the answer: the mean sits between its first step and its TBT
    grow = DecodeCandidate("g", 1, 100, 100, 1000, (0.0, 0.0, 0.01), True, seqs=((1000, 400, 10),))
    est = decode_estimate(grow, req(tokens=100, max_tokens=300), BS)
    assert est.step_ms < est.tpot_ms < est.tbt_ms
    assert est.tpot_ms == pytest.approx(0.01 * (1000 + 100 + 299), rel=0.02)  # the middle gap's


def test_a_worker_within_the_tpot_objective_but_not_the_tbt_one():
    s = state([prefill("p")], [THINNING], {})
    pol = make_policy("mooncake")
    # judged by TPOT alone (TBT 0: not judged): 24 ms predicted within 25, admitted
    d = pol.choose(req(tokens=32, max_tokens=11, tpot=25.0), s)
    assert d.decode == "d" and d.predicted_tbt_ms == pytest.approx(30.0)
    assert admit(pol, req(tokens=32, max_tokens=11, tpot=25.0), s)[1] == "admitted"
    # judged by TBT too: the slowest gaps (30 ms) miss 25
    with pytest.raises(MissesObjectives, match="time between tokens 30 ms exceeds the 25 ms"):
        pol.choose(req(tokens=32, max_tokens=11, tbt=25.0, tpot=25.0), s)
    # a TPOT objective below the mean step is refused, named, with its excess to retry after
    with pytest.raises(MissesObjectives, match="time per output token 24 ms exceeds the 20 ms"):
        pol.choose(req(tokens=32, max_tokens=11, tpot=20.0), s)
    # both missed: both named, the retry after the smaller excess
    with pytest.raises(MissesObjectives) as both:
        pol.choose(req(tokens=32, max_tokens=11, tbt=25.0, tpot=20.0), s)
    assert "time between tokens" in str(both.value) and "time per output token" in str(both.value)
    assert both.value.over_ms == pytest.approx(4.0)
    # best-effort admission serves it judged by nothing
    d, how = admit(pol, req(tokens=32, max_tokens=11, tpot=20.0), s, "best_effort")
    assert how == "best_effort" and d.decode == "d"


def test_the_tpot_objective_steers_to_the_worker_that_meets_it():
    # the thinning batch beside one busier in sequences but steady (a batch of 3 at 1 ms a
    # sequence: 13 ms each step) and lighter: load alone would pick "d" (fewer running)
    steady = DecodeCandidate("e", 2, 100, 100, 100, (10.0, 1.0, 0.0), True,
                             seqs=((50, 400, 2), (50, 400, 2)))  # fmt: skip
    s = state([prefill("p")], [THINNING, steady], {})
    pol = make_policy("mooncake")
    assert pol.choose(req(tokens=32, max_tokens=11), s).decode == "d"
    assert pol.choose(req(tokens=32, max_tokens=11, tpot=20.0), s).decode == "e"


def test_a_prefill_on_the_decode_worker_is_paced_by_the_tpot_objective_when_tbt_is_off():
    pol = make_policy("mooncake", local_prefill_tokens=64)
    # as with a TBT objective of 100 ms (the test above): 80 of each 100 ms kept for the steps
    by_tbt = pol.choose(req(tokens=48, tbt=100.0), _local_state(decode_running=20))
    by_tpot = pol.choose(req(tokens=48, tpot=100.0), _local_state(decode_running=20))
    assert by_tpot.prefill_on_decode
    assert by_tpot.predicted_ttft_ms == pytest.approx(by_tbt.predicted_ttft_ms)
    assert by_tpot.predicted_ttft_ms == pytest.approx(48.0 * 80 / 49 + 15.5)
    # and a decode worker past the TPOT objective (31 ms steps) serves it neither way
    with pytest.raises(MissesObjectives, match="time per output token 31 ms"):
        pol.choose(req(tokens=48, tpot=20.0), _local_state(decode_running=20))


def test_the_objective_a_stream_is_paced_by():
    from conductor.estimates import paced_slo_ms, tpot_of_times

    assert paced_slo_ms(200.0, 0.0) == 200.0  # TBT alone: as before TPOT
    assert paced_slo_ms(0.0, 80.0) == 80.0  # TPOT alone
    assert paced_slo_ms(200.0, 80.0) == 80.0 and paced_slo_ms(50.0, 80.0) == 50.0  # the stricter
    assert paced_slo_ms(0.0, 0.0) == 0.0
    assert tpot_of_times([100.0, 110.0, 130.0, 190.0]) == pytest.approx(30.0)
    assert tpot_of_times([100.0]) == 0.0
