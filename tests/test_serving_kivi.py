"""The cluster with a KIVI KV cache (kv_cache_dtype kivi4/kivi2): prefill stores packed blocks
and sends the residual window inline, decode keeps packed blocks and a full-precision window."""

from __future__ import annotations

import random

import pytest
import torch
from serving_cluster import Cluster

from kvstore import block_keys
from kvstore.client import StoreClient
from model import Engine, SamplingParams, kv_fingerprint, load_model

BS = 16


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


def kivi(bits: int, residual: int) -> dict:
    return {"kv_cache_dtype": f"kivi{bits}", "kivi_residual": residual}


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 259) for _ in range(n)]


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    return engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))


def test_a_window_that_holds_everything_is_exact(lm):
    # Nothing ever leaves a 256-token window: every token attended to is full precision, so the
    # answer equals the single-process engine's, although the blocks are stored packed.
    rng = random.Random(1)
    prompt = rand_ids(rng, 5 * BS + 7)
    settings = kivi(4, 256)
    with Cluster(lm, cluster=settings) as c:
        ids, _, last = c.generate(token_ids=prompt, max_tokens=20)
        assert ids == greedy(Engine(lm), prompt, 20)
        load = c.decodes[0].load()
        assert load.kv_cache_dtype == "kivi4" and load.model_fingerprint == c.conductor.fingerprint


@pytest.mark.parametrize("bits", [4, 2])
def test_packed_blocks_and_a_small_window_serve_and_reuse(lm, bits):
    rng = random.Random(2)
    prefix = rand_ids(rng, 6 * BS)
    a, b = prefix + rand_ids(rng, 5), prefix + rand_ids(rng, 9)
    settings = kivi(bits, 16)
    engine = Engine(lm)
    with Cluster(lm, cluster=settings) as c:
        # the decode worker timed scratch steps over packed blocks + windows before serving
        assert c.decodes[0].scheduler.calibration_failures == 0
        first, _, u1 = c.generate(token_ids=a, max_tokens=40)
        assert len(first) == 40 and u1.usage.cached_tokens == 0
        c.wait_idle()
        again, _, u2 = c.generate(token_ids=a, max_tokens=40)
        # The same packed blocks and the same window: the same tokens, now from the cache.
        assert again == first and u2.usage.cached_tokens == 6 * BS
        ids, _, u3 = c.generate(token_ids=b, max_tokens=12)
        assert u3.usage.cached_tokens == 6 * BS and len(ids) == 12
        # The store holds the prefix packed: blocks of the KIVI layout, a fraction of fp32's.
        runner = c.decodes[0].runner
        keys = block_keys(prefix, BS, runner.fingerprint)
        staging = torch.empty(6, *runner.layout.block_shape, dtype=torch.uint8)
        with StoreClient(c.store_address) as client:
            assert client.get_into(keys, staging) == 6
        fp32_block = lm.config.kv_layout(BS, torch.float32).block_bytes
        assert runner.layout.block_bytes < (0.2 if bits == 4 else 0.15) * fp32_block
        # and the decode worker loaded it all: no prompt token was recomputed
        recomputed = c.decodes[0].registry.get_sample_value(
            "halfmoon_decode_recomputed_tokens_total", {"worker": "decode-0"}
        )
        assert recomputed == 0
        if bits == 4:  # lossy, but close: the first tokens agree with full precision
            assert first[:4] == greedy(engine, a, 4)


def test_the_same_bytes_hold_more_tokens_packed(lm):
    budget = 64 * 2 * 16 * BS * 4 * lm.config.num_layers  # 64 fp32 blocks of tiny-random
    loads = {}
    for dtype in ("auto", "kivi4", "kivi2"):
        settings = {"kv_cache_dtype": dtype, "kivi_residual": 16}
        decode = {"kv_cache_bytes": budget, "max_batch": 4}
        with Cluster(lm, cluster=settings, decode=decode) as c:
            loads[dtype] = c.decodes[0].load()
            assert c.decodes[0].runner.pool.bytes() <= budget
    full = loads["auto"].capacity_tokens
    assert loads["kivi4"].capacity_tokens > 3 * full
    assert loads["kivi2"].capacity_tokens > loads["kivi4"].capacity_tokens


def test_admission_reserves_only_the_blocks_that_are_ever_packed(lm):
    # A sequence's last `residual` tokens stay in its window (reserved apart), so of 101 + 40
    # tokens at most (141 - 16) // 16 = 7 blocks are ever packed: a packed pool of exactly 7
    # blocks serves it (a full-precision reservation would ask for 9 and be refused), and the
    # answer equals a roomy pool's.
    rng = random.Random(5)
    prompt = rand_ids(rng, 6 * BS + 5)
    settings = kivi(4, 16)
    answers = []
    for decode in ({"num_blocks": 7, "max_batch": 1}, {"num_blocks": 64, "max_batch": 1}):
        with Cluster(lm, cluster=settings, decode=decode) as c:
            assert c.decodes[0].runner.blocks_to_reserve(len(prompt) + 40) == 7
            ids, _, _ = c.generate(token_ids=prompt, max_tokens=40)
            answers.append(ids)
    assert len(answers[0]) == 40 and answers[0] == answers[1]


def test_a_store_that_cannot_hold_the_blocks_means_recompute_not_wrong_tokens(lm):
    rng = random.Random(3)
    prompt = rand_ids(rng, 7 * BS + 3)
    settings = kivi(4, 32)
    with Cluster(lm, cluster=settings) as c:
        want, _, _ = c.generate(token_ids=prompt, max_tokens=30)
    # A store too small for one block: nothing is stored, the decode worker recomputes the
    # prompt (full precision, then packed as KIVI would) and answers the same tokens.
    with Cluster(lm, cluster=settings, store={"dram_bytes": 4096}) as c:
        got, _, _ = c.generate(token_ids=prompt, max_tokens=30)
        recomputed = c.decodes[0].registry.get_sample_value(
            "halfmoon_decode_recomputed_tokens_total", {"worker": "decode-0"}
        )
    assert recomputed == len(prompt) and got == want


@pytest.mark.parametrize(
    "settings", [{"kv_cache_dtype": "fp16"}, {**kivi(4, 16), "kivi_window_dtype": "bf16"}]
)
def test_16_bit_blocks_and_windows_under_fp32_compute(lm, settings):
    # kv_cache_dtype fp16: full precision kept in 16 bits (the fair baseline for KIVI on a CPU
    # whose fast dtype is fp32); kivi_window_dtype bf16: KIVI's window in 16 bits. Pools, store
    # blocks and the fused CPU attention all run in that dtype, and reuse still recomputes nothing.
    rng = random.Random(5)
    prompt = rand_ids(rng, 4 * BS + 3)
    with Cluster(lm, cluster=settings) as c:
        first, _, u1 = c.generate(token_ids=prompt, max_tokens=24)
        c.wait_idle()
        again, _, u2 = c.generate(token_ids=prompt, max_tokens=24)
        assert again == first and u2.usage.cached_tokens == 4 * BS
        runner = c.decodes[0].runner
        pool = runner.pool if settings["kv_cache_dtype"] == "fp16" else runner.pool.window
        assert pool.dtype == (
            torch.float16 if settings["kv_cache_dtype"] == "fp16" else torch.bfloat16
        )
        fp32 = lm.config.kv_layout(BS, torch.float32)
        if settings["kv_cache_dtype"] == "fp16":
            assert runner.layout.block_bytes * 2 == fp32.block_bytes
            # fp16 blocks never share keys with fp32 ones
            assert runner.fingerprint == c.conductor.fingerprint
            assert runner.fingerprint != kv_fingerprint(lm.weights_id, fp32)
        # close to fp32 KV: the first tokens agree with the single-process engine (the tiny
        # random model's near-ties turn 4-bit + bf16 away from it at the third token)
        n = 4 if settings["kv_cache_dtype"] == "fp16" else 2
        assert first[:n] == greedy(Engine(lm), prompt, n)
        assert (
            c.decodes[0].registry.get_sample_value(
                "halfmoon_decode_fused_attention", {"worker": "decode-0"}
            )
            == 1
        )
