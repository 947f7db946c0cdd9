"""Conditional disaggregation on a running cluster: a short or mostly cached prompt is prefilled on
its decode worker (conductor.local_prefill_tokens), a long one on a prefill worker; either way
the greedy answer is the single process's. A planned block the decode worker cannot load is
computed (counted), never wrong; a handle that is not the prompt's is refused."""

from __future__ import annotations

import grpc
import pytest

from kvstore import block_keys
from model import Engine, SamplingParams, load_model
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from tests.serving_cluster import Cluster

BS = 16
LOCAL = 64  # tokens a decode worker computes itself at most
NEW = 8


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def cluster(lm):
    with Cluster(lm, conductor={"local_prefill_tokens": LOCAL}) as c:
        yield c


def _want(lm, prompt):
    return Engine(lm, block_size=BS).generate(prompt, SamplingParams(max_tokens=NEW))


def _prefilled_here(c: Cluster) -> float:
    d = c.decodes[0]
    return d.registry.get_sample_value(
        "halfmoon_decode_prefilled_tokens_total", {"worker": d.config.worker_id}
    )


def test_short_prompts_prefill_on_the_decode_worker_long_ones_do_not(lm, cluster):
    c = cluster
    short = list(range(3, 43))  # 40 tokens
    before = _prefilled_here(c)
    ids, _, last = c.generate(token_ids=short, max_tokens=NEW)
    assert ids == _want(lm, short)
    assert last.usage.prefill_on_decode
    assert last.usage.prefill_worker == c.decodes[0].config.worker_id
    assert last.usage.computed_prompt_tokens == len(short)
    assert _prefilled_here(c) - before == len(short)
    long = [3 + (i * 7) % 250 for i in range(200)]
    ids, _, last = c.generate(token_ids=long, max_tokens=NEW)
    assert ids == _want(lm, long)
    assert not last.usage.prefill_on_decode
    assert last.usage.prefill_worker == c.prefills[0].config.worker_id
    # the long prompt's blocks are in the host's store now: the same prefix and 20 new tokens
    # leave few to compute, and the decode worker takes it, loading the prefix
    c.wait_idle()
    follow = long + list(range(5, 25))
    ids, _, last = c.generate(token_ids=follow, max_tokens=NEW)
    assert ids == _want(lm, follow)
    assert last.usage.prefill_on_decode
    assert last.usage.cached_tokens >= 12 * BS
    assert last.usage.computed_prompt_tokens == len(follow) - last.usage.cached_tokens


def _decode_stub(c: Cluster):
    channel = grpc.insecure_channel(c.decodes[0].address)
    return channel, pb_grpc.DecodeWorkerStub(channel)


def _prefill_here_request(c: Cluster, prompt, keys) -> pb.DecodeRequest:
    r = pb.DecodeRequest(
        request_id="direct",
        prompt_ids=prompt,
        prefill_here=True,
        sampling=pb.SamplingParams(max_tokens=NEW, ignore_eos=True),
    )
    r.handle.block_keys.extend(keys)
    r.handle.num_tokens = len(prompt)
    return r


def test_a_planned_block_that_is_not_there_is_computed_never_wrong(lm, cluster):
    c = cluster
    prompt = [4 + (i * 11) % 240 for i in range(100)]  # never sent: none of its blocks stored
    keys = block_keys(prompt, BS, c.decodes[0].fingerprint, "")[:4]
    recomputed = c.decodes[0].registry.get_sample_value(
        "halfmoon_decode_recomputed_tokens_total", {"worker": c.decodes[0].config.worker_id}
    )
    channel, stub = _decode_stub(c)
    try:
        msgs = list(stub.Decode(_prefill_here_request(c, prompt, keys), timeout=60))
        assert msgs[0].admitted and msgs[0].HasField("prefilled")
        first = msgs[0].prefilled.first_token
        tokens = [first] + [t for m in msgs[1:] for t in m.token_ids]
        assert tokens == _want(lm, prompt)
        # each token comes with its step's own compute (what the conductor's correction learns
        # from: the gaps also hold the slack given to a prefill on the same CPUs)
        steps = [x for m in msgs[1:] for x in m.step_ms]
        assert len(steps) == NEW - 1 and all(x > 0 for x in steps)
        assert msgs[0].prefilled.cached_dram_tokens == 0
        assert msgs[0].prefilled.computed_tokens == len(prompt)
        after = c.decodes[0].registry.get_sample_value(
            "halfmoon_decode_recomputed_tokens_total", {"worker": c.decodes[0].config.worker_id}
        )
        assert after - recomputed == 4 * BS  # the four planned blocks, counted
        # a handle naming another prompt's keys: refused, naming the field
        other = block_keys(list(range(3, 99)), BS, c.decodes[0].fingerprint, "")[:2]
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(_prefill_here_request(c, prompt, other), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "handle.block_keys" in err.value.details()
    finally:
        channel.close()


def test_local_prefill_tokens_is_checked():
    from conductor import ConductorConfig

    with pytest.raises(ValueError, match="ConductorConfig.local_prefill_tokens"):
        ConductorConfig(local_prefill_tokens=-1)


def test_the_conductor_counts_where_it_placed_each_prefill(cluster):
    c = cluster
    reg = c.conductor.registry
    before = {
        w: reg.get_sample_value("halfmoon_prefill_placement_total", {"where": w}) or 0.0
        for w in ("decode", "prefill")
    }
    c.generate(token_ids=list(range(3, 30)), max_tokens=2)
    c.generate(token_ids=[3 + (i * 13) % 250 for i in range(180)], max_tokens=2)
    after = {
        w: reg.get_sample_value("halfmoon_prefill_placement_total", {"where": w}) or 0.0
        for w in ("decode", "prefill")
    }
    assert after["decode"] - before["decode"] == 1
    assert after["prefill"] - before["prefill"] == 1


def test_an_idle_decode_worker_takes_a_filled_sequence_in_when_its_fill_ends(lm, cluster):
    """Its step loop is woken by the finished fill (a pull or a prefill there), not by its
    poll: with the poll set past the call's deadline, every answer still comes. (A wake-up sent
    from inside the fill found it not yet done, and the loop slept its poll out: ~50 ms on most
    requests' TTFT.)"""
    c = cluster
    sched = c.decodes[0].scheduler
    poll, sched.busy_poll_s = sched.busy_poll_s, 600.0
    try:
        placed = []
        for n in (20, 180, 24, 190, 16):  # short ones mostly on the decode worker, long ones not
            c.wait_idle()
            prompt = [3 + (i * 11 + n) % 250 for i in range(n)]
            ids, _, last = c.generate(timeout=20.0, token_ids=prompt, max_tokens=2)
            assert ids == _want(lm, prompt)[:2]
            placed.append(last.usage.prefill_on_decode)
    finally:
        sched.busy_poll_s = poll
    assert True in placed and False in placed, placed  # both kinds of fill were waited on
