"""RoPE inverse frequencies with the checkpoint's scaling: Llama's kinds (default, linear, llama3)
and DeepSeek's YaRN over MLA's rope dims, with YaRN's softmax-scale correction."""

from __future__ import annotations

import dataclasses
import math

import torch

from model.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim/2] in fp32, with the checkpoint's scaling applied."""
    d = config.head_dim
    # on the CPU even under a meta-device build: meta arithmetic imports torch._dynamo (and
    # triton), ~100 MB resident in a server that never compiles
    steps = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (config.rope_theta ** (steps / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = (
            float(scaling.get("low_freq_factor", 1.0)),
            float(scaling.get("high_freq_factor", 4.0)),
        )
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


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
