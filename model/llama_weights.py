"""LlamaModel's weights: in and out of HF's LlamaForCausalLM naming (for loaders and exporters),
and in oneDNN's packed layout (kernels/packed_linear.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

import kernels

if TYPE_CHECKING:
    from model.llama import LlamaModel

# A layer's projection weights, the ones prepack packs.
PACKED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def prepack(model: LlamaModel, form: str) -> None:
    """Swap every projection and the LM head of `model` for a packed copy (LlamaModel.
    prepack_weights, which checks the device and dtype have a packed path)."""
    with torch.no_grad():
        # (module, attribute) of each weight still plain, in the order a step reads them
        todo = [
            (layer, name)
            for layer in model.layers
            for name in PACKED_PROJECTIONS
            if not kernels.is_packed(getattr(layer, name))
        ]
        if model.lm_head is not None and not kernels.is_packed(model.lm_head):
            todo.append((model, "lm_head"))
        # each packed weight takes its plain one's place at once (prepack_many lets go of
        # it), so the load never holds two copies of the weights
        plain = [getattr(m, name) for m, name in todo]
        for (module, name), weight in zip(todo, kernels.prepack_many(plain, form)):
            setattr(module, name, nn.Parameter(weight, False))
        if model.lm_head is None and model.packed_head is None:
            # "auto" packs a tied head in panels whatever it picks for the projections: the
            # head multiplies a few rows (decode steps, prefill's last tokens), where panels
            # are the fastest form, and panels double as the embedding
            head_form = "panels" if form == "auto" else form
            (model.packed_head,) = kernels.prepack_many([model.embed_tokens], head_form)
            if not model.packed_head.is_mkldnn:  # panels: lookups read them (embed)
                model.embed_tokens = None


def load_hf_state_dict(model: LlamaModel, sd: Mapping[str, torch.Tensor]) -> None:
    """Copy weights named as in HF's LlamaForCausalLM (q/k/v and gate/up are fused here)."""
    missing = []

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            missing.append(name)
            return torch.empty(0)
        return sd[name]

    with torch.no_grad():
        _copy(model.embed_tokens, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        _copy(model.norm, take("model.norm.weight"), "model.norm.weight")
        if model.lm_head is not None:
            _copy(model.lm_head, take("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            parts = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            gate_up = [take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
            if missing:
                break
            _copy(
                layer.input_norm, take(p + "input_layernorm.weight"), p + "input_layernorm.weight"
            )
            _copy(layer.qkv_proj, torch.cat(parts), p + "self_attn.qkv")
            _copy(layer.o_proj, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            _copy(
                layer.post_norm,
                take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm.weight",
            )
            _copy(layer.gate_up_proj, torch.cat(gate_up), p + "mlp.gate_up")
            _copy(layer.down_proj, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
    if missing:
        raise ValueError(
            f"checkpoint lacks tensors: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}"
        )


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"tensor {name}: shape {tuple(value.shape)} does not match the config's "
            f"{tuple(param.shape)}"
        )
    param.copy_(value)


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The weights named as in HF's LlamaForCausalLM (fp32 copies), packed ones unpacked."""
    c = model.config
    embed = model.embed_tokens
    if embed is None:  # a tied head in panels holds the embedding
        embed = kernels.unpack(model.packed_head)
    sd = {"model.embed_tokens.weight": embed, "model.norm.weight": model.norm}
    if model.lm_head is not None:
        sd["lm_head.weight"] = kernels.unpack(model.lm_head)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = kernels.unpack(layer.qkv_proj).split([c.q_size, c.kv_size, c.kv_size])
        gate, up = kernels.unpack(layer.gate_up_proj).split([c.intermediate_size] * 2)
        sd.update(
            {
                p + "input_layernorm.weight": layer.input_norm,
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": kernels.unpack(layer.o_proj),
                p + "post_attention_layernorm.weight": layer.post_norm,
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": kernels.unpack(layer.down_proj),
            }
        )
    return {k: v.detach().float().contiguous().clone() for k, v in sd.items()}
