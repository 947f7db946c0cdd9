"""The one config dataclass that describes a decoder: Llama family, or DeepSeek-V2 family (MLA
attention, DeepSeekMoE feed-forward) when `kv_lora_rank` is set."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kernels import full_layout_id, mla_layout_id

if TYPE_CHECKING:
    import torch

    from kernels import KVLayout

# HF model_type values read as the DeepSeek-V2 family (model.deepseek.DeepseekModel).
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
MOE_SCORING = ("softmax", "sigmoid")
MOE_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU), or of a DeepSeek-V2
    family one: multi-head latent attention and DeepSeekMoE (the fields after `architecture`,
    whose defaults mean "not MLA, no experts"; for MLA num_kv_heads = num_heads and head_dim is
    the query/key head dim qk_nope_head_dim + qk_rope_head_dim)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    # None, or a dict as in HF config.json:
    # {"rope_type": "linear"|"llama3"|"dynamic", "factor": ..., ...}
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048  # the context window
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"
    # ---- multi-head latent attention; kv_lora_rank 0: not MLA ----
    kv_lora_rank: int = 0  # width of the cached latent c_kv
    q_lora_rank: int = 0  # 0: a full-rank q_proj; else q_a_proj -> norm -> q_b_proj
    qk_nope_head_dim: int = 0  # per-head key/query dims without RoPE (from c_kv)
    qk_rope_head_dim: int = 0  # the decoupled RoPE dims (one rope key shared by all heads)
    v_head_dim: int = 0
    rope_interleave: bool = True  # RoPE on (x0, x1), (x2, x3) pairs, as DeepSeek's checkpoints
    # ---- DeepSeekMoE; n_routed_experts 0: every layer dense ----
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0  # layers [0, k) keep a dense MLP of intermediate_size
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc (MOE_TOPK_METHODS)
    n_group: int = 1  # expert groups for the group-limited methods
    topk_group: int = 1  # groups kept per token
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to 1
    scoring_func: str = "softmax"  # softmax (V2) | sigmoid (V3, with a score-correction bias)

    def __post_init__(self) -> None:
        if self.kv_lora_rank:
            # MLA: every head has its own query and key (num_kv_heads is HF's, = num_heads).
            self.num_kv_heads = self.num_kv_heads or self.num_heads
            self.head_dim = self.head_dim or self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"model config: {name} must be positive, got {getattr(self, name)}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}"
            )
        if self.kv_lora_rank:
            self._check_mla()
        if self.n_routed_experts:
            self._check_moe()

    def _check_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: MLA needs {name} > 0, got {getattr(self, name)}")
        if self.q_lora_rank < 0:
            raise ValueError(f"model config: q_lora_rank must be >= 0, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"model config: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}"
            )
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError(
                f"model config: MLA head_dim ({self.head_dim}) must be qk_nope_head_dim + "
                f"qk_rope_head_dim ({self.qk_nope_head_dim} + {self.qk_rope_head_dim})"
            )
        if self.num_kv_heads != self.num_heads:
            raise ValueError("model config: MLA has one key per head (num_kv_heads = num_heads)")

    def _check_moe(self) -> None:
        e, k = self.n_routed_experts, self.num_experts_per_tok
        if not 0 < k <= e or self.moe_intermediate_size <= 0 or self.n_shared_experts < 0:
            raise ValueError(
                f"model config: MoE needs 0 < num_experts_per_tok ({k}) <= n_routed_experts ({e}), "
                f"moe_intermediate_size > 0 ({self.moe_intermediate_size}) and "
                f"n_shared_experts >= 0 ({self.n_shared_experts})"
            )
        if self.scoring_func not in MOE_SCORING or self.topk_method not in MOE_TOPK_METHODS:
            raise ValueError(
                f"model config: unsupported MoE gating {self.scoring_func}/{self.topk_method} "
                f"(scoring: {', '.join(MOE_SCORING)}; top-k: {', '.join(MOE_TOPK_METHODS)})"
            )
        if e % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"model config: {e} experts do not split into n_group={self.n_group} groups "
                f"with topk_group={self.topk_group} kept"
            )
        if self.topk_group * (e // self.n_group) < k:
            raise ValueError(
                f"model config: topk_group={self.topk_group} groups hold fewer than "
                f"num_experts_per_tok={k} experts"
            )

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (the DeepSeek-V2 family)."""
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` has routed experts (else a dense SwiGLU MLP)."""
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Weights the forwards hold (LlamaModel's and DeepseekModel's parameters: one embedding
        when the head is tied), from the config alone: what sizing a machine's memory needs
        before any checkpoint is read."""
        h, heads = self.hidden_size, self.num_heads
        per_layer = [2 * h] * self.num_layers  # input and post-attention norms
        for layer in range(self.num_layers):
            if self.is_mla:
                latent = self.kv_lora_rank + self.qk_rope_head_dim
                q = heads * self.head_dim
                if self.q_lora_rank:  # q_a (fused with kv_a), its norm, q_b
                    attn = h * (self.q_lora_rank + latent) + self.q_lora_rank
                    attn += self.q_lora_rank * q
                else:
                    attn = h * (q + latent)
                attn += self.kv_lora_rank  # kv_a's norm
                attn += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
                attn += heads * self.v_head_dim * h  # o_proj
            else:
                q, kv = heads * self.head_dim, self.num_kv_heads * self.head_dim
                attn = h * (q + 2 * kv) + q * h  # q, k, v and o
            if self.is_moe_layer(layer):
                e, m = self.n_routed_experts, self.moe_intermediate_size
                mlp = e * h + (e if self.topk_method == "noaux_tc" else 0)  # router (and bias)
                mlp += (e + self.n_shared_experts) * 3 * h * m  # gate, up and down of each
            else:
                mlp = 3 * h * self.intermediate_size
            per_layer[layer] += attn + mlp
        heads_out = 1 if self.tie_word_embeddings else 2  # the embedding, and an untied lm_head
        return sum(per_layer) + heads_out * self.vocab_size * h + h  # + the final norm

    def kv_layout(self, block_size: int, dtype: torch.dtype) -> KVLayout:
        """The paged KV layout of this architecture: full-precision K and V per KV head, or for
        MLA one latent row (c_kv and the shared rope key) per token."""
        from kernels import FullKVLayout, MlaKVLayout  # torch: a config alone needs none

        if self.is_mla:
            return MlaKVLayout(
                self.num_layers, self.kv_lora_rank, self.qk_rope_head_dim, block_size, dtype
            )
        return FullKVLayout(self.num_layers, self.num_kv_heads, self.head_dim, block_size, dtype)

    def kv_layout_id(self, block_size: int, dtype: str, store_codec: str = "raw") -> str:
        """The fingerprint_id of kv_layout(block_size, dtype) stored in `store_codec`, from the
        dtype's name (float32, bfloat16, float16) and without building it: no torch."""
        if self.is_mla:
            return mla_layout_id(
                dtype,
                self.num_layers,
                self.kv_lora_rank,
                self.qk_rope_head_dim,
                block_size,
                store_codec,
            )
        return full_layout_id(
            dtype, self.num_layers, self.num_kv_heads, self.head_dim, block_size, store_codec
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def architecture_id(self) -> str:
        """Canonical JSON of the fields that shape the computation (part of the fingerprint)."""
        d = self.to_dict()
        for k in ("bos_token_id", "eos_token_ids"):
            d.pop(k)
        # MLA/MoE fields at their defaults are left out, so a Llama config keeps the id (and
        # the weights id and block keys) it had before those fields existed.
        for f in dataclasses.fields(self)[_FIRST_MLA_FIELD:]:
            if d[f.name] == f.default:
                d.pop(f.name)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a HF config.json (LlamaForCausalLM and its look-alikes, DeepseekV2ForCausalLM,
        DeepseekV3ForCausalLM)."""
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta", 10000.0)
        params = hf.get("rope_parameters")  # transformers 5 folds theta and scaling into one dict
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        num_heads = hf["num_attention_heads"]
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=hf.get("model_type", "llama"),
        )
        if fields["architecture"] in MLA_ARCHITECTURES:
            fields.update(_mla_fields_from_hf(hf))
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """A HF config.json for LlamaForCausalLM (DeepseekV2/V3ForCausalLM when MLA) with these
        weights."""
        if self.is_mla:
            return _mla_to_hf(self)
        hf = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            hf["eos_token_id"] = (
                self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            )
        return hf


_FIRST_MLA_FIELD = [f.name for f in dataclasses.fields(ModelConfig)].index("kv_lora_rank")


def _mla_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The MLA and MoE fields of a deepseek_v2 / deepseek_v3 config.json (defaults as in
    transformers' DeepseekV2Config / DeepseekV3Config)."""
    v3 = hf["model_type"] == "deepseek_v3"
    # quantization_config (DeepSeek-V3's own release: FP8 blocks with scales) is the loader's
    # business (model.fp8): the architecture is the same
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention or MLP biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq {hf['moe_layer_freq']} is not supported (only 1)")
    nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    return dict(
        num_kv_heads=hf["num_attention_heads"],  # MLA: one key per head
        head_dim=nope + rope,  # HF's own head_dim is the rope part: not the query's
        kv_lora_rank=hf["kv_lora_rank"],
        q_lora_rank=hf.get("q_lora_rank") or 0,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=hf["v_head_dim"],
        # transformers' V2 always rotates interleaved pairs; V3 makes it an option
        rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,
        n_routed_experts=hf.get("n_routed_experts") or 0,
        n_shared_experts=hf.get("n_shared_experts") or 0,
        num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
        moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
        first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        topk_method=hf.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
        n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1,
        norm_topk_prob=bool(hf.get("norm_topk_prob", v3)),
        scoring_func=hf.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
    )


def _mla_to_hf(c: ModelConfig) -> dict[str, Any]:
    """A HF config.json for DeepseekV2ForCausalLM / DeepseekV3ForCausalLM."""
    v3 = c.architecture == "deepseek_v3"
    hf = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_heads,
        "hidden_act": "silu",
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,
        "kv_lora_rank": c.kv_lora_rank,
        "q_lora_rank": c.q_lora_rank or None,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "n_routed_experts": c.n_routed_experts or None,
        "n_shared_experts": c.n_shared_experts or None,
        "num_experts_per_tok": c.num_experts_per_tok or None,
        "moe_intermediate_size": c.moe_intermediate_size,
        # no experts: every layer dense
        "first_k_dense_replace": c.first_k_dense_replace if c.n_routed_experts else c.num_layers,
        "routed_scaling_factor": c.routed_scaling_factor,
        "topk_method": c.topk_method,
        "n_group": c.n_group,
        "topk_group": c.topk_group,
        "norm_topk_prob": c.norm_topk_prob,
        "scoring_func": c.scoring_func,
        "torch_dtype": "float32",
    }
    if v3:
        hf["rope_interleave"] = c.rope_interleave
    if c.bos_token_id is not None:
        hf["bos_token_id"] = c.bos_token_id
    if c.eos_token_ids:
        hf["eos_token_id"] = (
            c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids)
        )
    return hf
