"""Linear layers whose weights are packed once, at load, for the CPU's fastest matmul.

Why: a decode step multiplies its few rows (the batch) by every weight once. torch's dense
`F.linear` goes to MKL's sgemm, which on this kind of AVX2 CPU runs far below both the memory
and the arithmetic bounds at 1-32 rows. Two packed forms, each chosen per weight:

- panels (N a multiple of 16; through kernels/native.py): fp32 [N/16, K, 16] (csrc/linear.c,
  AVX2), one cache line of 16 outputs per input, streamed once per call with the next panel
  prefetched; bf16 [N/16, K/2, 32] (csrc/linear_bf16.c), a line of 16 outputs per pair of
  inputs, the B operand of AMX's `tdpbf16ps` as it lies (or of `vdpbf16ps` without AMX).
- oneDNN's blocked layout (`torch.ops.mkldnn`), where panels do not apply: bf16 on a CPU with
  native bf16 but no AVX-512 BF16 path built, a weight whose outputs are no multiple of 16, or no
  C compiler.

Measured on SmolLM2-135M (fp32, one thread, the other core busy; ms per forward, medians of 7;
`bench/model_speed.py` has the benchmark):

    forward                 dense (MKL)   oneDNN packed   panels
    decode, batch 1              79.9           90.8        71.2
    decode, batch 4             185.2          109.9        67.7
    decode, batch 16            235.8          202.0       122.7
    decode, batch 32            364.9          351.6       206.9
    prefill, 512 tokens        2088          2226         2142

bf16 on a 2-core Xeon with AMX (SmolLM2's 30 layers of projections, weights streamed from memory;
`GB/s` of weights read, medians of 7):

    rows                      1       4      16
    panels (AMX tiles)     20.8    18.6    18.4
    oneDNN packed           8.6     8.7     8.6

A packed weight is not [N, K] any more (panels are [N/16, K, 16]; a oneDNN one is an opaque
`is_mkldnn` tensor with no storage), so what needs the plain values (exporting the weights,
comparing them) goes through `unpack`, which gives them back exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kernels import native
from kernels.dispatch import HAS_TRITON
from kernels.pages import empty_on_huge_pages

# The row count oneDNN tunes its packed layout for. The layout is chosen once, at load, for
# every batch that follows; 16 rows is the decode batch that matters, and oneDNN's kernels
# measured as fast as with a layout chosen per row count, from 1 row to 256-row prefill chunks.
ONEDNN_PACK_ROWS = 16


def _onednn_packs(dtype: torch.dtype) -> bool:
    """fp32 on any CPU, bf16 only where the CPU has native bf16 (elsewhere oneDNN emulates it,
    slower than dense)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def prepack_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether weights of this dtype on this device have a packed path (panels or oneDNN)."""
    return torch.device(device).type == "cpu" and _onednn_packs(dtype)


# Packed forms by name: "panels" where a weight fits them, else oneDNN's; "onednn" only oneDNN's;
# "auto" the faster at prefill sizes: panels for bf16 wherever the library has them (on AMX
# tiles, faster than oneDNN's at every row count measured, 1 to 512; on `vdpbf16ps` without AMX,
# a 2-core EPYC's SmolLM2 prefill of 64, 256 and 1,024 tokens took 0.89, 0.91 and 0.94 of
# oneDNN's time), oneDNN's otherwise (fp32: panels decode faster, above, but oneDNN's layout
# prefills 6-10% faster on 2 cores).
PACK_FORMS = ("panels", "onednn", "auto")


def _auto_form(weight: torch.Tensor) -> str:
    bf16_panels = weight.dtype == torch.bfloat16 and native.bf16_rows_supported()
    return "panels" if bf16_panels else "onednn"


def _check_form(form: str) -> None:
    if form not in PACK_FORMS:
        raise ValueError(f"unknown packed form {form!r} (known: {', '.join(PACK_FORMS)})")


def _to_panels(weight: torch.Tensor, form: str) -> bool:
    """Whether `form` packs `weight` in panels: asked for ("panels", or picked by "auto") and
    the weight fits them."""
    picked = _auto_form(weight) if form == "auto" else form
    return picked == "panels" and native.panels_supported(weight)


def prepack(weight: torch.Tensor, form: str = "panels") -> torch.Tensor:
    """`weight` [N, K] packed (a new tensor): in panels where `form` is "panels" (or "auto"
    picks them) and the weight fits them, else in oneDNN's layout; the weight itself where
    neither applies."""
    _check_form(form)
    if _to_panels(weight, form):
        return native.pack_panels(weight)
    if weight.device.type == "cpu" and _onednn_packs(weight.dtype):
        w = weight.detach().contiguous()
        return torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_PACK_ROWS)
    return weight


def prepack_many(weights: list[torch.Tensor], form: str = "panels") -> Iterator[torch.Tensor]:
    """prepack of each weight in turn, those that go to panels laid end to end in one buffer on
    transparent huge pages (kernels/pages.py). Why: a decode step streams every weight once, and
    on 4 KiB pages each page is a TLB miss and a stop for the hardware prefetcher; SmolLM2's
    bf16 decode step on a 2-core EPYC took 0.976 of the time at batch 16, 0.962 at batch 1.
    The list's entries are dropped (None) as they are packed: a caller that puts each packed
    weight in its plain one's place frees that one at once, so a load holds the plain weights
    and the buffer's packed part, never two whole copies."""
    _check_form(form)
    sizes = [
        math.prod(native.panels_layout(w)) * w.element_size() if _to_panels(w, form) else 0
        for w in weights
    ]
    # panels are whole 64-byte lines and the buffer starts on a 2 MiB boundary: no gaps, the
    # bytes are the weights'; the tail past the last 2 MiB boundary stays on small pages, and a
    # page is only resident once the packing writes it
    arena = empty_on_huge_pages((sum(sizes),), torch.uint8) if any(sizes) else None
    at = 0
    for i, size in enumerate(sizes):
        w, weights[i] = weights[i], None
        if not size:
            yield prepack(w, form)
            continue
        view = arena[at : at + size].view(w.dtype).view(native.panels_layout(w))
        at += size
        yield native.pack_panels(w, out=view)


def is_packed(weight: torch.Tensor) -> bool:
    return weight.is_mkldnn or weight.dim() == 3


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight.T, whether the weight is packed (either form) or plain."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    if weight.dim() == 3:
        return native.linear_panels(x, weight)
    return F.linear(x, weight)


def linear_add_(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out += x @ weight.T, in place (a residual connection), and out returned: in the matmul's
    own pass where the weight is in panels, or on CUDA (one GEMM whose epilogue adds, in fp32
    before the one rounding)."""
    if weight.dim() == 3 and out.dtype == weight.dtype and out.dim() == 2 and out.stride(1) == 1:
        return native.linear_panels(x, weight, add_to=out)
    if (
        out.is_cuda
        and out.dim() == x.dim() == weight.dim() == 2
        and out.dtype == x.dtype == weight.dtype
    ):
        return out.addmm_(x, weight.t())
    return out.add_(linear(x, weight))


def _triton_rows(*tensors: torch.Tensor) -> bool:
    """Whether kernels/rows_triton.py takes these: CUDA tensors of a float dtype, triton there."""
    return (
        HAS_TRITON
        and tensors[0].dtype in (torch.float32, torch.bfloat16, torch.float16)
        and all(t.is_cuda for t in tensors)
    )


def _native_rows(*tensors: torch.Tensor) -> bool:
    """Whether the C element-wise kernels take these: fp32 CPU tensors, or bf16 ones where the
    library has its AVX-512 BF16 path, the library loaded."""
    dtype = tensors[0].dtype
    if dtype not in (torch.float32, torch.bfloat16) or not native.native_status().available:
        return False
    if not all(t.dtype == dtype and t.device.type == "cpu" for t in tensors):
        return False
    return dtype == torch.float32 or native.bf16_rows_supported()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] by weight [D] (fp32 or bf16: one C pass where the kernels are
    built; bf16 rounds where the reference rounds)."""
    if _native_rows(x, weight):
        return native.rms_norm(x, weight, eps)
    if _triton_rows(x, weight) and x.shape[-1] <= 16384:  # a row a program, in registers
        from kernels.rows_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Low-precision activations: normalise in fp32 as the reference implementation does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up of gate_up [..., 2I] (gate, then up): [..., I]."""
    if _native_rows(gate_up):
        return native.silu_mul(gate_up)
    if _triton_rows(gate_up):
        from kernels.rows_triton import silu_mul_triton

        return silu_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul(linear(x, gate_up)): SwiGLU's step of a fused gate/up weight, in the matmul's
    own pass where the weight is in bf16 panels and the CPU has AMX tiles."""
    if gate_up.dim() == 3 and (act := native.linear_silu_panels(x, gate_up)) is not None:
        return act
    return silu_mul(linear(x, gate_up))


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [N, heads, D] in place (rotate-half layout, as HF) by cos/sin
    [N, 1, D/2] of x's dtype: one C pass where the kernels take it (fp32, or bf16 with the
    library's AVX-512 BF16 path, unit stride along D), else torch's ops. Returns x."""
    ok = cos.dtype == sin.dtype == x.dtype and x.stride(-1) == 1 and x.dim() == 3
    if ok and _native_rows(x, cos, sin):
        return native.rope_(x, cos, sin)
    if ok and _triton_rows(x, cos, sin):
        from kernels.rows_triton import rope_triton_

        return rope_triton_(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def unpack(weight: torch.Tensor) -> torch.Tensor:
    """A plain [N, K] tensor with the weight's values (the weight itself when it is plain)."""
    if weight.is_mkldnn:
        return weight.to_dense()
    if weight.dim() == 3:
        return native.unpack_panels(weight)
    return weight


def weight_rows(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` [n] of a plain or panel-packed [N, K] weight -> [n, K] (an embedding lookup
    in a tied head)."""
    if weight.dim() == 3:
        return native.panel_rows(weight, rows)
    return unpack(weight)[rows]


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor's values take, packed or not (a oneDNN tensor has no storage to ask)."""
    return t.numel() * t.element_size()
