"""The cluster serving an MLA model (`tiny-random-mla`, DeepSeek-V2 family): latent blocks
[L, block_size, kv_lora_rank + rope] go through the pools, the store, the inline tail and the
decode worker's absorbed attention, and the answers are the single-process engine's."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from serving_cluster import Cluster

from kvstore import block_keys
from kvstore.client import StoreClient
from model import Engine, SamplingParams, load_model

BS = 16


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random-mla")


@pytest.fixture(scope="module")
def engine(lm):
    return Engine(lm, block_size=BS)


def solo(engine, ids, n):
    return engine.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True))


def rand_ids(rng, n):
    return [rng.randrange(3, 259) for _ in range(n)]


def test_disaggregated_mla_equals_the_engine_and_reuses_latent_blocks(lm, engine):
    rng = random.Random(3)
    prefix = rand_ids(rng, 4 * BS)
    a, b = prefix + rand_ids(rng, 7), prefix + rand_ids(rng, 9)
    with Cluster(lm, prefill={"device_cache": False}) as c:
        ids, _, first = c.generate(token_ids=a, max_tokens=12)
        assert ids == solo(engine, a, 12)
        assert first.usage.cached_tokens == 0
        ids, _, last = c.generate(token_ids=b, max_tokens=12)
        assert ids == solo(engine, b, 12)
        assert last.usage.cached_tokens == 4 * BS and last.usage.computed_prompt_tokens == 9
        # the store holds latent blocks: one row per token, no per-head K/V
        runner = c.decodes[0].runner
        assert runner.layout.name == "mla"
        assert runner.layout.block_shape == (
            lm.config.num_layers,
            BS,
            lm.config.kv_lora_rank + lm.config.qk_rope_head_dim,
        )
        keys = block_keys(prefix, BS, runner.fingerprint)
        staging = torch.empty(4, *runner.layout.block_shape, dtype=runner.layout.dtype)
        with StoreClient(c.store_address) as client:
            assert client.get_into(keys, staging) == 4
        # a second turn finds what the decode worker published
        c.wait_idle()
        turn2 = b + ids + rand_ids(rng, 5)
        got, _, u = c.generate(token_ids=turn2, max_tokens=6)
        assert got == solo(engine, turn2, 6)
        assert u.usage.cached_tokens == (len(b) + len(ids) - 1) // BS * BS


def test_concurrent_mla_streams_equal_the_engine(lm, engine):
    rng = random.Random(4)
    prompts = [rand_ids(rng, rng.randrange(5, 60)) for _ in range(6)]
    want = [solo(engine, p, 10) for p in prompts]
    got: list = [None] * len(prompts)
    with Cluster(lm) as c:

        def run(i):
            got[i] = c.generate(token_ids=prompts[i], max_tokens=10)[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert got == want


def test_kivi_is_refused_for_a_latent_cache(lm):
    from servekit import kv_cache_layout

    class Cfg:
        block_size, kv_cache_dtype = BS, "kivi4"
        kivi_group_size, kivi_residual, kivi_window_dtype = 32, 32, "auto"

    with pytest.raises(ValueError, match="MLA"):
        kv_cache_layout(lm.config, Cfg, torch.float32)
    Cfg.kv_cache_dtype = "fp16"
    assert kv_cache_layout(lm.config, Cfg, torch.float32).dtype == torch.float16


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "int8"])
def test_a_16_bit_or_int8_latent_cache(lm, engine, kv_cache_dtype):
    # fp16: the latent pools and blocks hold 16 bits under fp32 compute. int8: the pools hold
    # the compute dtype and blocks travel and rest as int8 (one fp32 scale per latent row), a
    # quarter of fp32's bytes: the store's records are smaller, the answers stay close.
    rng = random.Random(6)
    prefix = rand_ids(rng, 4 * BS)
    a, b = prefix + rand_ids(rng, 5), prefix + rand_ids(rng, 6)
    with Cluster(
        lm, prefill={"device_cache": False}, cluster={"kv_cache_dtype": kv_cache_dtype}
    ) as c:
        first, _, _ = c.generate(token_ids=a, max_tokens=8)
        assert first[:3] == solo(engine, a, 3)
        again, _, u = c.generate(token_ids=b, max_tokens=8)
        assert u.usage.cached_tokens == 4 * BS and u.usage.computed_prompt_tokens == 6
        runner = c.decodes[0].runner
        keys = block_keys(prefix, BS, runner.fingerprint)
        stored = c.stores[0].store.lookup_sizes(keys)
        raw = runner.layout.block_bytes
        assert len(stored) == 4
        if kv_cache_dtype == "int8":
            assert runner.layout.store_codec == "int8" and runner.layout.dtype == torch.float32
            assert all(size < 0.3 * raw + 4096 for _, size in stored)
        else:
            assert runner.layout.dtype == torch.float16 and runner.pool.kv.dtype == torch.float16
