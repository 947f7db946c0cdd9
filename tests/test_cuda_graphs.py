"""Decode steps replayed from CUDA graphs (model/cuda_graphs.py): a batch padded up to a captured
size gives its rows' logits and writes their KV as the eager step does, padding rows write only
the pad block, and a batch that fits no graph runs eagerly and is reported. The padding rules run
on the CPU (the steps eager over the static buffers); the graphs themselves where CUDA is."""

from __future__ import annotations

import pytest
import torch

from kernels import KiviKVLayout
from model import KVPool, load_model
from model.cuda_graphs import GraphedStep, StaticInput, batch_sizes_upto
from model.kivi_pool import KiviPool

BS = 16
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]
# the graphs' padded matmuls may take other GEMM kernels than the eager batch's (cuBLAS picks
# by shape): fp32 logits agree to rounding, not bits
TOL = {torch.float32: 1e-4, torch.bfloat16: 0.1}


def _seqs(lm, pool, lengths, seed):
    """Sequences of `lengths` prompt tokens prefilled into `pool` on disjoint random blocks;
    (last tokens, tables [B, widest] int32, positions of the tokens to decode)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(n + 1) // BS) for n in lengths]
    ids = torch.randperm(pool.num_blocks - 1, generator=g)[: sum(need)].tolist()
    pool.allocate(pool.num_blocks)  # every block held: the test places them itself
    tables, start = torch.zeros(len(lengths), max(need), dtype=torch.int32), 0
    tokens = torch.randint(3, lm.config.vocab_size, (len(lengths),), generator=g)
    for i, (n, k) in enumerate(zip(lengths, need)):
        blocks = ids[start : start + k]
        start += k
        tables[i, :k] = torch.tensor(blocks, dtype=torch.int32)
        prompt = torch.randint(3, lm.config.vocab_size, (n,), generator=g)
        lm.model.prefill(prompt, pool, blocks, 0)
    return tokens, tables, torch.tensor(lengths, dtype=torch.long)


def test_batch_sizes_upto_ends_at_the_largest_batch():
    assert batch_sizes_upto(64) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    assert batch_sizes_upto(20) == [1, 2, 4, 8, 12, 16, 20]
    sizes = batch_sizes_upto(1000)
    assert sizes[-1] == 1000 and all(b < 1.5 * a + 1 for a, b in zip(sizes[3:-1], sizes[4:-1]))
    assert batch_sizes_upto(1) == [1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_padded_batch_gives_the_eager_logits_and_kv(device, dtype):
    lm = load_model("tiny-random", dtype=dtype, device=device)
    pools = [KVPool(lm.config, 40, BS, dtype, device) for _ in range(2)]
    for p in pools:  # one random content, so that a stray write shows
        p.kv.copy_(torch.randn(p.kv.shape, generator=torch.Generator().manual_seed(3)))
    pad = pools[0].num_blocks - 1  # _seqs leaves the last block out
    lengths = [5, 37, 16]
    graphed = GraphedStep(
        lambda t, tab, pos: lm.model.decode(t, pools[0], tab, pos),
        [StaticInput(torch.long, 0, 0), StaticInput(torch.int32, 8, pad),
         StaticInput(torch.long, 0, 0)],
        [1, 2, 4],
        device,
    )  # fmt: skip
    pad_before = pools[0].kv[pad].clone()  # capture's warm-up writes the padding rows' KV too
    with torch.inference_mode():
        assert graphed.capture()
    assert graphed.captured == ([1, 2, 4] if device == "cuda" else [])
    tokens, tables, positions = _seqs(lm, pools[0], lengths, seed=1)
    _seqs(lm, pools[1], lengths, seed=1)
    before = pools[0].kv.clone()
    got = graphed(tokens, tables, positions).float().cpu()  # 3 rows: padded to 4
    want = lm.model.decode(tokens, pools[1], tables, positions).float().cpu()
    assert got.shape == want.shape == (3, lm.config.vocab_size)
    assert (got - want).abs().max().item() <= TOL[dtype]
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # the real rows' KV as the eager step wrote it; the padding row wrote its block only
    rest = torch.ones(pools[0].num_blocks, dtype=torch.bool)
    rest[pad] = False
    assert torch.allclose(pools[0].kv[rest].float(), pools[1].kv[rest].float(), atol=TOL[dtype])
    assert not torch.equal(pools[0].kv[rest], before[rest])
    assert not torch.equal(pools[0].kv[pad], pad_before)
    assert graphed.replays == 1


def test_a_batch_that_fits_no_graph_runs_eagerly_and_is_reported():
    lm = load_model("tiny-random")
    pool = KVPool(lm.config, 40, BS, torch.float32)
    heard: list[str] = []
    graphed = GraphedStep(
        lambda t, tab, pos: lm.model.decode(t, pool, tab, pos),
        [StaticInput(torch.long, 0, 0), StaticInput(torch.int32, 1, 39),
         StaticInput(torch.long, 0, 0)],
        [1, 2],
        "cpu",
        on_fallback=heard.append,
    )  # fmt: skip
    assert graphed.capture()
    tokens, tables, positions = _seqs(lm, pool, [3, 4, 5], seed=2)
    graphed(tokens, tables, positions)  # 3 rows, graphs of up to 2
    graphed(tokens[:1], torch.cat([tables[:1], tables[:1, :1]], 1), positions[:1])  # 2 columns
    assert heard == ["batch", "width"] and graphed.replays == 0
    graphed(tokens[:2], tables[:2], positions[:2])
    assert heard == ["batch", "width"] and graphed.replays == 1


def test_a_step_that_cannot_be_captured_runs_eagerly():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    heard: list[str] = []

    def step(x):  # a host sync: capture refuses it
        return x * int(x.sum().item())

    graphed = GraphedStep(step, [StaticInput(torch.long, 0, 1)], [1, 2], "cuda", heard.append)
    assert not graphed.capture() and graphed.captured == [] and heard == ["capture"]
    assert graphed(torch.tensor([2, 3])).tolist() == [10, 15]
    assert heard == ["capture"]  # told once, at capture


@pytest.mark.parametrize("device", DEVICES)
def test_a_padded_kivi_batch_gives_the_eager_logits(device):
    lm = load_model("tiny-random", device=device)
    c = lm.config
    layout = KiviKVLayout(c.num_layers, c.num_kv_heads, c.head_dim, BS, 4, residual=32,
                          window_dtype=torch.float32)  # fmt: skip
    pools = [KiviPool(c, layout, 30, 8, device) for _ in range(2)]
    for p in pools:  # one random content; scales and zero points small and finite, as real ones
        g = torch.Generator().manual_seed(4)
        p.packed.kv.copy_(torch.randint(0, 256, p.packed.kv.shape, generator=g))
        for layer in p.packed_layers:
            for f in layer:
                if f.dtype == torch.float16:
                    f.copy_(torch.randn(f.shape, generator=g) * 0.1)
        p.window.kv.copy_(torch.randn(p.window.kv.shape, generator=g))
    pad = 7  # window blocks 0-5 hold the sequences' windows
    tokens = torch.tensor([5, 9, 11])
    packed_tables = torch.tensor([[0, 1], [2, 0], [3, 4]], dtype=torch.int32)
    packed_lens = torch.tensor([2 * BS, BS, 2 * BS], dtype=torch.int32)
    window_tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    positions = packed_lens.long() + torch.tensor([3, 20, 9])
    args = (tokens, packed_tables, packed_lens, window_tables, positions)
    graphed = GraphedStep(
        lambda *a: lm.model.decode_kivi(a[0], pools[0], *a[1:]),
        [StaticInput(torch.long, 0, 0), StaticInput(torch.int32, 4, 0),
         StaticInput(torch.int32, 0, 0), StaticInput(torch.int32, 2, pad),
         StaticInput(torch.long, 0, 0)],
        [2, 4],
        device,
    )  # fmt: skip
    before = pools[0].window.kv.clone()
    with torch.inference_mode():
        assert graphed.capture()
    got = graphed(*args).float().cpu()
    want = lm.model.decode_kivi(tokens, pools[1], *args[1:]).float().cpu()
    assert (got - want).abs().max().item() <= TOL[torch.float32]
    assert torch.equal(pools[0].packed.kv, pools[1].packed.kv)
    assert torch.allclose(pools[0].window.kv[:pad], pools[1].window.kv[:pad], atol=1e-5)
    assert torch.equal(pools[0].window.kv[pad + 1 :], before[pad + 1 :])
    assert not torch.equal(pools[0].window.kv[pad], before[pad])


def test_greedy_rows_take_their_argmax_on_the_gpu_and_sampled_rows_sample_on_the_host():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from types import SimpleNamespace

    from decode_node.runner import DecodeRunner
    from model import SamplingParams, sample

    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0, 0.8, 0, 1.2, 0, 0])]

    def batch():
        return [SimpleNamespace(params=p, generator=p.generator()) for p in params]

    want = sample(logits, params, [s.generator for s in batch()]).tolist()
    assert DecodeRunner._sample(batch(), logits.cuda()) == want
    assert DecodeRunner._sample(batch()[::2], logits[::2].cuda()) == logits[::2].argmax(-1).tolist()
