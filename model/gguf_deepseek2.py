"""llama.cpp's `deepseek2` GGUF architecture (DeepSeek-V2/V2.5/V3 as llama.cpp's converter writes
them) read as the DeepSeek-V2 family: its metadata as a HF `deepseek_v2` / `deepseek_v3`
config.json (so `ModelConfig.from_hf` builds and checks the config, as for a HF directory), and its
tensors under the HF names `DeepseekModel` loads.

What the converter (convert_hf_to_gguf.py, DeepseekV2Model) changes, undone here:
- MLA is written as MQA: `attention.head_count_kv` is 1 and `attention.key_length` /
  `.value_length` are the latent widths; the per-head dims are in `.key_length_mla` /
  `.value_length_mla`. Files from before those keys hold one `attn_kv_b` (kv_b_proj as is) and
  the per-head dims in `.key_length` / `.value_length`; newer ones split kv_b_proj per head into
  `attn_k_b` (transposed: [heads, kv_lora_rank, qk_nope]) and `attn_v_b` ([heads, v, kv_lora_rank]).
  As in llama.cpp, `.key_length_mla` present means the split form.
- The routed experts are stacked per layer (`ffn_{gate,up,down}_exps`, [experts, out, in]).
- `rope.scaling.yarn_log_multiplier` is 0.1 * HF's `mscale_all_dim`, and HF's `mscale` is not
  written: llama.cpp takes it equal to mscale_all_dim (as in DeepSeek's own checkpoints), which
  leaves cos/sin unscaled and the softmax scale corrected by mscale(factor, mscale_all_dim)^2.
- No Q/K permutation: llama.cpp rotates deepseek2's rope dims as interleaved pairs (ROPE_TYPE_NORM),
  which is how DeepSeek's checkpoints are laid out (rope_interleave).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from model.config import ModelConfig

log = logging.getLogger(__name__)

ARCH = "deepseek2"
# llama.cpp's llama_expert_gating_func_type; absent means softmax (DeepSeek-V2/V2.5 files).
_GATING = {1: "softmax", 2: "sigmoid"}
_YARN_LOG_MUL_SCALE = 0.1  # the converter writes 0.1 * mscale_all_dim

# GGUF tensor kind -> HF name under model.layers.{i}. (one GGUF tensor, one HF tensor)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# stacked routed experts: GGUF kind -> the HF projection each expert holds
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_SCORE_BIAS = "exp_probs_b.bias"  # V3's e_score_correction_bias


class _Fields:
    """`deepseek2.*` metadata lookups; a required key that is missing is a ValueError naming it."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{ARCH}.{key}", default)

    def need(self, key: str, why: str = "") -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {ARCH}.{key}{why}")
        return value

    def has(self, key: str) -> bool:
        return f"{ARCH}.{key}" in self.fields


def deepseek2_config(fields: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """The ModelConfig of a `deepseek2` GGUF file; ValueError naming a missing or unsupported key.
    llama.cpp's own defaults (llama-model.cpp, LLM_ARCH_DEEPSEEK2) where a key is optional."""
    f = _Fields(fields)
    num_heads = int(f.need("attention.head_count"))
    kv_lora_rank = int(f.need("attention.kv_lora_rank"))
    rope_dim = int(f.need("rope.dimension_count"))
    if f.has("attention.key_length_mla"):  # split k_b / v_b form
        head_k = int(f.need("attention.key_length_mla"))
        v_head_dim = int(f.need("attention.value_length_mla"))
    else:  # legacy: one attn_kv_b, per-head dims in key_length / value_length
        head_k = int(f.need("attention.key_length", " (or .attention.key_length_mla)"))
        v_head_dim = int(f.need("attention.value_length", " (or .attention.value_length_mla)"))
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    hf: dict[str, Any] = dict(
        vocab_size=int(f.get("vocab_size") or len(fields.get("tokenizer.ggml.tokens", []))),
        hidden_size=int(f.need("embedding_length")),
        intermediate_size=int(f.need("feed_forward_length")),
        num_hidden_layers=int(f.need("block_count")),
        num_attention_heads=num_heads,
        # MQA in the file (head_count_kv 1); ModelConfig's MLA has one key per head
        num_key_value_heads=num_heads,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=int(f.get("attention.q_lora_rank") or 0) or None,
        qk_nope_head_dim=head_k - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v_head_dim,
        rope_theta=float(f.get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(f),
        rope_interleave=True,
        rms_norm_eps=float(f.need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(f.need("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=sorted({fields[k] for k in eos_keys if k in fields}),
        model_type="deepseek_v2",
    )
    if hf["qk_nope_head_dim"] <= 0:
        raise ValueError(
            f"GGUF key length {head_k} leaves no non-rope dims beside {rope_dim} rope dims"
        )
    hf.update(_moe_fields(f, hf["num_hidden_layers"], tensor_names))
    return ModelConfig.from_hf(hf)


def _rope_scaling(f: _Fields) -> dict[str, Any] | None:
    kind = f.get("rope.scaling.type") or "none"
    if kind == "none":
        return None
    factor = float(f.need("rope.scaling.factor", f" (rope scaling {kind!r})"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise ValueError(f"unsupported {ARCH} rope scaling {kind!r} (supported: yarn, linear)")
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": int(
            f.need("rope.scaling.original_context_length", " (YaRN)")
        ),
        "beta_fast": float(f.get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(f.get("rope.scaling.yarn_beta_slow", 1.0)),
    }
    log_mul = f.get("rope.scaling.yarn_log_multiplier")
    if log_mul:
        mscale_all_dim = float(log_mul) / _YARN_LOG_MUL_SCALE
        scaling.update(mscale=mscale_all_dim, mscale_all_dim=mscale_all_dim)
    if (attn := f.get("rope.scaling.yarn_attn_factor")) is not None:
        scaling["attention_factor"] = float(attn)
    return scaling


def _moe_fields(f: _Fields, num_layers: int, tensor_names: set[str]) -> dict[str, Any]:
    """The DeepSeekMoE half of the HF config: experts, gating, groups, dense leading layers."""
    n_experts = int(f.get("expert_count") or 0)
    dense = int(f.get("leading_dense_block_count") or 0)
    if n_experts == 0 or dense >= num_layers:
        return dict(n_routed_experts=None, first_k_dense_replace=num_layers)
    why = " (the file has routed experts)"
    gating_id = int(f.get("expert_gating_func") or 1)
    if gating_id not in _GATING:
        raise ValueError(
            f"unsupported {ARCH}.expert_gating_func {gating_id} (supported: 1 softmax, 2 sigmoid)"
        )
    scoring = _GATING[gating_id]
    n_group = int(f.get("expert_group_count") or 1)
    topk_group = int(f.need("expert_group_used_count", why)) if n_group > 1 else 1
    has_bias = any(n.endswith(_SCORE_BIAS) for n in tensor_names)
    # V3 (sigmoid scores, a bias that only chooses) is HF's noaux_tc; V2's softmax with groups is
    # group_limited_greedy (a group scored by its best expert), as the checkpoint was trained.
    if scoring == "sigmoid" or has_bias:
        topk_method = "noaux_tc"
    else:
        topk_method = "group_limited_greedy" if n_group > 1 else "greedy"
    return dict(
        model_type="deepseek_v3" if topk_method == "noaux_tc" else "deepseek_v2",
        n_routed_experts=n_experts,
        num_experts_per_tok=int(f.need("expert_used_count", why)),
        n_shared_experts=int(f.need("expert_shared_count", why)),
        moe_intermediate_size=int(f.need("expert_feed_forward_length", why)),
        first_k_dense_replace=dense,
        # absent or 0: llama.cpp does not scale the routed weights
        routed_scaling_factor=float(f.get("expert_weights_scale") or 1.0),
        norm_topk_prob=bool(f.get("expert_weights_norm", False)),
        scoring_func=scoring,
        topk_method=topk_method,
        n_group=n_group,
        topk_group=topk_group,
    )


def split_kv_b(fields: dict[str, Any]) -> bool:
    """Whether the file holds kv_b_proj split into attn_k_b / attn_v_b (llama.cpp: is_mla())."""
    return f"{ARCH}.attention.key_length_mla" in fields


def expected_tensors(config: ModelConfig, split_kv: bool, score_bias: bool) -> list[str]:
    """The GGUF tensor names a file of `config` holds, in llama.cpp's order."""
    names = ["token_embd.weight", "output_norm.weight"]
    if not config.tie_word_embeddings:
        names.append("output.weight")
    for i in range(config.num_layers):
        kinds = ["attn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_output", "ffn_norm"]
        kinds += ["attn_q_a", "attn_q_a_norm", "attn_q_b"] if config.q_lora_rank else ["attn_q"]
        kinds += ["attn_k_b", "attn_v_b"] if split_kv else ["attn_kv_b"]
        if not config.is_moe_layer(i):
            kinds += ["ffn_gate", "ffn_up", "ffn_down"]
        else:
            kinds += ["ffn_gate_inp", *_EXPERT_NAMES]
            if config.n_shared_experts:
                kinds += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
        names += [f"blk.{i}.{k}.weight" for k in kinds]
        if config.is_moe_layer(i) and score_bias:
            names.append(f"blk.{i}.{_SCORE_BIAS}")
    return names


def check_tensors(config: ModelConfig, fields: dict[str, Any], tensor_names: set[str]) -> None:
    """ValueError naming the tensors the config needs and the file lacks, or holds beyond them
    (a tensor nothing reads would be silently dropped)."""
    score_bias = any(n.endswith(_SCORE_BIAS) for n in tensor_names)
    expected = expected_tensors(config, split_kv_b(fields), score_bias)
    missing = [n for n in expected if n not in tensor_names]
    if missing:
        raise ValueError(f"GGUF file lacks tensors: {_listed(missing)}")
    extra = sorted(tensor_names - set(expected))
    if extra:
        raise ValueError(f"GGUF file has tensors {ARCH} does not use: {_listed(extra)}")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" ... ({len(names)} in all)" if len(names) > 5 else "")


def deepseek2_hf_weights(
    tensors: Iterable[tuple[str, np.ndarray]], config: ModelConfig
) -> dict[str, np.ndarray]:
    """fp32 arrays under their GGUF names -> the HF DeepseekV2/V3ForCausalLM state dict (experts
    one by one, kv_b_proj rebuilt from k_b and v_b, V3's missing score bias as zeros), as numpy
    arrays: the metadata half of this module is read where torch is not (the conductor)."""
    sd: dict[str, np.ndarray] = {}
    kv_halves: dict[int, dict[str, np.ndarray]] = {}
    for name, w in tensors:
        if name in _GLOBAL_NAMES:
            sd[_GLOBAL_NAMES[name]] = w
            continue
        parts = name.split(".", 3)  # blk.{i}.{kind}.{weight|bias}
        if len(parts) != 4 or parts[0] != "blk":
            raise ValueError(f"GGUF tensor {name} is not one {ARCH} uses")
        _, layer, kind, suffix = parts
        prefix = f"model.layers.{layer}."
        if kind in _LAYER_NAMES:
            sd[f"{prefix}{_LAYER_NAMES[kind]}.{suffix}"] = w
        elif kind in _EXPERT_NAMES:
            for e in range(w.shape[0]):
                sd[f"{prefix}mlp.experts.{e}.{_EXPERT_NAMES[kind]}.weight"] = w[e]
        elif kind in ("attn_k_b", "attn_v_b"):
            halves = kv_halves.setdefault(int(layer), {})
            halves[kind] = w
            if len(halves) == 2:
                kv_b = _join_kv_b(halves["attn_k_b"], halves["attn_v_b"], config, int(layer))
                sd[f"{prefix}self_attn.kv_b_proj.weight"] = kv_b
        elif f"{kind}.{suffix}" == _SCORE_BIAS:
            sd[f"{prefix}mlp.gate.e_score_correction_bias"] = w
        else:
            raise ValueError(f"GGUF tensor {name} is not one {ARCH} uses")
    if config.topk_method == "noaux_tc":
        moe_layers = range(config.first_k_dense_replace, config.num_layers)
        keys = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in moe_layers]
        if not any(k in sd for k in keys):
            # llama.cpp's exp_probs_b is optional: none is a zero correction
            log.warning("%s file without exp_probs_b: expert choice uncorrected (zero bias)", ARCH)
            sd.update({k: np.zeros(config.n_routed_experts, np.float32) for k in keys})
    return sd


def _join_kv_b(k_b: np.ndarray, v_b: np.ndarray, config: ModelConfig, layer: int) -> np.ndarray:
    """kv_b_proj [heads * (qk_nope + v), kv_lora_rank] from the converter's k_b [heads,
    kv_lora_rank, qk_nope] (transposed per head) and v_b [heads, v, kv_lora_rank]."""
    c = config
    want_k = (c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim)
    want_v = (c.num_heads, c.v_head_dim, c.kv_lora_rank)
    for name, got, want in (("attn_k_b", k_b.shape, want_k), ("attn_v_b", v_b.shape, want_v)):
        if tuple(got) != want:
            raise ValueError(
                f"GGUF tensor blk.{layer}.{name}.weight: shape {tuple(got)} does not match the "
                f"config's {want}"
            )
    per_head = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return np.ascontiguousarray(per_head.reshape(-1, c.kv_lora_rank))
