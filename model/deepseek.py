"""The DeepSeek-V2 family decoder (multi-head latent attention, DeepSeekMoE) with a paged latent
KV cache: `prefill` (a prompt or its continuation) and batched `decode`, as `LlamaModel`.

MLA caches one row per token and layer, `[c_kv | k_rope]` (kernels.MlaKVLayout): the normalised
latent of `kv_a_proj_with_mqa` and the rotated RoPE key all heads share. Prefill attends in the
non-absorbed form (the latent up-projected by `kv_b_proj` to per-head no-RoPE keys and values);
decode in the absorbed form: the key up-projection is folded into the query and the value
up-projection applied after attention, so a decode step reads only the latent rows
(kernels.paged_mla_decode_attention).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from model.config import ModelConfig
from model.kv_pool import KVPool
from model.llama import LlamaModel, _heads_first, _rms_norm, _SeqPlan, rope_inv_freq

# q_a_layernorm and kv_a_layernorm use RMSNorm's default eps, not rms_norm_eps, in DeepSeek's own
# code and in transformers.
LATENT_NORM_EPS = 1e-6


# ---- RoPE with the checkpoint's scaling (YaRN included) and the softmax scale ----


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_rope(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [qk_rope_head_dim / 2] fp32, the factor cos and sin are scaled by).

    YaRN as transformers' `_compute_yarn_parameters` (DeepSeek's own YaRN rotary embedding):
    frequencies blended between interpolated and extrapolated by a linear ramp over the
    correction range, cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim).
    Other kinds are Llama's (`rope_inv_freq`), over the rope dims only.
    """
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    dim, base = config.qk_rope_head_dim, config.rope_theta
    if kind != "yarn":
        # Llama's rope over the rope dims: a plain config whose head is those dims
        rope_only = dataclasses.replace(config, head_dim=dim, kv_lora_rank=0, n_routed_experts=0)
        return rope_inv_freq(rope_only), 1.0
    old_len = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = scaling.get("factor") or config.max_position_embeddings / old_len
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    interpolated = extrapolated / factor
    return interpolated * ramp + extrapolated * (1 - ramp), float(attention_factor)


def mla_softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk_nope + qk_rope head dim), times mscale(factor, mscale_all_dim)^2 under a scaled
    RoPE that names mscale_all_dim (DeepSeek's YaRN softmax correction)."""
    scale = config.head_dim**-0.5
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default" and scaling.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"]) ** 2
    return scale


# ---- MoE routing ----


def route(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's gating of hidden states h [N, hidden]: (weights fp32 [N, k], expert ids
    [N, k]), with scoring (softmax or sigmoid), the score-correction bias that only chooses
    (V3), group-limited choice (the best `topk_group` of `n_group` groups, a group scored by its
    best expert, or its best two for noaux_tc), renormalisation and the routed scaling factor."""
    c = config
    logits = F.linear(h.float(), weight.float())
    scores = logits.softmax(dim=-1) if c.scoring_func == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if c.topk_method != "greedy" and c.n_group > 1:
        grouped = choice.view(h.shape[0], c.n_group, -1)
        if c.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        kept = group_scores.topk(c.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * c.routed_scaling_factor, ids


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


# ---- the model ----


def absorbed_decode_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_b_proj: torch.Tensor,
    v_head_dim: int,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode step's MLA attention [B, H, v_head_dim] reading only latent rows: the key
    up-projection W_uk folded into the query (q_latent = q_nope W_uk, per head), attention over
    the rows (kernels.paged_mla_decode_attention), then the value up-projection W_uv applied to
    the attended latent. kv_b_proj [H * (qk_nope + v_head_dim), kv_lora_rank], rows per head:
    the key's, then the value's (the checkpoint's layout)."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    w = kv_b_proj.view(heads, nope + v_head_dim, kv_b_proj.shape[1])
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, rank]
    out_latent = kernels.paged_mla_decode_attention(
        q_latent, q_rope, cache, block_tables, seq_lens, scale
    )
    o = out_latent.to(q_nope.dtype)
    if o.dtype == torch.float32:
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    # W_uv (x) o^T, the weight as it lies: torch's 16-bit CPU bmm of o by W_uv's transpose (a
    # strided view of kv_b_proj) took 0.54 ms at DeepSeek-V2-Lite's shapes (16 heads, 512 x
    # 128), this 0.15 ms, the same numbers; in fp32 this is the slower of the two
    return torch.bmm(w_uv, o.permute(1, 2, 0)).permute(2, 0, 1)


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
    (MlaKVLayout)."""

    # Prefill planning (positions, slots, causal mask) and token checks are the Llama model's:
    # same pool, same block tables, same rules.
    _plan = LlamaModel._plan
    _check_tokens = LlamaModel._check_tokens

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

    # ---- weights in HF naming (DeepseekV2ForCausalLM / V3), for loaders and exporters ----

    def _hf_views(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each HF tensor name with the view of our parameter that holds it (fused projections
        split back, experts one by one as checkpoints store them)."""
        c = self.config
        yield "model.embed_tokens.weight", self.embed_tokens
        yield "model.norm.weight", self.norm
        if self.lm_head is not None:
            yield "lm_head.weight", self.lm_head
        q_rows = c.q_lora_rank or c.num_heads * c.head_dim
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            yield p + "input_layernorm.weight", layer.input_norm
            q_name = "q_a_proj.weight" if c.q_lora_rank else "q_proj.weight"
            yield a + q_name, layer.qkv_a_proj[:q_rows]
            yield a + "kv_a_proj_with_mqa.weight", layer.qkv_a_proj[q_rows:]
            if c.q_lora_rank:
                yield a + "q_a_layernorm.weight", layer.q_a_norm
                yield a + "q_b_proj.weight", layer.q_b_proj
            yield a + "kv_a_layernorm.weight", layer.kv_a_norm
            yield a + "kv_b_proj.weight", layer.kv_b_proj
            yield a + "o_proj.weight", layer.o_proj
            yield p + "post_attention_layernorm.weight", layer.post_norm
            if not layer.is_moe:
                yield from _swiglu_views(m, layer.gate_up_proj, layer.down_proj)
                continue
            yield m + "gate.weight", layer.router
            if layer.router_bias is not None:
                yield m + "gate.e_score_correction_bias", layer.router_bias
            for e in range(c.n_routed_experts):
                yield from _swiglu_views(
                    f"{m}experts.{e}.", layer.experts_gate_up[e], layer.experts_down[e]
                )
            if layer.shared_gate_up is not None:
                yield from _swiglu_views(
                    m + "shared_experts.", layer.shared_gate_up, layer.shared_down
                )

    def load_hf_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Copy weights named as in HF's DeepseekV2ForCausalLM / DeepseekV3ForCausalLM. Tensors
        it does not name (V3's multi-token-prediction layers past num_layers) are ignored."""
        views = list(self._hf_views())
        missing = [name for name, _ in views if name not in sd]
        if missing:
            raise ValueError(
                f"checkpoint lacks tensors: {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}"
            )
        with torch.no_grad():
            for name, view in views:
                if tuple(sd[name].shape) != tuple(view.shape):
                    raise ValueError(
                        f"tensor {name}: shape {tuple(sd[name].shape)} does not match the "
                        f"config's {tuple(view.shape)}"
                    )
                view.copy_(sd[name])

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights named as in HF's DeepseekV2ForCausalLM / V3 (fp32 copies)."""
        return {name: v.detach().float().contiguous().clone() for name, v in self._hf_views()}

    # ---- forward pieces ----

    def _rope_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [N, 1, rope_dim/2] for positions [N], in fp32 then the model dtype, scaled
        by YaRN's attention factor."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos() * self.rope_mscale, freqs.sin() * self.rope_mscale
        return cos.to(self.dtype)[:, None, :], sin.to(self.dtype)[:, None, :]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [N, heads, rope_dim]. Interleaved checkpoints pair (x0, x1), (x2, x3), ...;
        the result is laid out de-interleaved (every pair's first then every pair's second), the
        same permutation for queries and keys, so their dot products are the checkpoint's."""
        if self.config.rope_interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _project(
        self, layer: DeepseekLayer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [N, H, qk_nope], q_rope [N, H, rope_dim] rotated, latent rows [N, kv_lora_rank
        + rope_dim]: c_kv normalised, then the rotated shared key) of hidden states x [N, hidden].
        """
        c = self.config
        n = x.shape[0]
        a = F.linear(_rms_norm(x, layer.input_norm, c.rms_norm_eps), layer.qkv_a_proj)
        q, c_kv, k_rope = a.split(
            [a.shape[1] - c.kv_lora_rank - c.qk_rope_head_dim, c.kv_lora_rank, c.qk_rope_head_dim],
            dim=-1,
        )
        if c.q_lora_rank:
            q = F.linear(_rms_norm(q, layer.q_a_norm, LATENT_NORM_EPS), layer.q_b_proj)
        q_nope, q_rope = q.reshape(n, c.num_heads, c.head_dim).split(
            [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1
        )
        c_kv = _rms_norm(c_kv.contiguous(), layer.kv_a_norm, LATENT_NORM_EPS)
        k_rope = self._rope(k_rope[:, None, :], *rope)[:, 0]
        return q_nope, self._rope(q_rope, *rope), torch.cat([c_kv, k_rope], dim=-1)

    def _expand(
        self, layer: DeepseekLayer, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [N, kv_lora_rank + rope_dim] up-projected: (keys [N, H, qk_nope + rope_dim]
        with the shared rope key in every head, values [N, H, v_head_dim])."""
        c = self.config
        n = rows.shape[0]
        kv = F.linear(rows[:, : c.kv_lora_rank], layer.kv_b_proj)
        k_nope, v = kv.view(n, c.num_heads, -1).split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_rope = rows[:, None, c.kv_lora_rank :].expand(n, c.num_heads, c.qk_rope_head_dim)
        return torch.cat([k_nope, k_rope], dim=-1), v

    def _attend(
        self,
        layer: DeepseekLayer,
        plan: _SeqPlan,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """One sequence's attention output [T, H * v_head_dim] in the non-absorbed form, its new
        latent rows being in the pool already (read back from it when a prefix is cached)."""
        c = self.config
        if plan.mask is None:
            rows = latent
        else:
            n = plan.table.numel() * cache.shape[1]
            rows = cache[plan.table].reshape(n, -1)[: plan.end].to(q_nope.dtype)
        k, v = self._expand(layer, rows)
        q = torch.cat([q_nope, q_rope], dim=-1)
        attn = F.scaled_dot_product_attention(
            _heads_first(q),
            _heads_first(k),
            _heads_first(v),
            attn_mask=plan.mask,
            is_causal=plan.mask is None,
            scale=self.scale,
        )
        return attn[0].transpose(0, 1).reshape(q.shape[0], c.num_heads * c.v_head_dim)

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

    def _ffn(self, layer: DeepseekLayer, x: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(x, layer.post_norm, self.config.rms_norm_eps)
        if not layer.is_moe:
            return x + _swiglu(h, layer.gate_up_proj, layer.down_proj)
        out = self._routed_experts(layer, h)
        if layer.shared_gate_up is not None:
            out = out + _swiglu(h, layer.shared_gate_up, layer.shared_down)
        return x + out

    def _routed_experts(self, layer: DeepseekLayer, h: torch.Tensor) -> torch.Tensor:
        """Sum over each token's top-k experts of weight * expert(h); each expert runs once over
        the tokens routed to it."""
        weights, ids = route(h, layer.router, layer.router_bias, self.config)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        weight = weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.config.n_routed_experts).tolist()
        out = torch.zeros_like(h)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            rows = token[start : start + count]
            y = _swiglu(h[rows], layer.experts_gate_up[e], layer.experts_down[e])
            out.index_add_(0, rows, (y * weight[start : start + count, None]).to(out.dtype))
            start += count
        return out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = _rms_norm(x, self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.embed_tokens if self.lm_head is None else self.lm_head).float()

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
        plans = [self._plan(ids, pool, table, start) for ids, table, start in seqs]
        if not plans:
            return []
        bounds = torch.tensor([0] + [p.token_ids.numel() for p in plans]).cumsum(0).tolist()
        slot_block = torch.cat([p.slot_block for p in plans])
        slot_off = torch.cat([p.slot_off for p in plans])
        rope = self._rope_table(torch.cat([p.positions for p in plans]))
        x = self.embed_tokens[torch.cat([p.token_ids for p in plans])]
        for li, layer in enumerate(self.layers):
            q_nope, q_rope, latent = self._project(layer, x, rope)
            cache = pool.layer_kv(li)
            cache[slot_block, slot_off] = latent.to(pool.dtype)
            if on_layer_done is not None:
                on_layer_done(li)
            attn = torch.cat(
                [
                    self._attend(layer, p, q_nope[s:e], q_rope[s:e], latent[s:e], cache)
                    for p, s, e in zip(plans, bounds[:-1], bounds[1:])
                ]
            )
            x = x + F.linear(attn, layer.o_proj)
            x = self._ffn(layer, x)
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
        bs = pool.block_size
        token_ids = token_ids.to(device=self.device, dtype=torch.long)
        positions = positions.to(device=self.device, dtype=torch.long)
        block_tables = block_tables.to(device=self.device, dtype=torch.int32)
        slot_block = block_tables.gather(1, (positions // bs)[:, None]).squeeze(1).long()
        slot_off = positions % bs
        seq_lens = (positions + 1).to(torch.int32)

        rope = self._rope_table(positions)
        x = self.embed_tokens[token_ids]
        for li, layer in enumerate(self.layers):
            q_nope, q_rope, latent = self._project(layer, x, rope)
            cache = pool.layer_kv(li)
            cache[slot_block, slot_off] = latent.to(pool.dtype)
            attn = self._absorbed_attention(layer, q_nope, q_rope, cache, block_tables, seq_lens)
            x = x + F.linear(attn.to(x.dtype), layer.o_proj)
            x = self._ffn(layer, x)
        return self._logits(x)

    def _check_pool(self, pool: KVPool) -> None:
        if not isinstance(pool.layout, kernels.MlaKVLayout):
            raise ValueError(
                f"DeepseekModel needs a pool in the MLA layout, got {pool.layout.fingerprint_id}"
            )


def _swiglu_views(
    prefix: str, gate_up: torch.Tensor, down: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    gate, up = gate_up.chunk(2)
    yield prefix + "gate_proj.weight", gate
    yield prefix + "up_proj.weight", up
    yield prefix + "down_proj.weight", down
