"""The cluster on CUDA: model, pool and kernels on the GPU (the decode step runs the Triton
paged-attention kernel, replayed from CUDA graphs), checked against the single-process Engine.
Skips without CUDA."""

from __future__ import annotations

import random

import pytest
import torch
from serving_cluster import Cluster

from model import Engine, SamplingParams, load_model
from model.cuda_graphs import batch_sizes_upto

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BS = 16


@pytest.mark.parametrize("kv_cache", ["auto", "kivi4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cluster_on_cuda_matches_engine(dtype, kv_cache):
    # kivi4 with a window that holds every prompt here: blocks stored packed, the decode pool
    # packed, the Triton window-merging attention; the answers stay exactly the engine's.
    lm = load_model("tiny-random", dtype=dtype, device="cuda")
    engine = Engine(lm)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 259) for _ in range(5 * BS)]
    prompts = [prefix + [rng.randrange(3, 259) for _ in range(n)] for n in (3, 11, 17)]
    workers = {"device": "cuda", "dtype": dtype}
    cluster = {"kv_cache_dtype": kv_cache, "kivi_residual": 256}
    with Cluster(lm, prefill=workers, decode=workers, cluster=cluster) as c:
        for w in (c.prefills[0], c.decodes[0]):
            assert w.load().device == "cuda:0" and w.runner.device.type == "cuda"
        for i, p in enumerate(prompts):
            ids, _, last = c.generate(token_ids=p, max_tokens=12)
            assert ids == engine.generate(p, SamplingParams(max_tokens=12, ignore_eos=True))
            if i:  # the shared prefix came from a cache, not recomputed
                assert last.usage.cached_tokens == 5 * BS
        # every decode step replayed a graph, none fell back to eager
        runner = c.decodes[0].runner
        assert runner.graphs.captured == batch_sizes_upto(runner.config.max_batch)
        assert runner.graphs.replays >= 11 * len(prompts)
        fallbacks = [s for m in runner.metrics.graph_fallbacks.collect() for s in m.samples]
        assert sum(s.value for s in fallbacks if s.name.endswith("_total")) == 0
