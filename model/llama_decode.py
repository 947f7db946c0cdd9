"""LlamaModel's decode steps over the paged KV pool, one new token per sequence: over a
full-precision pool or a KIVI pool (packed blocks, then a full-precision window), on the fused
decode layers (kernels/decode_step.py) where they apply, else layer by layer from Python."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import kernels
from model.kv_pool import KVPool

if TYPE_CHECKING:
    from model.llama import LlamaLayer, LlamaModel


def build_fused_layers(model: LlamaModel) -> kernels.DecodeLayers | None:
    """The fused decode layers over `model`'s weights as they lie now; None where the weights
    have no fused path."""
    c = model.config
    return kernels.DecodeLayers.build(
        [
            kernels.LayerWeights(
                layer.input_norm, layer.qkv_proj, layer.o_proj, layer.post_norm,
                layer.gate_up_proj, layer.down_proj,
            )  # fmt: skip
            for layer in model.layers
        ],
        c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
        c.rms_norm_eps, model.scale,
    )  # fmt: skip


def _fused_step(
    model: LlamaModel,
    fused: kernels.DecodeLayers,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    pool: KVPool,
    tables: torch.Tensor,
    pool_positions: torch.Tensor,
    kivi: kernels.KiviBlocks | None = None,
) -> torch.Tensor:
    """One decode step on the fused layers: each token's KV written at pool_positions of its
    table's blocks in `pool` (a full-precision pool, or a KIVI pool's window after its
    packed blocks `kivi`), rotated for its position in the sequence; fp32 logits."""
    cos, sin = model._rope_table(positions)
    x = model.embed(token_ids)
    # layer l's K lies pool.kv.stride(1) elements after layer l-1's (full layout)
    fused.run(x, pool.layer_kv(0), pool.kv.stride(1), tables, pool_positions, cos, sin, kivi)
    return model._logits(x)


def _attention_out(layer: LlamaLayer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The residual stream after one layer, given its attention [B, heads, head_dim]."""
    b, c = x.shape[0], layer.config
    kernels.linear_add_(x, attn.reshape(b, c.q_size).to(x.dtype), layer.o_proj)
    return layer.mlp(x)


def decode(
    model: LlamaModel,
    token_ids: torch.Tensor,
    pool: KVPool,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """LlamaModel.decode: fp32 logits [B, vocab]."""
    bs, device = pool.block_size, model.device
    token_ids = token_ids.to(device=device, dtype=torch.long)
    positions = positions.to(device=device, dtype=torch.long)
    block_tables = block_tables.to(device=device, dtype=torch.int32)
    fused = model._decode_layers(pool)
    if fused is not None:
        return _fused_step(model, fused, token_ids, positions, pool, block_tables, positions)
    slot_block = block_tables.gather(1, (positions // bs)[:, None]).squeeze(1).long()
    slot_off = positions % bs
    seq_lens = (positions + 1).to(torch.int32)

    rope = model._rope_table(positions)
    x = model.embed(token_ids)
    for li, layer in enumerate(model.layers):
        q, k, v = layer.qkv(x, rope)
        k_cache, v_cache = pool.layer_kv(li)
        k_cache[slot_block, slot_off] = k.to(pool.dtype)
        v_cache[slot_block, slot_off] = v.to(pool.dtype)
        attn = kernels.paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, model.scale
        )
        x = _attention_out(layer, x, attn)
    return model._logits(x)


def decode_kivi(
    model: LlamaModel,
    token_ids: torch.Tensor,
    pool,
    packed_tables: torch.Tensor,
    packed_lens: torch.Tensor,
    window_tables: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """LlamaModel.decode_kivi: fp32 logits [B, vocab]."""
    bs, device = pool.block_size, model.device
    token_ids = token_ids.to(device=device, dtype=torch.long)
    positions = positions.to(device=device, dtype=torch.long)
    packed_tables = packed_tables.to(device=device, dtype=torch.int32)
    packed_lens = packed_lens.to(device=device, dtype=torch.int32)
    window_tables = window_tables.to(device=device, dtype=torch.int32)
    in_window = positions - packed_lens.long()
    window = pool.window
    fused = model._decode_layers(window)
    if fused is not None:
        packed = kernels.KiviBlocks(
            pool.packed_layers[0], pool.packed.kv.stride(1), packed_tables, packed_lens
        )
        return _fused_step(
            model, fused, token_ids, positions, window, window_tables, in_window, packed
        )
    slot_block = window_tables.gather(1, (in_window // bs)[:, None]).squeeze(1).long()
    slot_off = in_window % bs
    window_lens = (in_window + 1).to(torch.int32)

    rope = model._rope_table(positions)
    x = model.embed(token_ids)
    for li, layer in enumerate(model.layers):
        q, k, v = layer.qkv(x, rope)
        k_win, v_win = window.layer_kv(li)
        k_win[slot_block, slot_off] = k.to(window.dtype)
        v_win[slot_block, slot_off] = v.to(window.dtype)
        attn = kernels.paged_decode_attention_kivi_window(
            q,
            pool.packed_layers[li],
            packed_tables,
            packed_lens,
            k_win,
            v_win,
            window_tables,
            window_lens,
            model.scale,
        )
        x = _attention_out(layer, x, attn)
    return model._logits(x)
