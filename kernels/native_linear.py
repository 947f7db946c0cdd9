"""The small-batch linear over packed weight panels (csrc/linear.c in fp32, csrc/linear_bf16.c
in bf16, on AMX tiles where the CPU has them), its fused SwiGLU, and the element-wise row steps
around it on the same library: RMSNorm, SiLU-and-mul, the rotary embedding, the argmax of
logits. kernels/packed_linear.py picks between these and torch.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.native_build import _library

PANEL = 16  # outputs per panel: a weight packs when its output count is a multiple of it


def panels_supported(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] can be packed into panels here: on the CPU, N a multiple of PANEL,
    and fp32 with the library's AVX2 + FMA path, or bf16 (K even) with its AVX-512 BF16 one."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in _PANEL_DTYPES:
        return False
    n, k = weight.shape
    if n % PANEL or n == 0 or k == 0 or (weight.dtype == torch.bfloat16 and k % 2):
        return False
    lib, _ = _library()
    if lib is None:
        return False
    if weight.dtype == torch.bfloat16:
        return bool(lib.hm_linear_bf16_available())
    return bool(lib.hm_linear_available())


def bf16_rows_supported() -> bool:
    """Whether the library has its AVX-512 BF16 path (bf16 panels, RMSNorm and SiLU-and-mul)."""
    lib, _ = _library()
    return lib is not None and bool(lib.hm_linear_bf16_available())


def amx_supported() -> bool:
    """Whether bf16 panels run on AMX tiles here (built with them, and the OS grants them)."""
    lib, _ = _library()
    return lib is not None and bool(lib.hm_linear_bf16_amx_available())


# Panel dtypes: fp32 panels are [N/16, K, 16]; bf16 panels [N/16, K/2, 32], a line per input
# pair (16 outputs x 2 inputs), the order `vdpbf16ps` takes them in (csrc/linear_bf16.c).
_PANEL_DTYPES = (torch.float32, torch.bfloat16)


def panels_layout(weight: torch.Tensor) -> tuple[int, int, int]:
    """The shape pack_panels gives `weight` [N, K]: fp32 [N/16, K, 16], bf16 [N/16, K/2, 32]."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        return n // PANEL, k // 2, 2 * PANEL
    return n // PANEL, k, PANEL


def pack_panels(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`weight` [N, K] as panels (fp32: [N/16, K, 16], panel p, row k holding outputs
    16p..16p+15 at input k; bf16: [N/16, K/2, 32], the outputs' pairs of inputs 2k, 2k+1),
    written into `out` where given (contiguous, that shape and dtype, 64-byte aligned);
    call only where panels_supported(weight)."""
    lib, _ = _library()
    w = weight.detach().contiguous()
    n, k = w.shape
    shape = panels_layout(w)
    if out is None:
        out = torch.empty(shape, dtype=w.dtype)
    elif out.shape != shape or out.dtype != w.dtype or not out.is_contiguous():
        raise ValueError(f"panels of {tuple(w.shape)} {w.dtype} go in {shape}, not {out.shape}")
    elif out.data_ptr() % 64:
        raise ValueError("panels must start on a 64-byte boundary")
    pack = lib.hm_linear_bf16_pack if w.dtype == torch.bfloat16 else lib.hm_linear_pack
    pack(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def panels_shape(panels: torch.Tensor) -> tuple[int, int]:
    """(N, K) of the weight that `panels` hold."""
    p, lines, width = panels.shape
    if panels.dtype == torch.bfloat16:
        return p * PANEL, lines * 2
    return p * width, lines


def unpack_panels(panels: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight that pack_panels packed (exactly)."""
    n, k = panels_shape(panels)
    if panels.dtype == torch.bfloat16:
        p, kh, _ = panels.shape
        return panels.view(p, kh, PANEL, 2).permute(0, 2, 1, 3).reshape(n, k)
    return panels.permute(0, 2, 1).reshape(n, k)


def panel_rows(panels: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` [n] of the [N, K] weight that pack_panels packed -> [n, K], gathered from the
    panels without unpacking the rest (a tied LM head's panels serve as the embedding)."""
    n, k = panels_shape(panels)
    p, r = rows // PANEL, rows % PANEL
    if panels.dtype == torch.bfloat16:  # row r's inputs lie by pairs in lanes 2r, 2r + 1
        return panels.view(n // PANEL, k // 2, PANEL, 2)[p, :, r, :].reshape(-1, k)
    return panels[p, :, r]


def _rows(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """t as rows [R, last dim] of `dtype` with unit stride along a row (a copy only where
    needed)."""
    rows = t.reshape(-1, t.shape[-1])
    if rows.dtype != dtype or rows.stride(-1) != 1:
        rows = rows.to(dtype).contiguous()
    return rows


def _panel_operands(x: torch.Tensor, panels: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(N, K, x as rows in the panels' dtype), the panels checked."""
    n, k = panels_shape(panels)
    if x.shape[-1] != k:
        raise ValueError(f"linear: x has {x.shape[-1]} features, the weight takes {k}")
    align = 64 if panels.dtype == torch.bfloat16 else 32
    if panels.data_ptr() % align or not panels.is_contiguous():
        raise ValueError(f"linear: packed panels must be contiguous and {align}-byte aligned")
    return n, k, _rows(x, panels.dtype)


def linear_silu_panels(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU's silu(gate) * up of x [..., K] times bf16 panels of gate's rows, then up's:
    [..., N/2], the values of silu_mul(linear_panels(x, panels)) in one pass (the gate/up
    output never goes to memory); None where the shape has no such pass (N/16 odd)."""
    if panels.dtype != torch.bfloat16:
        return None
    lib, _ = _library()
    n, k, rows = _panel_operands(x, panels)
    if not rows.shape[0]:
        return None
    out = torch.empty(rows.shape[0], n // 2, dtype=torch.bfloat16)
    if lib.hm_linear_silu_bf16(rows.data_ptr(), rows.stride(0), rows.shape[0], panels.data_ptr(),
                               n, k, out.data_ptr(), out.stride(0), torch.get_num_threads(),
                               native.AMX_MIN_ROWS):  # fmt: skip
        return None
    return out.reshape(*x.shape[:-1], n // 2)


def linear_panels(
    x: torch.Tensor, panels: torch.Tensor, add_to: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] times the packed weight's transpose: [..., N] in the panels' dtype (fp32 or
    bf16; x is taken in that dtype); with `add_to` (that dtype, [R, N], unit stride along a
    row) that product is added into it in place, and it is returned."""
    lib, _ = _library()
    n, k, rows = _panel_operands(x, panels)
    dtype = panels.dtype
    if add_to is None:
        out = torch.empty(rows.shape[0], n, dtype=dtype)
    else:
        out = add_to
        if out.dtype != dtype or out.shape != (rows.shape[0], n) or out.stride(1) != 1:
            raise ValueError(f"linear: cannot add into {out.dtype} {list(out.shape)}")
    if rows.shape[0]:
        args = (
            rows.data_ptr(), rows.stride(0), rows.shape[0], panels.data_ptr(), n, k,
            out.data_ptr(), out.stride(0), add_to is not None, torch.get_num_threads(),
        )  # fmt: skip
        if dtype == torch.bfloat16:
            failed = lib.hm_linear_bf16(*args, native.AMX_MIN_ROWS)
        else:
            failed = lib.hm_linear(*args)
        if failed:
            raise RuntimeError(f"linear: the kernel was built without its {dtype} path")
    return out if add_to is not None else out.reshape(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of rows x [..., D] by `weight` [D], in one pass: fp32 (weight fp32), or bf16
    (weight bf16; rounded where the reference rounds: the normalised row, then the product)."""
    lib, _ = _library()
    dtype = x.dtype if x.dtype == torch.bfloat16 else torch.float32
    rows, w = _rows(x, dtype), weight.to(dtype).contiguous()
    out = torch.empty(rows.shape, dtype=dtype)
    d = rows.shape[1]
    kernel = lib.hm_rms_norm_bf16 if dtype == torch.bfloat16 else lib.hm_rms_norm
    kernel(rows.data_ptr(), rows.stride(0), rows.shape[0], d, w.data_ptr(), eps,
           out.data_ptr(), d, torch.get_num_threads())  # fmt: skip
    return out.reshape(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up of rows [..., 2I] (gate then up), fp32 or bf16: [..., I], in one
    pass (bf16: silu rounded, then the product, as the reference's two ops)."""
    lib, _ = _library()
    dtype = gate_up.dtype if gate_up.dtype == torch.bfloat16 else torch.float32
    rows = _rows(gate_up, dtype)
    inter = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], inter, dtype=dtype)
    kernel = lib.hm_silu_mul_bf16 if dtype == torch.bfloat16 else lib.hm_silu_mul
    kernel(rows.data_ptr(), rows.stride(0), rows.shape[0], inter, out.data_ptr(), inter,
           torch.get_num_threads())  # fmt: skip
    return out.reshape(*gate_up.shape[:-1], inter)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(logits, dim=-1) of fp32 CPU rows [B, V] (the first largest, or the first
    NaN), in one pass per row; None for other tensors, or where the library is not here (the
    caller takes torch's)."""
    lib, _ = _library()
    if (
        lib is None
        or logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or not logits.numel()
    ):
        return None
    rows = _rows(logits)
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    lib.hm_argmax_f32(rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1],
                      out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, D] in place (rotate-half layout) by cos/sin [N, 1, D/2] (or [N, D/2])
    of x's dtype, fp32 or bf16; unit stride along D. Returns x."""
    lib, _ = _library()
    n, heads, d = x.shape
    c = cos.reshape(n, d // 2).contiguous()
    s = sin.reshape(n, d // 2).contiguous()
    code = 1 if x.dtype == torch.bfloat16 else 0
    lib.hm_rope(x.data_ptr(), x.stride(0), x.stride(1), n, heads, d, c.data_ptr(), s.data_ptr(),
                code, torch.get_num_threads())  # fmt: skip
    return x
