"""The DeepSeek-V2 family decoder (multi-head latent attention, DeepSeekMoE) with a paged latent
KV cache: `prefill` (a prompt or its continuation) and batched `decode`, as `LlamaModel`.

MLA caches one row per token and layer, `[c_kv | k_rope]` (kernels.MlaKVLayout): the normalised
latent of `kv_a_proj_with_mqa` and the rotated RoPE key all heads share. Prefill attends in the
non-absorbed form (the latent up-projected by `kv_b_proj` to per-head no-RoPE keys and values);
decode in the absorbed form: the key up-projection is folded into the query and the value
up-projection applied after attention, so a decode step reads only the latent rows
(kernels.paged_mla_decode_attention).

Here the parameters and the entry points; MLA in model/mla.py, the feed-forward in model/moe.py,
HF naming in model/deepseek_weights.py, RoPE's YaRN in model/rope.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from model import deepseek_weights, mla, moe
from model.config import ModelConfig
from model.kv_pool import KVPool
from model.mla import LATENT_NORM_EPS as LATENT_NORM_EPS  # re-exported: its home before the split
from model.mla import absorbed_decode_attention
from model.moe import route as route  # re-exported: its home before the split
from model.ops import rms_norm
from model.prefill_plan import plan_sequence
from model.rope import mla_rope, mla_softmax_scale


class DeepseekLayer(nn.Module):
    """One decoder layer. The hidden state's two low-rank projections (the query's, or the full
    q_proj without q_lora_rank, and kv_a_proj_with_mqa) are one matmul; gate and up are fused."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c, h = config, config.hidden_size
        q_out = c.num_heads * c.head_dim
        self.input_norm = nn.Parameter(torch.ones(h))
        a_out = (c.q_lora_rank or q_out) + c.kv_lora_rank + c.qk_rope_head_dim
        self.qkv_a_proj = nn.Parameter(torch.empty(a_out, h))
        self.q_a_norm = nn.Parameter(torch.ones(c.q_lora_rank)) if c.q_lora_rank else None
        self.q_b_proj = nn.Parameter(torch.empty(q_out, c.q_lora_rank)) if c.q_lora_rank else None
        self.kv_a_norm = nn.Parameter(torch.ones(c.kv_lora_rank))
        # rows per head: qk_nope_head_dim key rows, then v_head_dim value rows
        self.kv_b_proj = nn.Parameter(
            torch.empty(c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        )
        self.o_proj = nn.Parameter(torch.empty(h, c.num_heads * c.v_head_dim))
        self.post_norm = nn.Parameter(torch.ones(h))
        self.is_moe = config.is_moe_layer(layer)
        # A dense layer holds gate_up_proj and down_proj; a MoE layer the router, the routed
        # experts stacked [n_routed_experts, ...] and the shared experts fused into one MLP.
        self.gate_up_proj = self.down_proj = None
        self.router = self.router_bias = self.experts_gate_up = self.experts_down = None
        self.shared_gate_up = self.shared_down = None
        if not self.is_moe:
            self.gate_up_proj = nn.Parameter(torch.empty(2 * c.intermediate_size, h))
            self.down_proj = nn.Parameter(torch.empty(h, c.intermediate_size))
            return
        e, m = c.n_routed_experts, c.moe_intermediate_size
        self.router = nn.Parameter(torch.empty(e, h))
        if c.topk_method == "noaux_tc":
            self.router_bias = nn.Parameter(torch.zeros(e))
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * m, h))
        self.experts_down = nn.Parameter(torch.empty(e, h, m))
        if c.n_shared_experts:
            self.shared_gate_up = nn.Parameter(torch.empty(2 * m * c.n_shared_experts, h))
            self.shared_down = nn.Parameter(torch.empty(h, m * c.n_shared_experts))


class DeepseekModel(nn.Module):
    """RMSNorm, MLA with decoupled RoPE, dense SwiGLU then DeepSeekMoE layers; tied or untied
    embeddings. Same entry points as `LlamaModel`, over a pool in `config.kv_layout`
    (MlaKVLayout); prefill plans its sequences as it does (model/prefill_plan.py)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if not config.is_mla:
            raise ValueError("DeepseekModel needs an MLA config (kv_lora_rank > 0)")
        self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DeepseekLayer(config, i) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        )
        inv_freq, self.rope_mscale = mla_rope(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = mla_softmax_scale(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def decode_graph_safe(self) -> bool:
        """A CUDA graph can capture `decode` when no layer routes to experts: routing reads
        each expert's token count on the host (model/cuda_graphs.py)."""
        return not any(layer.is_moe for layer in self.layers)

    def _apply(self, fn, recurse=True):
        # The router's weight and score bias stay fp32 whatever the model dtype, as transformers
        # keeps them (_keep_in_fp32_modules_strict): expert choice is discrete, and a rounded
        # score can pick another expert.
        keep = [
            (layer, name, getattr(layer, name).detach().clone())
            for layer in self.layers
            for name in ("router", "router_bias")
            if getattr(layer, name) is not None and getattr(layer, name).dtype == torch.float32
        ]
        super()._apply(fn, recurse)
        for layer, name, fp32 in keep:
            param = getattr(layer, name)
            # a meta model cast stays fp32 on meta (model/loader.py casts before giving storage)
            if param.dtype != torch.float32 and param.is_meta == fp32.is_meta:
                param.data = fp32.to(param.device)
        return self

    # ---- weights in HF naming (model/deepseek_weights.py), for loaders and exporters ----

    def load_hf_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Copy weights named as in HF's DeepseekV2ForCausalLM / DeepseekV3ForCausalLM. Tensors
        it does not name (V3's multi-token-prediction layers past num_layers) are ignored."""
        deepseek_weights.load_hf_state_dict(self, sd)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights named as in HF's DeepseekV2ForCausalLM / V3 (fp32 copies)."""
        return deepseek_weights.hf_state_dict(self)

    # ---- forward pieces ----

    def _rope_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [N, 1, rope_dim/2] for positions [N], in fp32 then the model dtype, scaled
        by YaRN's attention factor."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos() * self.rope_mscale, freqs.sin() * self.rope_mscale
        return cos.to(self.dtype)[:, None, :], sin.to(self.dtype)[:, None, :]

    def _absorbed_attention(
        self,
        layer: DeepseekLayer,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Decode attention [B, H * v_head_dim] of one layer, absorbed (reading only latent
        rows: absorbed_decode_attention)."""
        c = self.config
        out = absorbed_decode_attention(
            q_nope, q_rope, layer.kv_b_proj, c.v_head_dim, cache, block_tables, seq_lens,
            self.scale,
        )  # fmt: skip
        return out.reshape(q_nope.shape[0], c.num_heads * c.v_head_dim)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.embed_tokens if self.lm_head is None else self.lm_head).float()

    def _check_pool(self, pool: KVPool) -> None:
        if not isinstance(pool.layout, kernels.MlaKVLayout):
            raise ValueError(
                f"DeepseekModel needs a pool in the MLA layout, got {pool.layout.fingerprint_id}"
            )

    # ---- entry points ----

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: torch.Tensor,
        pool: KVPool,
        block_table: list[int],
        start_pos: int = 0,
        on_layer_done: Callable[[int], None] | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Compute positions [start_pos, start_pos+T), the latent rows of [0, start_pos) being in
        the pool already.

        Writes the new rows into the pool at the slots `block_table` names; returns fp32 logits
        [T, vocab] ([1, vocab] with last_only). on_layer_done(l) runs after layer l's rows are
        written.
        """
        return self.prefill_batch(
            [(token_ids, block_table, start_pos)], pool, on_layer_done, last_only=last_only
        )[0]

    @torch.inference_mode()
    def prefill_batch(
        self,
        seqs: Sequence[tuple[torch.Tensor, list[int], int]],
        pool: KVPool,
        on_layer_done: Callable[[int], None] | None = None,
        *,
        last_only: bool = True,
    ) -> list[torch.Tensor]:
        """`prefill` of several sequences (token_ids, block_table, start_pos) in one forward;
        last-position fp32 logits [1, vocab] each (every position's [T, vocab] with
        last_only=False).

        The projections and feed-forward run once over all new tokens; attention runs per
        sequence. on_layer_done(l) runs after layer l's rows of every sequence are written.
        """
        self._check_pool(pool)
        c = self.config
        plans = [plan_sequence(self, ids, pool, table, start) for ids, table, start in seqs]
        if not plans:
            return []
        bounds = torch.tensor([0] + [p.token_ids.numel() for p in plans]).cumsum(0).tolist()
        slot_block = torch.cat([p.slot_block for p in plans])
        slot_off = torch.cat([p.slot_off for p in plans])
        rope = self._rope_table(torch.cat([p.positions for p in plans]))
        x = self.embed_tokens[torch.cat([p.token_ids for p in plans])]
        for li, layer in enumerate(self.layers):
            q_nope, q_rope, latent = mla.project(c, layer, x, rope)
            cache = pool.layer_kv(li)
            cache[slot_block, slot_off] = latent.to(pool.dtype)
            if on_layer_done is not None:
                on_layer_done(li)
            attn = torch.cat(
                [
                    mla.attend(
                        c, self.scale, layer, p, q_nope[s:e], q_rope[s:e], latent[s:e], cache
                    )
                    for p, s, e in zip(plans, bounds[:-1], bounds[1:])
                ]
            )
            x = x + F.linear(attn, layer.o_proj)
            x = moe.ffn(c, layer, x)
        if not last_only:
            return list(self._logits(x).split([e - s for s, e in zip(bounds[:-1], bounds[1:])]))
        logits = self._logits(x[torch.tensor(bounds[1:]) - 1])
        return list(logits.split(1))

    @torch.inference_mode()
    def decode(
        self,
        token_ids: torch.Tensor,
        pool: KVPool,
        block_tables: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """One new token per sequence at positions[i] (its latent row written there), attending
        over [0, pos] in the absorbed form; fp32 logits [B, vocab]."""
        self._check_pool(pool)
        c, bs = self.config, pool.block_size
        token_ids = token_ids.to(device=self.device, dtype=torch.long)
        positions = positions.to(device=self.device, dtype=torch.long)
        block_tables = block_tables.to(device=self.device, dtype=torch.int32)
        slot_block = block_tables.gather(1, (positions // bs)[:, None]).squeeze(1).long()
        slot_off = positions % bs
        seq_lens = (positions + 1).to(torch.int32)

        rope = self._rope_table(positions)
        x = self.embed_tokens[token_ids]
        for li, layer in enumerate(self.layers):
            q_nope, q_rope, latent = mla.project(c, layer, x, rope)
            cache = pool.layer_kv(li)
            cache[slot_block, slot_off] = latent.to(pool.dtype)
            attn = self._absorbed_attention(layer, q_nope, q_rope, cache, block_tables, seq_lens)
            x = x + F.linear(attn.to(x.dtype), layer.o_proj)
            x = moe.ffn(c, layer, x)
        return self._logits(x)
