"""A Llama-family decode step's decoder layers in one C call (csrc/decode_step.c).

Why: every step of a layer is already one C pass, but driving them from Python cost a layer ~40
tensor ops and 8 ctypes calls (views, dtype checks, temporaries, an index_put per K and V); at
SmolLM2's size that was about a third of a batch-16 step. `DecodeLayers` holds the weights'
pointers once; each `run` passes the step's tables, positions and rotary table, and the C side
chains the same kernels over buffers allocated once per step, so the residual stream it returns
is the layer-by-layer path's bits.

Where it applies (`DecodeLayers.build` says None otherwise, and the model keeps its Python
path): CPU, the library built, every projection in panels of one dtype (fp32 or bf16), a
full-precision pool of that dtype whose K and V views have unit stride along head_dim.

The object keeps references to the weights it points at (so the memory stays valid); a model
that swaps a weight for another tensor builds a new one (`LlamaModel` does so in
`prepack_weights` and `_apply`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernels import native
from kernels.kivi import KiviPacked
from kernels.native_attention import kivi_args
from kernels.native_build import _library

_c_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
_STEP_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class _Shape(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i32), ("hidden", _i32), ("q_heads", _i32), ("kv_heads", _i32),
        ("head_dim", _i32), ("inter", _i32), ("eps", _f32), ("scale", _f32),
    ]  # fmt: skip


class _Pool(ctypes.Structure):
    _fields_ = [
        ("k0", _c_ptr), ("num_blocks", _i64), ("blk_stride", _i64), ("layer_stride", _i64),
        ("kv_offset", _i64), ("tok_stride", _i64), ("head_stride", _i64), ("block_size", _i32),
    ]  # fmt: skip


class _Kivi(ctypes.Structure):
    _fields_ = [
        ("ptr0", _c_ptr), ("blk_bytes", _c_ptr), ("layer_bytes", _i64), ("num_blocks", _i64),
        ("bits", _i32), ("gk", _i32), ("vg", _i32), ("gv", _i32), ("block_size", _i32),
        ("tables", _c_ptr), ("table_cols", _i64), ("lens", _c_ptr),
    ]  # fmt: skip


class KiviBlocks(NamedTuple):
    """A KIVI pool's packed part for `DecodeLayers.run`: each sequence attends over its packed
    tokens, then over its full-precision window (the `layer_kv` pool)."""

    layer0: KiviPacked  # layer 0's fields, leading num_blocks dim (KiviKVLayout.layer_views)
    layer_bytes: int  # bytes from one layer's fields to the next's
    tables: torch.Tensor  # [B, cols] int32: each sequence's packed blocks
    lens: torch.Tensor  # [B] int32: its packed tokens


class _Scratch(ctypes.Structure):
    _fields_ = [(name, _c_ptr) for name in ("h", "qkv", "qf", "attn_f", "lse", "attn", "gu", "act")]


class LayerWeights(NamedTuple):
    """One decoder layer's weights as the fused step takes them."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # panels of [q_size + 2 kv_size, hidden]
    o: torch.Tensor  # panels of [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # panels of [2 inter, hidden]
    down: torch.Tensor  # panels of [hidden, inter]


class DecodeLayers:
    """The layers of one model, ready for `run`; construct through `build`."""

    def __init__(self, layers, dtype, hidden, q_heads, kv_heads, head_dim, inter, eps, scale):
        self._layers = list(layers)  # kept alive: the pointer table below names their memory
        self.dtype = dtype
        self.hidden, self.q_heads, self.kv_heads = hidden, q_heads, kv_heads
        self.head_dim, self.inter = head_dim, inter
        self._shape = _Shape(len(self._layers), hidden, q_heads, kv_heads, head_dim, inter,
                             eps, scale)  # fmt: skip
        ptrs = [t.data_ptr() for layer in self._layers for t in layer]
        self._ptrs = (_c_ptr * len(ptrs))(*ptrs)

    @classmethod
    def build(
        cls,
        layers: Sequence[LayerWeights],
        hidden: int,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        inter: int,
        eps: float,
        scale: float,
    ) -> DecodeLayers | None:
        """The fused layers, or None where they do not apply (module docstring)."""
        if not layers or not native.native_status().available:
            return None
        dtype = layers[0].qkv.dtype
        if dtype not in _STEP_DTYPES:
            return None
        if dtype == torch.bfloat16 and not native.bf16_rows_supported():
            return None
        q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
        shapes = LayerWeights(
            (hidden,), (q_size + 2 * kv_size, hidden), (hidden, q_size), (hidden,),
            (2 * inter, hidden), (hidden, inter),
        )  # fmt: skip
        for layer in layers:
            for t, want in zip(layer, shapes):
                if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
                    return None
                if len(want) == 2:
                    if t.dim() != 3 or native.panels_shape(t) != want:
                        return None
                elif tuple(t.shape) != want:
                    return None
        return cls(layers, dtype, hidden, q_heads, kv_heads, head_dim, inter, eps, scale)

    def fits_pool(self, k0: torch.Tensor, v0: torch.Tensor) -> bool:
        """Whether layer 0's K/V views [num_blocks, block_size, kv_heads, head_dim] of a pool are
        ones `run` reads: this dtype, unit stride along head_dim, equal strides, block size up to
        the attention kernel's."""
        return (
            k0.dtype == v0.dtype == self.dtype
            and k0.device.type == "cpu"
            and k0.stride() == v0.stride()
            and k0.stride(3) == 1
            and tuple(k0.shape[2:]) == (self.kv_heads, self.head_dim)
            and k0.shape[1] <= native.MAX_BLOCK_SIZE
        )

    def run(
        self,
        x: torch.Tensor,
        layer_kv: tuple[torch.Tensor, torch.Tensor],
        layer_stride: int,
        block_tables: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kivi: KiviBlocks | None = None,
    ) -> torch.Tensor:
        """Every layer over x [B, hidden] (contiguous, this dtype; updated in place and returned),
        each new token's K/V written at positions[b] of its table's blocks: layer_kv is layer 0's
        (K, V) views (`fits_pool`), layer l's lying `layer_stride` elements further on;
        block_tables [B, cols] int32, positions [B] int64, cos/sin [B, head_dim/2] this dtype
        (for each token's position in its sequence). With `kivi`, the pool is each sequence's
        window, attended after its packed blocks. IndexError (nothing written) where a position
        or a table entry falls outside its pool."""
        lib, _ = _library()
        k0, v0 = layer_kv
        batch = x.shape[0]
        num_blocks, block_size = k0.shape[0], k0.shape[1]
        elt = k0.element_size()
        tables = block_tables.to(torch.int32).contiguous()
        positions = positions.to(torch.int64).contiguous()
        if x.dtype != self.dtype or x.shape != (batch, self.hidden) or not x.is_contiguous():
            raise ValueError(f"decode layers take x [{batch}, {self.hidden}] {self.dtype}")
        if tables.shape[0] != batch or positions.shape != (batch,):
            raise ValueError(
                f"{batch} rows, {tables.shape[0]} tables, {positions.numel()} positions"
            )
        lens = (positions + 1).to(torch.int32)
        d, q_size = self.head_dim, self.q_heads * self.head_dim
        qkv_n = q_size + 2 * self.kv_heads * d
        f32 = torch.float32
        empty = lambda *shape, dtype=self.dtype: torch.empty(shape, dtype=dtype)  # noqa: E731
        scratch = (
            empty(batch, self.hidden), empty(batch, qkv_n), empty(batch, q_size, dtype=f32),
            empty(batch, q_size, dtype=f32), empty(batch, self.q_heads, dtype=f32),
            empty(batch, q_size), empty(batch, 2 * self.inter), empty(batch, self.inter),
        )  # fmt: skip
        pool = _Pool(
            k0.data_ptr(), num_blocks, k0.stride(0), layer_stride,
            (v0.data_ptr() - k0.data_ptr()) // elt, k0.stride(1), k0.stride(2), block_size,
        )  # fmt: skip
        kivi_arg = None
        if kivi is not None:
            a = kivi_args(kivi.layer0)
            k_tables = kivi.tables.to(torch.int32).contiguous()
            k_lens = kivi.lens.to(torch.int32).contiguous()
            if k_tables.shape[0] != batch or k_lens.shape != (batch,):
                raise ValueError(f"{batch} rows, {k_tables.shape[0]} packed tables")
            if a.block_size > native.MAX_BLOCK_SIZE or a.kv_heads != self.kv_heads:
                raise ValueError("packed blocks do not fit the fused attention")
            kivi_arg = ctypes.byref(_Kivi(
                ctypes.cast(a.ptrs, _c_ptr), ctypes.cast(a.strides, _c_ptr), kivi.layer_bytes,
                a.num_blocks, a.bits, a.gk, a.vg, a.gv, a.block_size, k_tables.data_ptr(),
                k_tables.shape[1], k_lens.data_ptr(),
            ))  # fmt: skip
        cos = cos.reshape(batch, d // 2).contiguous()
        sin = sin.reshape(batch, d // 2).contiguous()
        failed = lib.hm_llama_decode_layers(
            _STEP_DTYPES[self.dtype], ctypes.byref(self._shape), self._ptrs, ctypes.byref(pool),
            tables.data_ptr(), tables.shape[1], positions.data_ptr(), lens.data_ptr(), batch,
            cos.data_ptr(), sin.data_ptr(), x.data_ptr(),
            ctypes.byref(_Scratch(*(t.data_ptr() for t in scratch))), kivi_arg,
            torch.get_num_threads(), native.AMX_MIN_ROWS,
        )  # fmt: skip
        if failed > 0:
            raise IndexError(
                f"sequence {failed - 1}: position {int(positions[failed - 1])} or a block "
                f"table names a block outside its pool"
            )
        if failed == -1:
            raise MemoryError("fused decode attention could not allocate its per-sequence state")
        if failed:
            raise RuntimeError(f"the kernels were built without their {self.dtype} path")
        return x
