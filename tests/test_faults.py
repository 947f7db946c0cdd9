"""Bad days on a cluster on 127.0.0.1: workers and store nodes killed (SIGKILL of real
processes), a store node that hangs (SIGSTOP), Redis hung, killed and restarted under traffic,
blocks corrupted in DRAM and on SSD. Each time the answers are Engine's (greedy: no token
repeated, missing or wrong), the fault is worked around (recomputation, another worker) and
counted."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time

import grpc
import psutil
import pytest
from serving_cluster import Cluster, request, wait_for

from kvstore import Index, block_keys
from kvstore.client import parse_header
from model import Engine, SamplingParams, load_model
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc

BS = 16


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def engine(lm):
    return Engine(lm, block_size=BS)


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 259) for _ in range(n)]


def greedy(engine, ids, n):
    return engine.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True))


def metric(registry, name: str, **labels) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    return sum(
        sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def server(c: Cluster, name: str):
    """The ServerInfo (address, pid) of one of the cluster's servers."""
    return next(s for s in c.local.servers if s.name == name)


def slab_of(c: Cluster, node_id: str) -> str:
    """The shared-memory file of a store node (a killed node leaves it: the test removes it)."""
    index = Index(c.redis.url)
    try:
        return index.nodes()[node_id].shm_path
    finally:
        index.close()


def unhealthy(c: Cluster, worker_id: str) -> bool:
    status = c.stub.Status(pb.StatusRequest(), timeout=5)
    return any(w.worker_id == worker_id and not w.healthy for w in status.workers)


class Reader:
    """One Generate stream, read as far as a test wants."""

    def __init__(self, c: Cluster, prompt: list[int], max_tokens: int):
        self.call = c.stub.Generate(request(token_ids=prompt, max_tokens=max_tokens), timeout=120)
        self._it = iter(self.call)
        self.ids: list[int] = []
        self.final: pb.GenerateResponse | None = None

    def _take(self, msg) -> None:
        self.ids.extend(msg.token_ids)
        if msg.finished:
            self.final = msg

    def read(self, n: int) -> None:
        while len(self.ids) < n and self.final is None:
            self._take(next(self._it))

    def read_all(self) -> None:
        for msg in self._it:
            self._take(msg)


def test_killed_workers_are_routed_around(lm, engine):
    """A prefill worker killed with a request in hand: the request is retried on the other one.
    A decode worker killed mid-stream: the stream goes on on the other one, token for token; when
    the last decode worker goes too, the stream ends with a clear UNAVAILABLE."""
    rng = random.Random(31)
    with Cluster(lm, num_prefill=2, num_decode=2, processes=("prefill-0", "decode-0")) as c:
        errors = lambda what: metric(  # noqa: E731
            c.conductor.registry, "halfmoon_conductor_errors_total", what=what
        )
        # prefill-0 frozen, then killed, with the request sent to it: both workers idle, the
        # tie goes to prefill-0 under load_balance, and the conductor has not yet noticed the
        # freeze (its load poll waits load_timeout_s).
        prompt = rand_ids(rng, 2 * BS + 5)
        victim = server(c, "prefill-0").pid
        # its OpenMP threads spin as the cluster config says, not libgomp's ms (set for it here)
        spin = os.environ.get("GOMP_SPINCOUNT")  # the config's, unless one was set before
        assert spin and psutil.Process(victim).environ().get("GOMP_SPINCOUNT") == spin
        result = {}

        def generate() -> None:
            try:
                result["ok"] = c.generate(token_ids=prompt, max_tokens=6, policy="load_balance")
            except grpc.RpcError as exc:
                result["error"] = exc

        os.kill(victim, signal.SIGSTOP)
        try:
            t = threading.Thread(target=generate)
            t.start()
            time.sleep(0.3)  # routed there, and stuck
            assert "ok" not in result and "error" not in result
        finally:
            os.kill(victim, signal.SIGKILL)
        t.join(timeout=60)
        assert "error" not in result, result.get("error")
        ids, _, last = result["ok"]
        assert ids == greedy(engine, prompt, 6)
        assert last.usage.prefill_worker == "prefill-1" and errors("prefill_lost") == 1

        # decode-0 (a process) killed mid-stream. Streams are opened until one runs on decode-0:
        # usually the first or the second (which goes to the worker the first left idle), but
        # two clean-clone CI runs put both on decode-1 (the conductor's view of a worker it has
        # just routed to can lag its reports), so up to four.
        n = 200
        prompts = [rand_ids(rng, 2 * BS + 3), rand_ids(rng, BS + 7), rand_ids(rng, BS + 2)]
        prompts.append(rand_ids(rng, 2 * BS + 1))
        local = c.decodes[0]  # decode-1, in this process

        def local_admitted() -> int:
            """Streams decode-1 has taken: running ones and finished ones (a stream of its own
            may finish while the next is being opened: its running count alone drops)."""
            load = local.load()
            return load.running + load.requests_done

        streams, on_decode_0 = [], False
        for p in prompts:
            before = local_admitted()
            s = Reader(c, p, n)
            s.read(3)  # admitted: decoding on its worker
            streams.append((s, p))
            if local_admitted() <= before:  # (< while a stream of decode-1's is being ended)
                on_decode_0 = True
                break
        assert on_decode_0
        victim_stream, victim_prompt = streams[-1]
        # SLOs no pair can meet from now on: a new request is refused early, but a stream that
        # has had its first token is resumed all the same (its TTFT is history)
        slos = c.conductor.config
        c.conductor.config = dataclasses.replace(slos, ttft_slo_ms=0.001, tbt_slo_ms=0.001)
        with pytest.raises(grpc.RpcError) as err:
            c.generate(token_ids=rand_ids(rng, BS), max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        os.kill(server(c, "decode-0").pid, signal.SIGKILL)
        victim_stream.read_all()
        c.conductor.config = slos
        assert victim_stream.ids == greedy(engine, victim_prompt, n)  # none repeated or missing
        final = victim_stream.final
        assert final.finish_reason == "length" and final.usage.decode_worker == "decode-1"
        assert errors("decode_lost") == 1
        for s, _ in streams[:-1]:
            s.call.cancel()

        # the last decode worker goes mid-stream: nowhere to resume, a clear UNAVAILABLE
        last_stream = Reader(c, rand_ids(rng, BS + 1), 4 * n)
        last_stream.read(3)
        local.stop(grace=0)
        with pytest.raises(grpc.RpcError) as err:
            last_stream.read_all()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no pair left to resume on" in err.value.details()


def test_killed_store_node_leaves_the_index_and_requests_recompute(lm, engine):
    """store-0 (a process) SIGKILLed: its heartbeat lapses, so it leaves the index (store-1
    sweeps its entries); the workers beside it keep serving, recomputing what it held."""
    rng = random.Random(41)
    prompt = rand_ids(rng, 4 * BS + 3)
    with Cluster(
        lm,
        num_prefill=2,
        hosts=2,
        processes=("store-0",),
        store={"dram_bytes": 16 << 20},
        prefill={"device_cache": False},
        decode={"publish": False},
    ) as c:
        # load_balance's tie goes to prefill-0, beside store-0: the prompt's blocks go there
        ids, _, last = c.generate(token_ids=prompt, max_tokens=4, policy="load_balance")
        assert last.usage.prefill_worker == "prefill-0" and ids == greedy(engine, prompt, 4)
        keys = block_keys(prompt, BS, c.prefills[0].fingerprint)
        index = Index(c.redis.url)
        slab = slab_of(c, "store-0")
        try:
            held = lambda: index.longest_prefix(keys).get("store-0")  # noqa: E731
            wait_for(lambda: held() is not None and held().num_blocks == 4, 5, "store-0 listed")
            os.kill(server(c, "store-0").pid, signal.SIGKILL)
            # gone once its registration lapses (3 heartbeats of 0.5 s) and store-1 sweeps it
            wait_for(
                lambda: "store-0" not in index.nodes() and not index.holders(keys[0]),
                10,
                "store-0's blocks leave the index",
            )
            assert "store-0" not in index.longest_prefix(keys)
        finally:
            index.close()
        # prefill-0 and the decode worker have lost their host's store: they recompute
        longer = prompt + rand_ids(rng, 5)
        ids, _, last = c.generate(token_ids=longer, max_tokens=4, policy="load_balance")
        assert ids == greedy(engine, longer, 4)
        u = last.usage
        assert u.prefill_worker == "prefill-0" and u.computed_prompt_tokens == len(longer)
        # and under the cache-aware policy, with no stale entry to send anyone to store-0
        ids, _, last = c.generate(token_ids=prompt + [7], max_tokens=4)
        assert ids == greedy(engine, prompt + [7], 4)
        assert last.usage.cached_remote_tokens == 0
    os.unlink(slab)


def test_stalled_store_node_times_out_and_recomputes(lm, engine):
    """store-0 (a process) hangs (SIGSTOP) while the index still lists it: a prefill worker told
    to fetch a prefix from it gives up after its configured kv_timeout_s and computes the
    prefix instead; nothing hangs. (The prefill worker is asked directly, naming the fetch, so
    no routing estimate decides whether it fetches.)"""
    rng = random.Random(51)
    prefix = rand_ids(rng, 8 * BS)
    timeout_s = 1.0
    with Cluster(
        lm,
        num_prefill=2,
        hosts=2,
        processes=("store-0",),
        # a long heartbeat: the hung node stays listed while the test runs
        store={"dram_bytes": 16 << 20, "heartbeat_s": 5.0},
        prefill={"device_cache": False, "kv_timeout_s": timeout_s},
        decode={"publish": False},
    ) as c:
        _, _, last = c.generate(token_ids=prefix + [5], max_tokens=2, policy="load_balance")
        assert last.usage.prefill_worker == "prefill-0"  # its blocks are on store-0
        worker = c.prefills[1]  # prefill-1, beside store-1
        channel = grpc.insecure_channel(worker.address)
        stub = pb_grpc.PrefillWorkerStub(channel)

        def prefill(prompt: list[int], blocks: int) -> pb.PrefillReply:
            req = pb.PrefillRequest(
                token_ids=prompt,
                sampling=pb.SamplingParams(max_tokens=1),
                fetch_from="store-0",
                fetch_blocks=blocks,
            )
            reply = stub.Prefill(req, timeout=60)
            assert reply.first_token == greedy(engine, prompt, 1)[0]
            return reply

        # the path works: 4 blocks fetched from store-0 (store-1 holds them too now)
        assert prefill(prefix[: 4 * BS] + [9], 4).cached_remote_tokens == 4 * BS
        store0, slab = server(c, "store-0").pid, slab_of(c, "store-0")
        os.kill(store0, signal.SIGSTOP)
        try:
            prompt = prefix + rand_ids(rng, 6)
            t0 = time.monotonic()
            reply = prefill(prompt, 8)
            took = time.monotonic() - t0
        finally:
            os.kill(store0, signal.SIGKILL)
            channel.close()
        # its own 4 blocks loaded, the 4 it was to fetch computed
        assert reply.cached_remote_tokens == 0 and reply.cached_dram_tokens == 4 * BS
        assert reply.computed_tokens == len(prompt) - 4 * BS
        # it waited for the timeout (the node was stalled, not refusing), and not much longer
        assert timeout_s <= took < timeout_s + 10
        timeouts = metric(
            worker.registry,
            "halfmoon_kv_errors_total",
            worker="prefill-1",
            op="load_remote",
            kind="timeout",
        )
        assert timeouts == 1
    os.unlink(slab)


def test_redis_stopped_and_restarted_under_traffic_index_rebuilt_from_the_stores(lm, engine):
    """Redis hung (SIGSTOP), then dead, while requests flow: none fails or waits on it, routing
    goes on blind (no remote hits); Redis back, empty: the store nodes publish their whole
    listings again, blocks stored during the outage included, and remote hits return."""
    rng = random.Random(61)
    p, q, r = (rand_ids(rng, 6 * BS) for _ in range(3))
    with Cluster(
        lm,
        num_prefill=2,
        hosts=2,
        prefill={"device_cache": False},
        # an unmeasured link looks fast: a prefix held on the other host is fetched when seen
        conductor={"transfer_mb_per_ms": 1000.0, "index_retry_s": 0.2},
    ) as c:
        traffic = Traffic(c, engine, random.Random(62))
        redis, store0 = c.redis, c.stores[0]
        index = Index(redis.url)
        try:
            traffic.start()
            traffic.wait_done(3)
            # hung first: connections open, nothing answers (every index call times out)
            os.kill(redis.proc.pid, signal.SIGSTOP)
            outage_start = traffic.done
            # p, q, r computed on host 0 while the index is down (asked of prefill-0 directly)
            with grpc.insecure_channel(c.prefills[0].address) as channel:
                stub = pb_grpc.PrefillWorkerStub(channel)
                for prefix in (p, q, r):
                    req = pb.PrefillRequest(
                        token_ids=prefix + [5], sampling=pb.SamplingParams(max_tokens=1)
                    )
                    assert stub.Prefill(req, timeout=60).computed_tokens == len(prefix) + 1
            # told to fetch r from store-0, prefill-1 cannot find that node in the index: a miss,
            # counted, and r is computed (not an error)
            with grpc.insecure_channel(c.prefills[1].address) as channel:
                req = pb.PrefillRequest(
                    token_ids=r + [8],
                    sampling=pb.SamplingParams(max_tokens=1),
                    fetch_from="store-0",
                    fetch_blocks=6,
                )
                reply = pb_grpc.PrefillWorkerStub(channel).Prefill(req, timeout=60)
            assert reply.cached_remote_tokens == 0 and reply.computed_tokens == len(r) + 1
            assert reply.first_token == greedy(engine, r + [8], 1)[0]
            unresolved = metric(
                c.prefills[1].registry, "halfmoon_kv_errors_total", op="resolve_node"
            )
            assert unresolved == 1
            c.prefills[0].stop()  # from now on prefill-1, on host 1, serves everything
            wait_for(lambda: unhealthy(c, "prefill-0"), 10, "prefill-0 out of routing")
            # blind: store-0 holds q, but no one can tell the conductor
            ids, _, last = c.generate(token_ids=q + [6], max_tokens=3)
            assert ids == greedy(engine, q + [6], 3)
            assert last.usage.cached_remote_tokens == 0
            assert last.usage.computed_prompt_tokens == len(q) + 1
            traffic.wait_done(traffic.done + 3)  # more requests served during the outage
            assert traffic.done - outage_start >= 3
            redis.restart()  # killed (stopped as it is), then a new, empty one on its port
            keys = block_keys(p, BS, c.prefills[1].fingerprint)
            held = lambda: index.longest_prefix(keys).get("store-0")  # noqa: E731
            wait_for(lambda: held() is not None and held().num_blocks == 6, 10, "p re-listed")
            time.sleep(0.3)  # past the conductor's index back-off
            ids, _, last = c.generate(token_ids=p + [7], max_tokens=3)
            assert ids == greedy(engine, p + [7], 3)
            assert last.usage.cached_remote_tokens == 6 * BS  # hits are back
        finally:
            traffic.stop()
            index.close()
        assert traffic.failures == [] and traffic.done >= 6
        # and none waited on the hung Redis: no index call on the data path, lookups with a
        # short timeout (an index client with 5 s timeouts stalled every store RPC that long)
        assert traffic.slowest < 3.0
        registry = store0.metrics.registry
        assert metric(registry, "halfmoon_store_index_republished_total") >= 2
        assert metric(registry, "halfmoon_store_index_errors_total") >= 1
        conductor_errors = metric(
            c.conductor.registry, "halfmoon_conductor_errors_total", what="index_lookup"
        )
        assert conductor_errors >= 1


class Traffic:
    """Requests on fresh random prompts, one after another from a thread, each checked against
    Engine's answer: `done` counts the good ones, `failures` the rest."""

    def __init__(self, c: Cluster, engine, rng: random.Random):
        self.c, self.engine, self.rng = c, engine, rng
        self.done = 0
        self.slowest = 0.0  # seconds, of the requests served so far
        self.failures: list[str] = []
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._quit.set()
        self._thread.join(timeout=60)

    def wait_done(self, n: int, timeout_s: float = 30) -> None:
        wait_for(lambda: self.done >= n or self.failures, timeout_s, f"{n} requests served")

    def _run(self) -> None:
        while not self._quit.is_set():
            prompt = rand_ids(self.rng, self.rng.randrange(BS, 3 * BS))
            t0 = time.monotonic()
            try:
                ids, _, _ = self.c.generate(token_ids=prompt, max_tokens=3, timeout=60)
            except grpc.RpcError as exc:
                self.failures.append(f"{exc.code()}: {exc.details()}")
                continue
            self.slowest = max(self.slowest, time.monotonic() - t0)
            if ids != greedy(self.engine, prompt, 3):
                self.failures.append(f"wrong answer for {prompt}")
            else:
                self.done += 1


def test_corrupt_blocks_in_dram_and_on_ssd_are_recomputed(lm, engine, tmp_path):
    """A block corrupted in the DRAM slab, then one corrupted on SSD, under a served prompt: the
    checksums catch each, the store drops and counts it, the prompt is computed from there, the
    answer is unchanged, and the recomputed block takes the corrupt one's place."""
    cfg = lm.config
    block = cfg.num_layers * 2 * BS * cfg.num_kv_heads * cfg.head_dim * 4
    store = {  # DRAM holds 3 blocks: the rest of the prompt is demoted to SSD
        "dram_bytes": 3 * block + 4096,
        "ssd_dir": str(tmp_path / "ssd"),
        "ssd_bytes": 64 << 20,
    }
    rng = random.Random(71)
    prompt = rand_ids(rng, 6 * BS + 1)
    with Cluster(
        lm,
        prefill={"device_cache": False, "chunk_size": 2 * BS},
        decode={"publish": False},
        store=store,
    ) as c:
        node, blocks = c.store, c.store.store
        keys = block_keys(prompt, BS, c.prefills[0].fingerprint)
        corrupt = lambda tier: metric(  # noqa: E731
            node.metrics.registry, "halfmoon_store_corrupt_blocks_total", node="store-0", tier=tier
        )

        def serve(tail: int) -> pb.Usage:
            ids, _, last = c.generate(token_ids=prompt + [tail], max_tokens=3)
            assert ids == greedy(engine, prompt + [tail], 3)
            return last.usage

        serve(3)
        tiers = blocks.lookup(keys)
        assert tiers[:2] == ["dram", "dram"] and len(tiers) == 6
        # DRAM: one byte of layer 1 of block 1, in the shared slab
        lease, (ref,) = blocks.acquire(keys[1:2], ttl=5)
        blocks.release(lease)
        header = parse_header(node.slab.view[ref.offset : ref.offset + ref.length])
        node.slab.view[ref.offset + header.layer_offset(1) + 3] ^= 0xFF
        u = serve(4)
        assert u.cached_tokens == BS and u.computed_prompt_tokens == len(prompt) + 1 - BS
        assert corrupt("dram") == 1
        assert serve(5).cached_tokens == 6 * BS  # the recomputed block replaced it
        # SSD: the last byte of the first block there
        tiers = blocks.lookup(keys)
        k = tiers.index("ssd")
        data = bytearray(node.ssd.get(keys[k]))
        data[-1] ^= 1
        node.ssd.put(keys[k], bytes(data), keys[k - 1] if k else None)
        u = serve(6)
        assert u.cached_tokens == k * BS and u.computed_prompt_tokens == len(prompt) + 1 - k * BS
        assert corrupt("ssd") == 1
        assert serve(7).cached_tokens == 6 * BS
