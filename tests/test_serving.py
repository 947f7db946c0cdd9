"""Disaggregated generation end to end on tiny-random: conductor -> prefill worker -> store ->
decode worker."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import format_status
from kvstore.node import StoreConfig, StoreNode
from model import Engine, SamplingParams, load_model
from prefill_node import PrefillConfig, PrefillWorker
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from tests.serving_cluster import Cluster, request, wait_for

ROOT = Path(__file__).resolve().parents[1]

BS = 16


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def engine(lm):
    return Engine(lm, block_size=BS)


@pytest.fixture(scope="module", params=["auto", "kivi4"])
def kv_cache(request):
    """The tests that take it run with a full-precision KV cache and with KIVI-4: blocks stored
    packed, the residual window sent inline, a packed decode pool. The window (256 tokens) holds
    every prompt here, so answers stay exactly the engine's. (Reusing a packed prefix is lossy:
    test_serving_kivi covers that, packing during decode, and determinism.)"""
    return {} if request.param == "auto" else {"kv_cache_dtype": "kivi4", "kivi_residual": 256}


@pytest.fixture(scope="module")
def cluster(lm, kv_cache):
    with Cluster(lm, conductor={"metrics_port": 0}, cluster=kv_cache) as c:
        yield c


def solo(engine, ids, max_tokens, ignore_eos=True):
    return engine.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))


def rand_ids(rng, n, vocab=259):
    return [rng.randrange(3, vocab) for _ in range(n)]


def _rollup_kib(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup's kB fields by name."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        rows = [line.split() for line in f if line.endswith("kB\n")]
    return {r[0].rstrip(":"): int(r[1]) for r in rows}


def test_a_conductor_in_its_own_process_serves_without_torch(lm, engine):
    # It tokenizes, computes block keys and relays tokens: it never holds a tensor, and torch
    # alone costs a process ~140 MiB of private memory. Its code imports no torch (checked in a
    # fresh interpreter); its process is a fork of deploy.local's forkserver, which imported
    # torch once for all servers: the conductor shares those pages, and its private memory
    # stays under what torch's import alone would cost. Its block keys must still be the
    # workers' (a second turn of the same prompt is routed to its cached prefix).
    fresh = subprocess.run(
        [sys.executable, "-c", "import sys, conductor; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    assert fresh.stdout.strip() == "False", "importing the conductor imported torch"
    with Cluster(lm, processes=("conductor",)) as c:
        (pid,) = [s.pid for s in c.local.servers if s.role == "conductor"]
        ids = list(range(3, 3 + 3 * BS + 5))
        want = solo(engine, ids, 6)
        for _turn in range(2):
            got, _, last = c.generate(token_ids=ids, max_tokens=6, ignore_eos=True)
            assert got == want
            c.wait_idle()
        assert last.usage.cached_tokens == 3 * BS
        mem = _rollup_kib(pid)
        private_mib = (mem["Private_Clean"] + mem["Private_Dirty"]) / 1024
        assert mem["Shared_Dirty"] / 1024 > 32, "the conductor shares no imports with a forkserver"
        assert private_mib < 100, f"the conductor holds {private_mib:.0f} MiB of its own"


def test_cluster_equals_local_engine(cluster, engine, lm):
    prompts = [
        "Hello",
        "The capital of France is",
        "a b c d e f g",
        "Once upon a time, in a land far away, there lived",
        "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17",
        "x" * 40,
        "What is the meaning of life?",
        "zebra",
        "The quick brown fox jumps over the lazy dog. " * 2,
        "KV caches are keyed by prefix hashes",
    ]
    for p in prompts:
        ids, text, last = cluster.generate(text=p, max_tokens=12, ignore_eos=False)
        want = solo(engine, lm.tokenizer.encode(p), 12, ignore_eos=False)
        assert ids == want, p
        assert text == lm.tokenizer.decode(want)
        assert last.finished and last.finish_reason in ("stop", "length")
        assert last.usage.prompt_tokens == len(
            lm.tokenizer.encode(p)
        ) and last.usage.completion_tokens == len(want)
        assert (
            last.usage.ttft_ms > 0
            and last.usage.prefill_worker == "prefill-0"
            and last.usage.decode_worker == "decode-0"
        )
        # the first token goes out after the prefill's answer, once the decode worker admits it
        u = last.usage
        assert 0 < u.queue_ms + u.prefill_ms <= u.prefill_answered_ms <= u.ttft_ms


def test_the_conductor_refreshes_loads_when_work_is_routed_not_on_a_clock(lm):
    # Each refresh wakes a thread in every worker, which stalls a forward's OpenMP barriers on
    # a host whose cores the forward fills: between routing decisions there is nothing to learn
    # but forwards in progress. Idle, every load_idle_poll_s (health); once a request is routed
    # or finishes, at once.
    with Cluster(lm, conductor={"load_poll_s": 0.02, "load_idle_poll_s": 30.0}) as c:
        refreshes = []
        refresh = c.conductor.refresh_loads
        c.conductor.refresh_loads = lambda: (refreshes.append(time.monotonic()), refresh())
        time.sleep(0.5)
        assert refreshes == []  # (every load_poll_s, as before: ~25)
        c.generate(token_ids=[5, 6, 7, 8], max_tokens=2, ignore_eos=True)
        wait_for(lambda: refreshes, 5.0, "a refresh after a request")


def test_a_stream_interval_sends_the_same_tokens_in_groups(lm, engine):
    # decode.stream_interval = 4: the decode worker hands its stream every 4th token (fewer
    # messages, fewer wake-ups beside the steps), each with its own time; the answer is the same
    ids = list(range(3, 3 + BS + 4))
    want = solo(engine, ids, 11)
    with Cluster(lm, decode={"stream_interval": 4}) as c:
        sizes, got, last = [], [], None
        for msg in c.stub.Generate(request(token_ids=ids, max_tokens=11), timeout=120):
            if msg.token_ids:
                sizes.append(len(msg.token_ids))
            got.extend(msg.token_ids)
            last = msg
        assert got == want
        # the prefill's token, then groups of 4 (several, where the reader fell behind), then
        # the rest with the end
        assert sizes[0] == 1 and len(sizes) < 11, sizes
        assert all(n % 4 == 0 for n in sizes[1:-1]), sizes
        assert last.finished and last.usage.completion_tokens == 11
        assert last.usage.tbt_mean_ms > 0  # each token's time came with it


@pytest.mark.parametrize("device_cache", [True, False])
def test_shared_prefix_computes_only_new_tokens(lm, engine, device_cache):
    rng = random.Random(1)
    prefix = rand_ids(rng, 4 * BS)
    a, b = prefix + rand_ids(rng, 7), prefix + rand_ids(rng, 9)
    with Cluster(lm, prefill={"device_cache": device_cache}) as c:
        _, _, first = c.generate(token_ids=a, max_tokens=8)
        assert first.usage.cached_tokens == 0 and first.usage.computed_prompt_tokens == len(a)
        ids, _, last = c.generate(token_ids=b, max_tokens=8)
        u = last.usage
        assert u.cached_tokens == 4 * BS and u.computed_prompt_tokens == 9
        tier = u.cached_device_tokens if device_cache else u.cached_dram_tokens
        assert tier == 4 * BS
        assert ids == solo(engine, b, 8)
        # The policy saw the prefix in the index and predicted less prefill work than for the
        # cold prompt. (Compared without the decode admission part: the first request's
        # prediction had no measured KV pull yet, the second's has.)
        f = first.usage
        assert f.predicted_ttft_ms > 0 and 0 <= u.predicted_admission_ms <= u.predicted_ttft_ms
        assert (
            u.predicted_ttft_ms - u.predicted_admission_ms
            < f.predicted_ttft_ms - f.predicted_admission_ms
        )


def test_second_turn_hits_blocks_the_decode_published(lm, engine):
    rng = random.Random(2)
    turn1 = rand_ids(rng, 3 * BS + 5)
    with Cluster(lm) as c:
        ans, _, _ = c.generate(token_ids=turn1, max_tokens=40)
        c.wait_idle()  # the decode worker publishes after the stream ends
        turn2 = turn1 + ans + rand_ids(rng, 6)
        ids, _, last = c.generate(token_ids=turn2, max_tokens=8)
        u = last.usage
        # Everything the decode worker had KV for (the prompt and all but the last answer token),
        # in full blocks.
        published = (len(turn1) + len(ans) - 1) // BS * BS
        assert published > len(turn1) // BS * BS
        assert u.cached_tokens == published
        assert (
            u.cached_dram_tokens > 0
        )  # the answer's blocks came from the store, not the prefill's pool
        assert u.computed_prompt_tokens == len(turn2) - published
        assert ids == solo(engine, turn2, 8)


def test_concurrent_streams_batch_together(cluster, engine):
    rng = random.Random(3)
    prompts = [rand_ids(rng, rng.randrange(5, 60)) for _ in range(16)]
    results: dict[int, tuple] = {}
    start = threading.Barrier(16)

    def run(i):
        start.wait()
        results[i] = cluster.generate(token_ids=prompts[i], max_tokens=24)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 16
    for i, p in enumerate(prompts):
        assert results[i][0] == solo(engine, p, 24), i
    assert max(r[2].usage.max_decode_batch for r in results.values()) > 1


def test_cancel_mid_stream_frees_decode_blocks(cluster):
    dec = cluster.decodes[0]
    cluster.wait_idle()
    call = cluster.stub.Generate(request(token_ids=list(range(3, 40)), max_tokens=1500), timeout=60)
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= 5:
            break
    assert dec.load().free_blocks < dec.load().total_blocks  # the sequence holds blocks now
    call.cancel()
    cluster.wait_idle(timeout=10)
    assert dec.load().running == 0


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(text=""), "prompt.text"),
        (dict(token_ids=[]), "prompt"),
        (dict(token_ids=[5, 6], max_tokens=0), "max_tokens"),
        (dict(token_ids=[5, 6], max_tokens=-3), "max_tokens"),
        (dict(token_ids=[5, 6], max_tokens=100_000), "max_tokens"),
        (dict(token_ids=[7] * 2048), "context window"),
        (dict(token_ids=[5, 6], model="gpt-17"), "model"),
        (dict(token_ids=[5, 100_000]), "token_ids"),
        (dict(token_ids=[5, -1]), "token_ids"),
        (dict(token_ids=[5, 6], policy="nope"), "policy"),
        (dict(messages=[{"role": "robot", "content": "hi"}]), "role"),
    ],
)
def test_bad_input_is_invalid_argument(cluster, fields, field):
    with pytest.raises(grpc.RpcError) as err:
        cluster.generate(**fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    ids, _, last = cluster.generate(token_ids=[5, 6, 7], max_tokens=2)  # still serving
    assert len(ids) == 2 and last.finished


def test_early_rejection_when_slo_cannot_hold(cluster):
    with pytest.raises(grpc.RpcError) as err:
        cluster.generate(token_ids=list(range(3, 200)), ttft_slo_ms=1e-6)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "TTFT" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        cluster.generate(token_ids=list(range(3, 200)), tbt_slo_ms=1e-6)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    st = cluster.stub.Status(pb.StatusRequest(), timeout=10)
    assert st.requests_rejected >= 2


def test_status_and_metrics_count_requests_by_their_objectives(cluster):
    reg = cluster.conductor.registry

    def counts():
        st = cluster.stub.Status(pb.StatusRequest(), timeout=10)
        slo = [
            reg.get_sample_value("halfmoon_slo_requests_total", {"outcome": o}) or 0.0
            for o in ("met", "missed", "rejected")
        ]
        return st.requests_slo_met, st.requests_slo_missed, slo

    met, missed, slo = counts()
    cluster.generate(token_ids=[4, 5, 6, 7], max_tokens=3, ttft_slo_ms=60_000, tbt_slo_ms=60_000)
    with pytest.raises(grpc.RpcError):
        cluster.generate(token_ids=list(range(3, 200)), ttft_slo_ms=1e-6)  # refused early
    after_met, after_missed, after_slo = counts()
    assert (after_met, after_missed) == (met + 1, missed)
    assert after_slo == [slo[0] + 1, slo[1], slo[2] + 1]
    assert "attainment" in format_status(cluster.stub.Status(pb.StatusRequest(), timeout=10))


def test_cache_off_and_stop_strings_and_chat(cluster, engine, lm):
    ids = list(range(10, 10 + 3 * BS + 3))
    cluster.generate(token_ids=ids, max_tokens=2)
    _, _, last = cluster.generate(token_ids=ids, max_tokens=2, policy="cache_off")
    assert last.usage.cached_tokens == 0 and last.usage.computed_prompt_tokens == len(ids)
    assert last.usage.policy == "cache_off"
    # Stop strings end the answer at (and without) the string.
    full = lm.tokenizer.decode(solo(engine, ids, 30))
    stop = full[10:13]
    _, text, last = cluster.generate(token_ids=ids, max_tokens=30, stop=[stop])
    assert last.finish_reason == "stop" and text == full[: full.find(stop)]
    msgs = [{"role": "user", "content": "hi there"}]
    got, _, _ = cluster.generate(messages=msgs, max_tokens=5)
    assert got == solo(engine, lm.tokenizer.apply_chat_template(msgs), 5)


def test_status_health_and_metrics(cluster):
    cluster.generate(token_ids=[4, 5, 6], max_tokens=2)
    time.sleep(0.15)
    st = cluster.stub.Status(pb.StatusRequest(), timeout=10)
    kinds = sorted((w.kind, w.worker_id, w.healthy) for w in st.workers)
    assert kinds == [("decode", "decode-0", True), ("prefill", "prefill-0", True)]
    pre = next(w for w in st.workers if w.kind == "prefill")
    assert (
        pre.load.block_size == BS and len(pre.load.prefill_coef) == 3 and pre.load.requests_done > 0
    )
    assert st.requests_total > 0 and st.prompt_tokens_total > 0 and st.model == "tiny-random"
    assert st.vocab_size == cluster.lm.config.vocab_size
    assert st.stores and st.stores[0].tiers
    for address in [cluster.address, cluster.prefills[0].address, cluster.decodes[0].address]:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_metrics_endpoint(lm, free_port):
    with Cluster(lm, conductor={"metrics_port": free_port}) as c:
        c.generate(token_ids=[4, 5, 6], max_tokens=3)
        body = (
            urllib.request.urlopen(f"http://{c.conductor.metrics_address}/metrics", timeout=5)
            .read()
            .decode()
        )
        assert "halfmoon_ttft_seconds_count 1.0" in body
        assert 'halfmoon_requests_total{reason="length"} 1.0' in body


def test_prefill_pulls_a_prefix_from_another_host(lm, engine):
    rng = random.Random(4)
    prompt = rand_ids(rng, 5 * BS + 3)
    with Cluster(lm, prefill={"device_cache": False}) as c:
        c.generate(token_ids=prompt, max_tokens=2)  # its 5 full blocks now live in store-0
        # A second "host": its own store node and a prefill worker that uses it.
        store1 = StoreNode(
            StoreConfig(
                node_id="store-1",
                redis_url=c.redis.url,
                dram_bytes=32 << 20,
                model_fingerprint=lm.fingerprint,
                heartbeat_s=0.5,
            )
        )
        addr1 = store1.start()
        w = PrefillWorker(
            PrefillConfig(
                worker_id="prefill-x",
                model=lm.name,
                store_address=addr1,
                store_node="store-1",
                index_url=c.redis.url,
                device_cache=False,
            ),
            lm=lm,
        )
        try:
            with grpc.insecure_channel(w.start()) as ch:
                stub = pb_grpc.PrefillWorkerStub(ch)
                sampling = pb.SamplingParams(max_tokens=1)
                a = prompt + [9, 10]
                reply = stub.Prefill(
                    pb.PrefillRequest(
                        token_ids=a, sampling=sampling, fetch_from="store-0", fetch_blocks=5
                    ),
                    timeout=30,
                )
                assert reply.cached_remote_tokens == 5 * BS and reply.computed_tokens == 5
                assert reply.first_token == solo(engine, a, 1)[0]
                # Its own host's store now holds the prefix too: the next one is a local DRAM hit.
                b = prompt + [11]
                reply = stub.Prefill(pb.PrefillRequest(token_ids=b, sampling=sampling), timeout=30)
                assert reply.cached_dram_tokens == 5 * BS and reply.cached_remote_tokens == 0
                # With no fetch_from the worker fetches nothing remote on its own, although the
                # index knows store-0 holds the prefix: the decision (none here) is what runs.
                other = rand_ids(rng, 3 * BS + 2)
                c.generate(token_ids=other, max_tokens=2)
                reply = stub.Prefill(
                    pb.PrefillRequest(token_ids=other, sampling=sampling), timeout=30
                )
                assert reply.cached_remote_tokens == 0 and reply.computed_tokens == len(other)
                # fetch_blocks is exactly what is pulled from fetch_from, never more.
                reply = stub.Prefill(
                    pb.PrefillRequest(
                        token_ids=other + [3],
                        sampling=sampling,
                        fetch_from="store-0",
                        fetch_blocks=2,
                    ),
                    timeout=30,
                )
                assert reply.cached_remote_tokens == 0 and reply.cached_dram_tokens == 3 * BS
        finally:
            w.stop()
            store1.stop()


def test_blocks_demoted_to_ssd_are_hits(lm, engine, tmp_path):
    rng = random.Random(5)
    prompt = rand_ids(rng, 6 * BS + 1)
    block = lm.config.num_layers * 2 * BS * lm.config.num_kv_heads * lm.config.head_dim * 4
    store = {
        "dram_bytes": 3 * block + 4096,
        "ssd_dir": str(tmp_path / "ssd"),
        "ssd_bytes": 64 << 20,
    }
    # Chunks of 2 blocks: each layer-wise put fits the small DRAM tier, which demotes older blocks
    # to SSD.
    with Cluster(
        lm,
        prefill={"device_cache": False, "chunk_size": 2 * BS},
        decode={"publish": False},
        store=store,
    ) as c:
        c.generate(token_ids=prompt, max_tokens=2)
        ids, _, last = c.generate(token_ids=prompt, max_tokens=4)
        u = last.usage
        assert (
            u.cached_tokens == 6 * BS
            and u.cached_ssd_tokens > 0
            and u.cached_dram_tokens + u.cached_ssd_tokens == 6 * BS
        )
        assert ids == solo(engine, prompt, 4)


def test_full_decode_pool_makes_sequences_wait_not_break(lm, engine):
    rng = random.Random(6)
    prompts = [
        rand_ids(rng, 20) for _ in range(3)
    ]  # 20 + 40 tokens = 4 blocks each; the pool holds 6
    with Cluster(lm, decode={"num_blocks": 6}) as c:
        results: dict[int, tuple] = {}
        threads = [
            threading.Thread(
                target=lambda i=i: results.__setitem__(
                    i, c.generate(token_ids=prompts[i], max_tokens=40)
                )
            )
            for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for i, p in enumerate(prompts):
            assert results[i][0] == solo(engine, p, 40)
            assert (
                results[i][2].usage.max_decode_batch == 1
            )  # never two at once: the pool had room for one
        with pytest.raises(grpc.RpcError) as err:
            c.generate(token_ids=rand_ids(rng, 80), max_tokens=40)  # 8 blocks: can never fit
        assert (
            err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "KV pool" in err.value.details()
        )


def test_decode_worker_lost_mid_stream_resumes_elsewhere(lm, engine, kv_cache):
    rng = random.Random(7)
    prompt = rand_ids(rng, 2 * BS + 3)
    want = solo(engine, prompt, 80)
    with Cluster(lm, cluster=kv_cache, num_decode=2) as c:
        call = c.stub.Generate(request(token_ids=prompt, max_tokens=80), timeout=120)
        got, last = [], None
        for msg in call:
            got.extend(msg.token_ids)
            if len(got) >= 10 and last is None:
                busy = next(d for d in c.decodes if d.load().running)
                busy.stop(grace=0)  # the worker dies with the stream half done
                last = busy
            if msg.finished:
                final = msg
        assert got == want  # no token repeated, none missing
        assert (
            final.finish_reason == "length" and final.usage.decode_worker != last.config.worker_id
        )


def _generate_threads(c, prompts: list[list[int]], max_tokens: int):
    """(results, threads): thread i, once started, puts prompt i's c.generate result in
    results[i]."""
    results: dict[int, tuple] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(
                i, c.generate(token_ids=prompts[i], max_tokens=max_tokens)
            )
        )
        for i in range(len(prompts))
    ]
    return results, threads


def _start_behind_a_stalled_round(w, threads) -> None:
    """With `w`'s pool lock held: start threads[0] and wait until its request is in a round (out
    of the queue, stalled allocating), then threads[1] and wait until it is queued behind. Started
    together, two could arrive before the first round begins and share it."""
    threads[0].start()
    wait_for(
        lambda: w.load().running_tokens > 0 and w.load().queued_requests == 0,
        30,
        "the first request's round",
    )
    threads[1].start()
    wait_for(lambda: w.load().queued_requests == 1, 30, "the second request queued")


def test_waiting_prefills_run_as_one_batched_forward(lm, engine):
    rng = random.Random(8)
    prompts = [rand_ids(rng, n) for n in (9, 70, 33, 16, 51, 24)]  # 1 to 5 chunks of 16 each
    # no gathering: the first request's round starts alone (and stalls), the rest wait
    with Cluster(lm, prefill={"chunk_size": BS, "batch_gather_ms": 0}) as c:
        w = c.prefills[0]
        results, threads = _generate_threads(c, prompts, 8)
        # Holding the pool lock stalls the first request's round, so the other five queue up behind
        # it.
        with w.runner._pool_lock:
            _start_behind_a_stalled_round(w, threads)
            for t in threads[2:]:
                t.start()
            wait_for(lambda: w.load().queued_requests == len(prompts) - 1, 30, "all queued")
        for t in threads:
            t.join(timeout=120)
        for i, p in enumerate(prompts):
            assert results[i][0] == solo(engine, p, 8), i
            assert results[i][2].usage.computed_prompt_tokens == len(p)
        assert (
            w.load().max_batch_seen == len(prompts) - 1
        )  # one forward carried the five that waited
        assert (
            w.load().free_blocks + w.runner.kv.device_blocks() == w.load().total_blocks
        )  # only the device tier holds blocks


def test_a_burst_of_requests_is_gathered_into_one_round(lm, engine):
    rng = random.Random(18)
    prompts = [rand_ids(rng, n) for n in (12, 40, 25, 33)]
    # requests that keep arriving within 200 ms of each other (generous for a loaded machine)
    with Cluster(lm, prefill={"batch_gather_ms": 200}) as c:
        results, threads = _generate_threads(c, prompts, 4)
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert c.prefills[0].load().max_batch_seen == len(prompts)  # one forward for all four
        for i, p in enumerate(prompts):
            assert results[i][0] == solo(engine, p, 4), i


def test_a_lone_request_waits_for_company_only_while_its_round_is_small(lm, engine):
    rng = random.Random(19)
    short, long_ = rand_ids(rng, 10), rand_ids(rng, 40)
    # a 300 ms gather window, and rounds of >= 32 prompt tokens start at once
    with Cluster(lm, prefill={"batch_gather_ms": 300, "batch_gather_tokens": 32}) as c:
        ids, _, last = c.generate(token_ids=short, max_tokens=2)
        assert ids == solo(engine, short, 2)
        assert last.usage.queue_ms >= 250  # small: it waited out the window for company
        ids, _, last = c.generate(token_ids=long_, max_tokens=2)
        assert ids == solo(engine, long_, 2)
        assert last.usage.queue_ms < 150  # past batch_gather_tokens: its round began at once


def test_a_job_the_pool_cannot_hold_fails_alone(lm, engine):
    rng = random.Random(9)
    stall, a, b, huge = (
        rand_ids(rng, n) for n in (10, 60, 70, 200)
    )  # 1, 4, 5 and 13 blocks; the pool holds 8
    with Cluster(lm, prefill={"num_blocks": 8, "batch_gather_ms": 0}) as c:
        w = c.prefills[0]
        results: dict[int, object] = {}

        def run(i, p):
            try:
                results[i] = c.generate(token_ids=p, max_tokens=6)[0]
            except grpc.RpcError as exc:
                results[i] = exc

        threads = [
            threading.Thread(target=run, args=(i, p)) for i, p in enumerate((stall, a, b, huge))
        ]
        # With the pool lock held, the first request's round stalls and the others queue in order
        # behind it: one round then holds a, b (no room beside a: it waits a round) and huge (never
        # fits: fails).
        with w.runner._pool_lock:
            for i, t in enumerate(threads):
                t.start()
                deadline = time.monotonic() + 30
                # the stall's round must have begun (alone) before a arrives, or a joins it
                while time.monotonic() < deadline:
                    load = w.load()  # one snapshot: both counts from the same moment
                    if load.queued_requests >= i and load.running_tokens >= len(stall):
                        break
                    time.sleep(0.01)
                assert (load.queued_requests, load.running_tokens) == (i, len(stall))
        for t in threads:
            t.join(timeout=120)
        for i, p in enumerate((stall, a, b)):
            assert results[i] == solo(engine, p, 6), i
        assert (
            isinstance(results[3], grpc.RpcError)
            and results[3].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert "KV blocks needed" in results[3].details()
        assert (
            w.load().free_blocks + w.runner.kv.device_blocks() == w.load().total_blocks
        )  # nothing leaked


def test_clear_cache_empties_the_device_tier(cluster):
    w = cluster.prefills[0]
    cluster.generate(token_ids=rand_ids(random.Random(10), 4 * BS + 5), max_tokens=2)
    assert w.runner.kv.device_blocks() >= 4
    with grpc.insecure_channel(w.address) as ch:
        reply = pb_grpc.PrefillWorkerStub(ch).ClearCache(pb.ClearCacheRequest(), timeout=10)
    assert reply.device_blocks >= 4 and w.runner.kv.device_blocks() == 0
    assert w.load().free_blocks == w.load().total_blocks


def test_a_prefix_computed_this_round_is_reused_next_round(lm, engine):
    rng = random.Random(11)
    prefix = rand_ids(rng, 4 * BS)
    prompts = [rand_ids(rng, 5), prefix + rand_ids(rng, 7), prefix + rand_ids(rng, 9)]
    with Cluster(lm, prefill={"batch_gather_ms": 0}) as c:
        w = c.prefills[0]
        results, threads = _generate_threads(c, prompts, 4)
        with (
            w.runner._pool_lock
        ):  # the first request's round stalls; the two sharing a prefix queue behind it in order
            _start_behind_a_stalled_round(w, threads)
            # the third only once the second is queued: they stay in order
            threads[2].start()
            wait_for(lambda: w.load().queued_requests == 2, 30, "the third request queued")
        for t in threads:
            t.join(timeout=120)
        for i, p in enumerate(prompts):
            assert results[i][0] == solo(engine, p, 4), i
        # Instead of computing the shared blocks twice in one forward, the second waited a round and
        # reused them.
        assert results[1][2].usage.computed_prompt_tokens == len(prompts[1])
        assert (
            results[2][2].usage.cached_device_tokens == 4 * BS
            and results[2][2].usage.computed_prompt_tokens == 9
        )
