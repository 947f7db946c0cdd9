"""DeepseekModel's weights in and out of HF's DeepseekV2ForCausalLM / V3 naming, for loaders and
exporters: each HF name paired with the view of our parameter that holds it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model.deepseek import DeepseekModel


def hf_views(model: DeepseekModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Each HF tensor name with the view of our parameter that holds it (fused projections
    split back, experts one by one as checkpoints store them)."""
    c = model.config
    yield "model.embed_tokens.weight", model.embed_tokens
    yield "model.norm.weight", model.norm
    if model.lm_head is not None:
        yield "lm_head.weight", model.lm_head
    q_rows = c.q_lora_rank or c.num_heads * c.head_dim
    for i, layer in enumerate(model.layers):
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
            yield from _swiglu_views(m + "shared_experts.", layer.shared_gate_up, layer.shared_down)


def _swiglu_views(
    prefix: str, gate_up: torch.Tensor, down: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    gate, up = gate_up.chunk(2)
    yield prefix + "gate_proj.weight", gate
    yield prefix + "up_proj.weight", up
    yield prefix + "down_proj.weight", down


def load_hf_state_dict(model: DeepseekModel, sd: Mapping[str, torch.Tensor]) -> None:
    """Copy weights named as in HF's DeepseekV2ForCausalLM / DeepseekV3ForCausalLM. Tensors
    it does not name (V3's multi-token-prediction layers past num_layers) are ignored."""
    views = list(hf_views(model))
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


def hf_state_dict(model: DeepseekModel) -> dict[str, torch.Tensor]:
    """The weights named as in HF's DeepseekV2ForCausalLM / V3 (fp32 copies)."""
    return {name: v.detach().float().contiguous().clone() for name, v in hf_views(model)}
