"""The policy's decision is what runs: a prefill worker fetches a remote prefix exactly when the
conductor's policy says so (two "hosts": a store node each, a prefill worker on each)."""

from __future__ import annotations

import random
import time

import grpc
import pytest
from serving_cluster import Cluster

from kvstore import block_keys
from model import Engine, load_model
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc

BS = 16


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 259) for _ in range(n)]


def store_hits(store) -> int:
    """Blocks a store node has served (a remote fetch from it counts here)."""
    return sum(t.hits for t in store.store.stats().tiers)


def wait_unhealthy(c: Cluster, worker_id: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = c.stub.Status(pb.StatusRequest(), timeout=5)
        if any(w.worker_id == worker_id and not w.healthy for w in status.workers):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{worker_id} still routed to")


def test_remote_fetch_only_when_the_policy_decides(lm):
    rng = random.Random(11)
    # Prefixes long enough that fetching beats computing on this machine's loopback: the policy
    # fetches only what the link (as the worker's fetches measure it) moves faster than it
    # computes, and tiny-random computes a few blocks about as fast as they cross.
    p, q, r = rand_ids(rng, 64 * BS), rand_ids(rng, 96 * BS), rand_ids(rng, 48 * BS)
    engine = Engine(lm)
    with Cluster(
        lm,
        num_prefill=2,
        hosts=2,
        prefill={"device_cache": False},
        conductor={"kvcache_balancing_threshold": 1.5},
    ) as c:
        # Three prefixes computed on host 0 (asked of prefill-0 directly, so no routing tie
        # decides where), then host 0's worker goes.
        with grpc.insecure_channel(c.prefills[0].address) as channel:
            stub = pb_grpc.PrefillWorkerStub(channel)
            for prefix in (p, q, r):
                req = pb.PrefillRequest(
                    token_ids=prefix + rand_ids(rng, 5), sampling=pb.SamplingParams(max_tokens=1)
                )
                assert stub.Prefill(req, timeout=60).computed_tokens == len(prefix) + 5
        q_keys = block_keys(q, BS, c.prefills[0].fingerprint)
        assert store_hits(c.stores[0]) == 0 and len(c.stores[0].store.lookup(q_keys)) == 96
        c.prefills[0].stop()
        wait_unhealthy(c, "prefill-0")
        store0 = c.stores[0]

        def run(prompt, **extra):
            before = store_hits(store0)
            ids, _, last = c.generate(token_ids=prompt, max_tokens=3, **extra)
            assert last.usage.prefill_worker == "prefill-1"
            assert ids == engine.generate(prompt, _greedy(3))  # whatever was fetched, same tokens
            return last.usage, store_hits(store0) - before

        # Host 1 holds nothing: any prefix on host 0 is worth fetching (own 0).
        u, served = run(p[: 48 * BS] + rand_ids(rng, 7))
        assert u.cached_remote_tokens == 48 * BS and served == 48
        # Host 1 now holds 48 blocks of p, host 0 all 64: 64 <= 1.5 x 48, below the threshold:
        # no transfer at all; the 48 local blocks are reused and the rest is computed.
        u, served = run(p + rand_ids(rng, 9))
        assert u.cached_remote_tokens == 0 and served == 0
        assert u.cached_dram_tokens == 48 * BS and u.computed_prompt_tokens == 16 * BS + 9
        # q: 32 blocks on host 1 (fetched or computed there), 96 on host 0: 96 > 1.5 x 32, above
        # it: the other 64 are fetched.
        run(q[: 32 * BS] + rand_ids(rng, 3))
        u, served = run(q + rand_ids(rng, 2))
        assert u.cached_dram_tokens == 32 * BS and u.cached_remote_tokens == 64 * BS
        assert served == 64
        # load_balance never fetches remotely, however long the prefix held elsewhere.
        u, served = run(r + rand_ids(rng, 4), policy="load_balance")
        assert u.cached_remote_tokens == 0 and served == 0
        assert u.computed_prompt_tokens == 48 * BS + 4


def _greedy(n: int):
    from model import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True)
