"""The fused decode layers (kernels/decode_step.py, csrc/decode_step.c): a decode step's layers in
one C call give the layer-by-layer Python path's bits (logits and the KV written into the pool),
over a full-precision pool and over a KIVI pool with its window, in fp32 and bf16; a bad block
table changes nothing; where the fused layers do not apply the model keeps its Python path."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import KiviKVLayout, native
from model import Engine, KVPool, SamplingParams, load_model
from model.kivi_pool import KiviPool

DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not native.bf16_rows_supported(), reason="no AVX-512 BF16 path on this CPU"
        ),
    ),
]
pytestmark = pytest.mark.skipif(
    not native.panels_supported(torch.ones(16, 2)), reason="no C compiler or no AVX2 + FMA"
)
BS = 16
GARBAGE = (-1, 10**6)  # table columns past a sequence's last block: never to be read


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: str(d).split(".")[-1])
def tiny(request):
    return load_model("tiny-random", dtype=request.param)


def _table(g, batch, cols, num_blocks, used_blocks):
    """Disjoint random blocks per sequence; columns past its last used block hold garbage."""
    table = torch.randperm(num_blocks, generator=g)[: batch * cols].view(batch, cols).int()
    for b, n in enumerate(used_blocks):
        for c in range(n, cols):
            table[b, c] = GARBAGE[c % 2]
    return table


def _both_paths(model, step):
    """step() on the fused layers, then layer by layer from Python."""
    out = []
    for fused in (True, False):
        model.fused_decode = fused
        try:
            out.append(step())
        finally:
            model.fused_decode = True
    return out


def _random_pool(lm, num_blocks, seed):
    pool = KVPool(lm.config, num_blocks, BS, lm.model.dtype, "cpu")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_fused_decode_gives_the_python_paths_bits(tiny, batch):
    model = tiny.model
    g = torch.Generator().manual_seed(batch)
    # positions inside a block, at its first slot and its last, past several blocks
    positions = torch.randint(0, 70, (batch,), generator=g)
    positions[0] = BS
    if batch > 1:
        positions[1] = BS - 1
    tables = _table(g, batch, 6, 128, [int(p) // BS + 1 for p in positions])
    tokens = torch.randint(0, tiny.config.vocab_size, (batch,), generator=g)
    assert model._decode_layers(_random_pool(tiny, 128, 0)) is not None  # the fused path runs
    pools = [_random_pool(tiny, 128, 0) for _ in range(2)]
    it = iter(pools)
    logits = _both_paths(model, lambda: model.decode(tokens, next(it), tables, positions))
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(pools[0].kv, pools[1].kv)  # each new K/V written where the other wrote it
    assert not torch.equal(pools[0].kv, _random_pool(tiny, 128, 0).kv)  # and written at all


def test_fused_decode_generates_the_same_tokens(tiny):
    prompts = [[5, 9, 200, 17], list(range(40, 75)), [3] * 18]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = _both_paths(tiny.model, lambda: Engine(tiny).generate_batch(prompts, params))
    assert outs[0] == outs[1] and all(len(o) == 24 for o in outs[0])


@pytest.mark.parametrize("bits", [2, 4])
def test_fused_kivi_decode_gives_the_python_paths_bits(tiny, bits):
    c, model = tiny.config, tiny.model
    layout = KiviKVLayout(c.num_layers, c.num_kv_heads, c.head_dim, BS, bits, residual=32,
                          window_dtype=model.dtype)  # fmt: skip
    batch, g = 6, torch.Generator().manual_seed(bits)
    packed_lens = torch.tensor([0, 16, 48, 32, 0, 64], dtype=torch.int32)
    in_window = torch.tensor([0, 5, 15, 16, 31, 40])
    positions = packed_lens.long() + in_window
    packed_tables = _table(g, batch, 5, 40, [int(n) // BS for n in packed_lens])
    window_tables = _table(g, batch, 3, 3 * batch, [int(w) // BS + 1 for w in in_window])
    tokens = torch.randint(0, c.vocab_size, (batch,), generator=g)

    def pool():
        p = KiviPool(c, layout, 40, 3 * batch)
        gen = torch.Generator().manual_seed(7)
        p.packed.kv.copy_(torch.randint(0, 256, p.packed.kv.shape, generator=gen))
        for layer in p.packed_layers:  # scales and zero points as real ones are: small, finite
            for f in layer:
                if f.dtype == torch.float16:
                    f.copy_(torch.randn(f.shape, generator=gen) * 0.1)
        p.window.kv.copy_(torch.randn(p.window.kv.shape, generator=gen))
        return p

    assert model._decode_layers(pool().window) is not None
    pools = [pool(), pool()]
    it = iter(pools)
    logits = _both_paths(
        model,
        lambda: model.decode_kivi(
            tokens, next(it), packed_tables, packed_lens, window_tables, positions
        ),
    )
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(pools[0].window.kv, pools[1].window.kv)


def test_a_bad_table_changes_nothing(tiny):
    model = tiny.model
    pool = _random_pool(tiny, 32, 1)
    before = pool.kv.clone()
    tokens = torch.tensor([1, 2])
    positions = torch.tensor([3, 20])
    # sequence 1's second block is outside the pool; its first is fine (and written first)
    tables = torch.tensor([[0, 1], [2, 32]], dtype=torch.int32)
    with pytest.raises(IndexError, match="sequence 1"):
        model.decode(tokens, pool, tables, positions)
    # a position past its table's columns
    with pytest.raises(IndexError, match="sequence 0"):
        model.decode(tokens, pool, torch.tensor([[0], [2]], dtype=torch.int32), positions + 16)
    assert torch.equal(pool.kv, before)
    # and the model still serves
    good = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    assert torch.isfinite(model.decode(tokens, pool, good, positions)).all()


def test_where_the_fused_layers_do_not_apply_the_python_path_runs():
    lm = load_model("tiny-random", dtype=torch.float32, prepack="none")
    pool = KVPool(lm.config, 8, BS, torch.float32, "cpu")
    assert lm.model._decode_layers(pool) is None  # plain weights: no panels to point at
    tables = torch.tensor([[0]], dtype=torch.int32)
    plain = lm.model.decode(torch.tensor([4]), pool, tables, torch.tensor([2]))
    assert lm.model.prepack_weights("panels")
    assert lm.model._decode_layers(pool) is not None  # packed now: built anew
    other = KVPool(lm.config, 8, BS, torch.bfloat16, "cpu")
    assert lm.model._decode_layers(other) is None  # a pool of another dtype
    # fp32 panels sum in another order than F.linear: within fp32 rounding of the dense path
    packed = lm.model.decode(torch.tensor([4]), pool, tables, torch.tensor([2]))
    assert (packed - plain).abs().max().item() < 1e-4


def test_the_layers_refuse_shapes_they_were_not_built_for(tiny):
    c, m = tiny.config, tiny.model
    layers = [
        kernels.LayerWeights(
            layer.input_norm,
            layer.qkv_proj,
            layer.o_proj,
            layer.post_norm,
            layer.gate_up_proj,
            layer.down_proj,
        )  # fmt: skip
        for layer in m.layers
    ]
    args = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, 1e-5, 1.0)
    assert kernels.DecodeLayers.build(layers, *args) is not None
    wrong = (c.hidden_size, c.num_heads * 2, *args[2:])  # more query heads than qkv holds
    assert kernels.DecodeLayers.build(layers, *wrong) is None
    fused = kernels.DecodeLayers.build(layers, *args)
    pool = _random_pool(tiny, 8, 0)
    with pytest.raises(ValueError, match="decode layers take x"):
        fused.run(
            torch.zeros(2, c.hidden_size + 1, dtype=m.dtype), pool.layer_kv(0), pool.kv.stride(1),
            torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.long),
            torch.ones(2, c.head_dim // 2, dtype=m.dtype), torch.zeros(2, c.head_dim // 2,
                                                                       dtype=m.dtype),
        )  # fmt: skip
