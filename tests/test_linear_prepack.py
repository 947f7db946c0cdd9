"""Packed linear weights (kernels/packed_linear.py): panels for the C kernel and oneDNN's layout
give the same products as dense `F.linear` at every row count a decode step or prefill chunk uses,
the same greedy tokens from the whole model, and nothing lost for what reads the weights back
(export, memory accounting)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import native
from kernels.native import panels_supported
from kernels.packed_linear import ONEDNN_PACK_ROWS
from model import KVPool, load_model
from servekit.memory import tensor_bytes

pytestmark = pytest.mark.skipif(
    not kernels.prepack_supported(torch.float32, "cpu"), reason="torch built without oneDNN"
)


def _onednn(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_PACK_ROWS)


PANELS = pytest.param(
    native.pack_panels,
    id="panels",
    marks=pytest.mark.skipif(
        not native.panels_supported(torch.ones(16, 1)), reason="no C compiler or no AVX2 + FMA"
    ),
)


# rows: one, a micro-kernel's six, six and one more, six and five more, a decode batch, a chunk
@pytest.mark.parametrize("rows", [1, 6, 7, 11, 16, 300])
@pytest.mark.parametrize("pack", [PANELS, pytest.param(_onednn, id="onednn")])
def test_packed_linear_equals_dense(rows, pack):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    x = torch.randn(rows, 40, generator=g)
    packed = pack(w)
    assert kernels.is_packed(packed) and not kernels.is_packed(w)
    # fp32 products summed in another order: within a few ulps of a 40-term dot product
    assert (kernels.linear(x, packed) - F.linear(x, w)).abs().max().item() <= 1e-4
    assert torch.equal(kernels.unpack(packed), w)  # the values come back exactly
    # an input that is a view with strides of its own, or has leading dimensions, is read right
    xt = torch.randn(40, rows, generator=g).t()
    assert (kernels.linear(xt, packed) - F.linear(xt, w)).abs().max().item() <= 1e-4
    x3 = x.reshape(1, rows, 40)
    assert (kernels.linear(x3, packed) - F.linear(x3, w)).abs().max().item() <= 1e-4
    assert kernels.linear(x, w).equal(F.linear(x, w))  # a plain weight goes to F.linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_gathered_from_panels_are_the_weights_rows(dtype):
    """A tied head in panels serves as the embedding: rows gathered from it are the plain
    weight's rows, bit for bit, in either panel layout (fp32 lanes, bf16 pairs of inputs)."""
    w = torch.randn(64, 40, generator=torch.Generator().manual_seed(5)).to(dtype)
    if not native.panels_supported(w):
        pytest.skip(f"no {dtype} panels on this CPU")
    rows = torch.tensor([0, 17, 63, 17, 30, 1])
    assert torch.equal(kernels.weight_rows(native.pack_panels(w), rows), w[rows])
    assert torch.equal(kernels.weight_rows(w, rows), w[rows])


def test_prepack_picks_the_form_each_weight_fits():
    panels_here = native.panels_supported(torch.ones(16, 1))
    assert kernels.prepack(torch.randn(32, 8)).dim() == (3 if panels_here else 2)
    assert kernels.prepack(torch.randn(30, 8)).is_mkldnn  # outputs no multiple of 16: oneDNN
    assert kernels.prepack(torch.randn(32, 8), "onednn").is_mkldnn  # asked for by name
    # auto: fp32 takes oneDNN's layout (it prefills faster); bf16 panels wherever they run
    assert kernels.prepack(torch.randn(32, 8), "auto").is_mkldnn
    bf16 = kernels.prepack(torch.randn(32, 8, dtype=torch.bfloat16), "auto")
    assert (bf16.dim() == 3) == native.bf16_rows_supported()
    with pytest.raises(ValueError, match="unknown packed form"):
        kernels.prepack(torch.randn(32, 8), "fast")
    half = torch.randn(32, 8, dtype=torch.float16)
    assert kernels.prepack(half) is half  # no fast packed path: left as it is
    with pytest.raises(ValueError, match="features"):
        native.linear_panels(torch.randn(2, 9), native.pack_panels(torch.randn(32, 8)))


def test_only_dtypes_with_a_fast_packed_path_are_packed():
    assert kernels.prepack_supported(torch.float32, "cpu")
    assert not kernels.prepack_supported(torch.float16, "cpu")
    assert not kernels.prepack_supported(torch.float32, "meta")
    assert kernels.prepack_supported(torch.bfloat16, "cpu") == (
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    lm = load_model("tiny-random", dtype=torch.float16)  # no packed path: left as loaded
    assert not lm.model.prepack_weights()
    assert not any(kernels.is_packed(p) for p in lm.model.parameters())


def test_packed_model_gives_the_dense_models_logits_and_tokens():
    dense = load_model("tiny-random", prepack="none")
    packed = load_model("tiny-random")  # prepack is the default
    assert not any(kernels.is_packed(p) for p in dense.model.parameters())
    assert kernels.is_packed(packed.model.layers[0].gate_up_proj)
    assert kernels.is_packed(packed.model._head())  # the LM head too, tied or not
    # tiny-random's head is its own: the embedding stays a plain table that lookups index
    assert not kernels.is_packed(packed.model.embed_tokens)
    assert packed.fingerprint == dense.fingerprint  # the same weights, so the same KV

    # exported weights are the plain, identical values
    a, b = dense.model.hf_state_dict(), packed.model.hf_state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)

    # prefill of a prompt, then greedy decode of a batch of 3: same logits within fp32 rounding,
    # same tokens
    c = dense.config
    prompts = [torch.randint(3, c.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
               for n in (37, 5, 20)]  # fmt: skip
    runs = []
    for lm in (dense, packed):
        pool = KVPool(c, 64, 16)
        tables = [pool.allocate(4) for _ in prompts]
        first = [lm.model.prefill(p, pool, t, last_only=True)[0] for p, t in zip(prompts, tables)]
        tokens = [torch.stack([f.argmax() for f in first])]
        logits = [torch.stack(first)]
        positions = torch.tensor([len(p) for p in prompts])
        table_t = torch.tensor(tables, dtype=torch.int32)
        for _ in range(8):
            step = lm.model.decode(tokens[-1], pool, table_t, positions)
            logits.append(step)
            tokens.append(step.argmax(-1))
            positions = positions + 1
        runs.append((torch.stack(logits), torch.stack(tokens)))
    assert (runs[0][0] - runs[1][0]).abs().max().item() <= 1e-4
    assert torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("form", ["panels", "auto"])
@pytest.mark.parametrize("name", ["tiny-random", "smollm2-135m"])
def test_memory_accounting_counts_packed_weights(name, form):
    dense = load_model(name, prepack="none")
    packed = load_model(name, prepack=form)
    plain = tensor_bytes(*dense.model.parameters())
    # a tied head in panels holds the embedding too (lookups gather from it): no more bytes;
    # packed by oneDNN it is a copy beside the plain table, one more head's bytes
    m = packed.model
    if dense.config.tie_word_embeddings:
        assert (m.embed_tokens is None) == (not m.packed_head.is_mkldnn)
        # auto packs a tied head in panels (where they fit) whatever the projections get
        assert (m.embed_tokens is None) == panels_supported(dense.model.embed_tokens)
    copy = m.packed_head is not None and m.embed_tokens is not None
    head = tensor_bytes(m.packed_head) if copy else 0
    assert tensor_bytes(*packed.model.parameters(), *packed.model.buffers()) == (
        plain + head + tensor_bytes(*dense.model.buffers())
    )


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("pack", [PANELS, pytest.param(_onednn, id="onednn"), None])
def test_residual_add_and_the_element_wise_steps_equal_torch(rows, pack):
    g = torch.Generator().manual_seed(7 + rows)
    w = torch.randn(96, 40, generator=g)
    x, res = torch.randn(rows, 40, generator=g), torch.randn(rows, 96, generator=g)
    want = res + F.linear(x, w)
    out = res.clone()
    got = kernels.linear_add_(out, x, pack(w) if pack else w)
    assert got is out  # in place
    assert (out - want).abs().max().item() <= 1e-4

    # RMSNorm and SiLU-and-multiply (in C where the kernels are built): torch's results, also
    # for large arguments (SiLU of -100 is -0, of 100 is 100) and rows that are views
    h = torch.randn(rows, 3, 40, generator=g) * 30
    norm_w = torch.rand(40, generator=g)
    want = F.rms_norm(h, (40,), norm_w, 1e-5)
    assert (kernels.rms_norm(h, norm_w, 1e-5) - want).abs().max().item() <= 1e-5 * want.abs().max()
    gu = torch.randn(rows, 2 * 52, generator=g) * 10
    gu[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0])
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = kernels.silu_mul(gu)
    assert got.shape == (rows, 52)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max()
    assert (kernels.silu_mul(gu.t().contiguous().t()) - want).abs().max() <= 1e-5 * want.abs().max()


_BF16_PANELS = native.panels_supported(torch.ones(16, 2, dtype=torch.bfloat16))


@pytest.mark.skipif(not _BF16_PANELS, reason="no C compiler or no AVX-512 BF16")
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vdpbf16ps"])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40, 64, 65, 300, 600])
def test_bf16_panels_equal_a_bf16_matmul_rounded_once(rows, amx, monkeypatch):
    """bf16 panels (csrc/linear_bf16.c): products of bf16 values summed in fp32, rounded to bf16
    once, so each output is the exact product's bf16 rounding or its neighbour; the residual
    form adds in fp32 before that rounding. Both paths: AMX tiles (where the CPU has them) and
    `vdpbf16ps`. 80 outputs = 5 panels: an odd panel out of the AMX path's pairs. 300 rows: the
    AMX path's 256-row blocks, and a second block of a 32-row strip and a 12-row tail; 600 rows:
    the threads split the rows (288 and 312: blocks of 256, a strip, a 24-row tail)."""
    if amx and not native._library()[0].hm_linear_bf16_amx_available():
        pytest.skip("no AMX here")
    monkeypatch.setattr(native, "AMX_MIN_ROWS", 1 if amx else 1 << 30)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 64, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    packed = kernels.prepack(w)
    assert packed.dtype == torch.bfloat16 and packed.shape == (5, 32, 32)
    assert torch.equal(kernels.unpack(packed), w)  # the values come back exactly
    exact = x.double() @ w.double().T
    out = kernels.linear(x, packed)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 80)
    ulp = exact.abs().clamp_min(1e-3) * 2.0**-7  # one bf16 step at each value
    assert ((out.double() - exact).abs() <= ulp).all()
    res = torch.randn(rows, 80, generator=g).bfloat16()
    summed = res.clone()
    assert kernels.linear_add_(summed, x, packed) is summed
    want = res.double() + exact
    assert ((summed.double() - want).abs() <= want.abs().clamp_min(1e-3) * 2.0**-7).all()
    # a strided view of x is read right
    xt = x.t().contiguous().t()
    assert torch.equal(kernels.linear(xt, packed), out)
    # each row's sums in the same order however many rows come with it (16-row groups of a
    # decode batch go through x packed for the broadcasts, a lone row does not): the same bits
    alone = [kernels.linear(x[i : i + 1], packed) for i in range(rows)]
    assert torch.equal(out, torch.cat(alone))
    for i in range(rows):
        one = res[i : i + 1].clone()
        assert torch.equal(kernels.linear_add_(one, x[i : i + 1], packed), summed[i : i + 1])


@pytest.mark.skipif(not _BF16_PANELS, reason="no C compiler or no AVX-512 BF16")
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vdpbf16ps"])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40, 70, 300, 600])
def test_swiglu_in_the_matmuls_pass_equals_the_two_steps(rows, amx, monkeypatch):
    """linear_silu_mul on bf16 panels: gate's and up's panels meet in the matmul's epilogue
    (csrc/linear_bf16.c), on AMX tiles or on `vdpbf16ps`, rounded as the unfused matmul and
    silu_mul round, so the values are the two steps' bit for bit. 6 panels of gate and 6 of up:
    the 32-row blocks, the 16-row tail and a short one (and past 256 rows, a second block of
    rows on AMX; from 512, the threads split the rows)."""
    if amx and not native._library()[0].hm_linear_bf16_amx_available():
        pytest.skip("no AMX here")
    monkeypatch.setattr(native, "AMX_MIN_ROWS", 1 if amx else 1 << 30)
    g = torch.Generator().manual_seed(rows)
    w = kernels.prepack(torch.randn(192, 64, generator=g).bfloat16())
    x = torch.randn(rows, 64, generator=g).bfloat16()
    fused = native.linear_silu_panels(x, w)
    two_steps = kernels.silu_mul(kernels.linear(x, w))
    assert fused is not None and torch.equal(fused, two_steps)
    assert torch.equal(kernels.linear_silu_mul(x, w), two_steps)
    # an odd number of panels has no gate/up pairs: the two steps
    assert native.linear_silu_panels(x, kernels.prepack(torch.ones(48, 64).bfloat16())) is None
    gate, up = (x.double() @ kernels.unpack(w).double().T).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    # four bf16 roundings (gate, silu, up, the product), gate's carried through silu' <= 1.1
    bound = 2.0**-8 * (1.1 * gate.abs() * up.abs() + 3 * want.abs())
    assert ((two_steps.double() - want).abs() <= 2 * bound + 1e-6).all()


@pytest.mark.skipif(not _BF16_PANELS, reason="no C compiler or no AVX-512 BF16")
@pytest.mark.parametrize("rows", [12, 28, 200])
def test_bf16_rows_a_multiple_of_2_kib_apart_give_the_bits_of_any_other_stride(rows, monkeypatch):
    """K = 1,024 bf16 inputs: rows 2 KiB apart, which csrc/linear_bf16.c reads through a copy at
    a padded stride (hm_x_aliases): 12 rows (all read as they lie), 28 (a packed group of 16
    and 12 more), 200 (blocks of 96 rows, so the third copy reuses the first's half of the
    scratch). The same x at a stride that does not alias gives the same bits, for the plain
    product, the residual form and SwiGLU's fused pass."""
    monkeypatch.setattr(native, "AMX_MIN_ROWS", 1 << 30)  # the `vdpbf16ps` path, which copies
    g = torch.Generator().manual_seed(rows)
    k = 1024
    w = kernels.prepack(torch.randn(64, k, generator=g).bfloat16())
    x = torch.randn(rows, k, generator=g).bfloat16()
    wide = torch.zeros(rows, k + 16, dtype=torch.bfloat16)
    wide[:, :k] = x
    x_other = wide[:, :k]  # the same values, rows 2,080 bytes apart
    assert x.stride(0) * 2 % 2048 == 0 and x_other.stride(0) * 2 % 2048 != 0
    out = kernels.linear(x, w)
    assert torch.equal(out, kernels.linear(x_other, w))
    exact = x.double() @ kernels.unpack(w).double().T
    assert ((out.double() - exact).abs() <= exact.abs().clamp_min(1e-3) * 2.0**-7).all()
    res = torch.randn(rows, 64, generator=g).bfloat16()
    a, b = res.clone(), res.clone()
    assert torch.equal(kernels.linear_add_(a, x, w), kernels.linear_add_(b, x_other, w))
    fused = native.linear_silu_panels(x, w)
    assert fused is not None and torch.equal(fused, native.linear_silu_panels(x_other, w))
    assert torch.equal(fused, kernels.silu_mul(out))


@pytest.mark.skipif(not _BF16_PANELS, reason="no C compiler or no AVX-512 BF16")
def test_bf16_packed_model_gives_the_dense_models_tokens():
    """The bf16 model over panels against the same model unpacked (oneDNN's or torch's bf16
    matmul): logits within bf16 rounding's reach, the same greedy tokens."""
    dense = load_model("tiny-random", dtype=torch.bfloat16, prepack="none")
    packed = load_model("tiny-random", dtype=torch.bfloat16)
    assert packed.model.layers[0].gate_up_proj.dtype == torch.bfloat16
    assert packed.model.layers[0].gate_up_proj.dim() == 3  # in panels
    c = dense.config
    prompt = torch.randint(3, c.vocab_size, (21,), generator=torch.Generator().manual_seed(3))
    runs = []
    for lm in (dense, packed):
        pool = KVPool(c, 16, 16, dtype=torch.bfloat16)
        table = pool.allocate(3)
        logits = [lm.model.prefill(prompt, pool, table, last_only=True)[0]]
        tok, pos = logits[0].argmax()[None], torch.tensor([21])
        table_t = torch.tensor([table], dtype=torch.int32)
        for _ in range(6):
            logits.append(lm.model.decode(tok, pool, table_t, pos)[0])
            tok, pos = logits[-1].argmax()[None], pos + 1
        runs.append(torch.stack(logits))
    assert (runs[0] - runs[1]).abs().max().item() <= 0.05 * runs[0].abs().max().item()
    assert torch.equal(runs[0].argmax(-1), runs[1].argmax(-1))


@pytest.mark.skipif(not _BF16_PANELS, reason="no C compiler or no AVX-512 BF16")
@pytest.mark.parametrize("rows,dim", [(1, 576), (16, 64), (3, 17)])
def test_bf16_element_wise_steps_round_where_the_reference_rounds(rows, dim):
    """bf16 RMSNorm and SiLU-and-mul in one C pass each give the reference's bf16 results (HF
    over torch's bf16 ops: normalise in fp32, round, times the weight, round; silu rounded,
    times up, rounded): equal, but for a sum of squares taken in another order, which may move
    a value by one bf16 step. A 17-wide row takes the kernels' scalar tails."""
    g = torch.Generator().manual_seed(dim)
    x = (3 * torch.randn(rows, dim, generator=g)).bfloat16()
    w = torch.randn(dim, generator=g).bfloat16()
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    got = kernels.rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    step = want.float().abs().clamp_min(1e-30) * 2.0**-7
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean().item() >= 0.99
    gu = (4 * torch.randn(rows, 2 * dim, generator=g)).bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(kernels.silu_mul(gu), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 100])
@pytest.mark.parametrize("dim", [8, 64])
def test_rope_in_place_gives_the_reference_bits(rows, dim, dtype):
    """kernels.rope_ rotates q and k inside the projection's output, in place (one C pass
    where the kernels take it, torch's ops elsewhere), to the reference's bits: HF's
    rotate-half over torch ops, rounding after each op in bf16. The v columns beside them
    stay as they were. 100 rows split among threads; head_dim 64 takes the 16-lane path (halves
    a multiple of 16), 8 the lane-at-a-time one."""
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 20 * dim, generator=g).to(dtype)
    x = qkv[:, : 16 * dim].view(rows, 16, dim)  # q and k heads: a strided view
    freqs = torch.arange(rows).float()[:, None] * torch.rand(dim // 2, generator=g)[None]
    cos, sin = freqs.cos().to(dtype)[:, None], freqs.sin().to(dtype)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    v = qkv[:, 16 * dim :].clone()
    assert kernels.rope_(x, cos, sin) is x
    assert torch.equal(x, want)
    assert torch.equal(qkv[:, 16 * dim :], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepack_many_lays_the_panels_end_to_end_in_one_buffer(dtype):
    """A model's weights packed together (prepack_many): the panels are prepack's, each in its
    place in one buffer (advised onto huge pages), whose bytes are the weights' own; a weight that
    does not fit panels is packed as prepack packs it."""
    if not panels_supported(torch.ones(16, 2, dtype=dtype)):
        pytest.skip(f"no panels for {dtype} here")
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(n, 64, generator=g).to(dtype) for n in (32, 48, 80, 7)]
    given = list(ws)
    packed = list(kernels.prepack_many(given))
    assert given == [None] * 4  # each let go of once packed
    for w, p in zip(ws, packed):
        assert torch.equal(kernels.unpack(p), w)
    panels = packed[:3]
    for w, p in zip(ws, panels):
        assert torch.equal(p, kernels.prepack(w)) and p.data_ptr() % 64 == 0
    assert len({p.untyped_storage().data_ptr() for p in panels}) == 1
    assert tensor_bytes(*panels) == sum(w.numel() * w.element_size() for w in ws[:3])
    assert packed[3].dim() != 3  # 7 outputs: no panels
    with pytest.raises(ValueError, match="unknown packed form"):
        next(kernels.prepack_many(ws, "tiles"))
