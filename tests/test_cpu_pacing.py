"""The host's CPUs go where the objectives need them: a burst of long prompts over running decode
streams on one host's shared cores. The streams keep flowing (every one gets tokens while the
prompts compute), and the prompts get more of the CPUs than the decode steps: the decode worker
offers the slack its streams have under their TBT objective, and the prefill keeps the CPUs that
long. Counted (turns held, tokens, passes), not timed."""

from __future__ import annotations

import random
import threading

import pytest

from conductor.state import cluster_state
from model import load_model
from model.fetch import smollm2_path
from tests.serving_cluster import Cluster, request, wait_for

pytestmark = pytest.mark.skipif(
    not smollm2_path().exists(), reason="SmolLM2 not fetched (make model)"
)

STREAMS = 3
STREAM_TOKENS = 200  # long enough to outlast the burst
BURST = 3
BURST_TOKENS = 1200  # each prompt: ~1 s of prefill on 2 cores
TBT_SLO_MS = 100.0


@pytest.fixture(scope="module")
def lm():
    return load_model("smollm2-135m")


def test_a_burst_of_long_prompts_takes_the_cpus_while_streams_keep_flowing(lm):
    rng = random.Random(0)
    vocab = lm.config.vocab_size
    objectives = {"tbt_slo_ms": TBT_SLO_MS, "ttft_slo_ms": 120_000.0}
    with Cluster(lm, prefill={"cpu_turns": "on"}, decode={"cpu_turns": "on"}) as c:
        prefill, decode = c.prefills[0].runner.turns, c.decodes[0].runner.turns
        assert prefill.path == decode.path  # one host, one CPU set: they take turns
        counts = [0] * STREAMS
        errors: list[BaseException] = []

        def stream(i: int) -> None:
            prompt = [rng.randrange(3, vocab) for _ in range(40)]
            try:
                for msg in c.stub.Generate(
                    request(token_ids=prompt, max_tokens=STREAM_TOKENS, **objectives), timeout=300
                ):
                    counts[i] += len(msg.token_ids)
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        streams = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in streams:
            t.start()
        wait_for(lambda: min(counts) >= 5, 120, "every stream decoding")
        assert decode.granted_ms() is not None and decode.granted_ms() > 0  # its slack offered
        # the conductor knows they take turns (the same lock, one host): it predicts a prompt
        # there at the share the streams' pacing leaves
        st = cluster_state(c.conductor.fleet, {}, c.conductor.config)
        assert [p.cpu_peers for p in st.prefill] == [(st.decode[0].worker_id,)]
        held0 = (prefill.held_s, decode.held_s)
        passes0, tokens0 = prefill.passes, list(counts)

        prompts = [[rng.randrange(3, vocab) for _ in range(BURST_TOKENS)] for _ in range(BURST)]
        burst = [
            threading.Thread(target=c.generate, kwargs={"token_ids": p, "max_tokens": 1})
            for p in prompts
        ]
        for t in burst:
            t.start()
        for t in burst:
            t.join()
        held_prefill = prefill.held_s - held0[0]
        held_decode = decode.held_s - held0[1]
        during = [n - n0 for n, n0 in zip(counts, tokens0)]
        passes = prefill.passes - passes0
        for t in streams:
            t.join()
        assert not errors, errors
        assert all(n == STREAM_TOKENS for n in counts)

    # the prompts had the CPUs most of the time ...
    assert held_prefill > held_decode, (held_prefill, held_decode)
    # ... and handed them to the decode steps between layers, so no stream stood still
    assert passes >= 3, passes
    assert min(during) >= passes // 2, (during, passes)


def test_mean_pacing_lends_a_prefill_what_a_stream_banked_ahead_of_its_objective():
    import time

    from decode_node import DecodeConfig
    from decode_node.scheduler import MAX_BANKED_GAPS, banked_gap_ms
    from decode_node.seq import Seq
    from protos import halfmoon_pb2 as pb

    s = Seq(pb.DecodeRequest(first_token=5, tbt_slo_ms=100.0), budget=64, need_blocks=1)
    now = time.perf_counter()
    s.joined = now - 0.5  # joined 500 ms ago ...
    s.out = [5] + [7] * 20  # ... and made 20 gaps since: 25 ms each
    # its next gap may take what 21 gaps at 80 ms leave after the 500 ms spent: 1,180 ms,
    # capped at MAX_BANKED_GAPS objectives
    assert banked_gap_ms(s, now, 0.8) == pytest.approx(min(1180.0, MAX_BANKED_GAPS * 100.0))
    s.out = [5] + [7] * 3  # behind: 3 gaps in 500 ms (167 ms each) leaves nothing to lend
    assert banked_gap_ms(s, now, 0.8) == 0.0
    s.joined = now  # just joined: the bare objective's fraction
    s.out = [5]
    assert banked_gap_ms(s, now, 0.8) == pytest.approx(80.0)
    with pytest.raises(ValueError, match="tbt_pacing"):
        DecodeConfig(tbt_pacing="average")


def test_a_stream_that_joins_is_in_the_slack_offered_before_its_first_step(lm, monkeypatch):
    # Mean pacing: streams that ran ahead of their objective bank the difference and offer it
    # to a prefill on their CPUs (up to MAX_BANKED_GAPS objectives). A stream that joins has
    # banked nothing: the offer its first step runs under must be its own (80% of 100 ms), not
    # what the others had banked, or a prefill keeps the CPUs through its first gap.
    rng = random.Random(1)
    vocab = lm.config.vocab_size
    objectives = {"tbt_slo_ms": TBT_SLO_MS, "ttft_slo_ms": 120_000.0}
    decode = {"cpu_turns": "on", "tbt_pacing": "mean"}
    with Cluster(lm, prefill={"cpu_turns": "on"}, decode=decode) as c:
        sched = c.decodes[0].scheduler
        steps: list[tuple[int, int, float]] = []  # (fresh streams, older ones, offer) per step
        real_step = sched.runner.step

        def step(batch):
            fresh = sum(len(s.out) == 1 for s in batch)
            steps.append((fresh, len(batch) - fresh, sched.offered_slack_ms))
            return real_step(batch)

        monkeypatch.setattr(sched.runner, "step", step)
        counts = [0, 0]

        def stream(i: int, tokens: int) -> None:
            prompt = [rng.randrange(3, vocab) for _ in range(40)]
            for msg in c.stub.Generate(
                request(token_ids=prompt, max_tokens=tokens, **objectives), timeout=300
            ):
                counts[i] += len(msg.token_ids)

        older = threading.Thread(target=stream, args=(0, 120))
        older.start()
        wait_for(lambda: counts[0] >= 40, 120, "the first stream banking ahead")
        stream(1, 8)  # joins while the first one has banked
        older.join()
    joins = [offer for fresh, old, offer in steps if fresh and old]
    banked = [offer for fresh, old, offer in steps if not fresh and old]
    assert joins, steps
    assert max(banked) > 0.8 * TBT_SLO_MS  # the older stream had banked more than a gap's worth
    assert max(joins) <= 0.8 * TBT_SLO_MS, joins
