"""Loaders: named models (a registry), GGUF files and HF safetensors directories, to a LoadedModel.

`model.checkpoint` resolves the names and paths and reads what describes a model (config,
tokenizer, weights id, `load_model_info`); this module reads and builds its weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from model.checkpoint import (
    TINY_SEED,
    Checkpoint,
    GgufMeta,
    HfMeta,
    kv_fingerprint,
    read_checkpoint,
    resolve_checkpoint,
)
from model.config import ModelConfig
from model.deepseek import DeepseekModel, mla_rope
from model.fp8 import FP8_DTYPES, SCALE_SUFFIX, dequantize_fp8
from model.gguf_deepseek2 import deepseek2_hf_weights
from model.llama import LlamaModel, rope_inv_freq
from model.tokenizer import Tokenizer

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


def model_class(config: ModelConfig) -> type[LlamaModel] | type[DeepseekModel]:
    """The forward that runs `config`: DeepseekModel for MLA, else LlamaModel."""
    return DeepseekModel if config.is_mla else LlamaModel


class LazyWeights(Mapping):
    """A checkpoint's tensors by HF name, each read (dequantized, converted) when a loader asks
    for it and not kept: a load holds the model and the tensor being copied into it, never a
    second copy of the whole checkpoint (a Llama-3.2-1B-shaped bf16 checkpoint read whole in
    fp32 took a worker's load to 6.5 GB resident for 2.2 GB of weights). The last tensor read is
    kept, for a loader that looks at one twice (its shape, then its values)."""

    def __init__(self, readers: dict[str, Callable[[], torch.Tensor]]):
        self._readers = readers
        self._last: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = None  # let the previous one go before reading the next
            self._last = (name, self._readers[name]())
        return self._last[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)


def tiny_random_weights(
    config: ModelConfig, seed: int = TINY_SEED, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Seeded weights (HF names) large enough that logits are well separated (few near-ties),
    each cast to `dtype` as it is drawn (a model of a billion parameters never held in fp32)."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):  # the names and shapes only
        model = model_class(config)(config)
    sd = {}
    for name, t in model.hf_state_dict().items():
        if "norm" in name:
            w = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        elif "embed" in name:
            w = torch.randn(t.shape, generator=g)
        elif t.dim() == 1:  # a router's score-correction bias
            w = 0.1 * torch.randn(t.shape, generator=g)
        else:
            w = torch.randn(t.shape, generator=g) * (1.5 / t.shape[1] ** 0.5)
        sd[name] = w.to(dtype)
    return sd


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


# What gguf's readers raise on a corrupt or unsupported tensor (beside ValueError)
_GGUF_ERRORS = (KeyError, IndexError, TypeError, NotImplementedError)


def _dequantize(data: np.ndarray, t) -> np.ndarray:
    """One tensor of a GGUF file's map `data`, dequantized to fp32, writable and contiguous."""
    import gguf

    qtype = gguf.GGMLQuantizationType(t.qtype)
    raw = data[t.offset : t.offset + t.nbytes]
    raw = raw.reshape(gguf.quant_shape_to_byte_shape(t.shape, qtype))
    w = gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False).reshape(t.shape)
    if not (w.flags.writeable and w.flags.c_contiguous):
        w = w.copy()  # torch wants writable memory; a float32 tensor is a view of the map
    return w


def _dequantized(meta: GgufMeta, path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Each tensor of the file under its GGUF name, dequantized to fp32, writable and contiguous."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in meta.tensors:
        yield t.name, _dequantize(data, t)


def _llama_hf_weights(meta: GgufMeta, path: Path) -> LazyWeights:
    """Each tensor dequantized when it is asked for (llama.cpp's Q/K permutation undone)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")

    def reader(t) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            try:
                w = _dequantize(data, t)
                if t.name.endswith("attn_q.weight"):
                    w = _unpermute(w, meta.config.num_heads)
                elif t.name.endswith("attn_k.weight"):
                    w = _unpermute(w, meta.config.num_kv_heads)
                return torch.from_numpy(np.ascontiguousarray(w))
            except (ValueError, *_GGUF_ERRORS) as exc:
                raise ValueError(
                    f"{path}: corrupt or unsupported GGUF tensor {t.name} "
                    f"({type(exc).__name__}: {exc})"
                ) from None

        return read

    return LazyWeights({_hf_name(t.name): reader(t) for t in meta.tensors})


def _from_numpy(sd: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(w) for name, w in sd.items()}


def read_gguf_weights(meta: GgufMeta, path: Path) -> Mapping[str, torch.Tensor]:
    """The fp32 weights in HF names, dequantized: for Llama each as it is asked for
    (LazyWeights), llama.cpp's Q/K permutation undone; for deepseek2 all at once, the stacked
    experts and split kv_b_proj taken apart and joined again."""
    try:
        if meta.fields.get("general.architecture") == "deepseek2":
            return _from_numpy(deepseek2_hf_weights(_dequantized(meta, path), meta.config))
        return _llama_hf_weights(meta, path)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    except _GGUF_ERRORS as exc:
        raise ValueError(
            f"{path}: corrupt or unsupported GGUF file ({type(exc).__name__}: {exc})"
        ) from None


def read_hf_weights(meta: HfMeta) -> Mapping[str, torch.Tensor]:
    """The weights in HF names (a tied lm_head dropped), each read when asked for (LazyWeights)
    in the file's float dtype: the model's copy converts it, as .to(dtype) would. FP8 ones are
    read at once and multiplied out by their block scales (in fp32)."""
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    fp8 = []
    for f in meta.files:
        base, index = _safetensors_index(f)
        for name, (dtype, shape, begin, end) in index.items():
            if dtype in FP8_DTYPES:
                fp8.append(name)
            readers[name] = _safetensors_reader(f, base + begin, end - begin, dtype, shape)
    if fp8 and meta.fp8_block is None:
        raise ValueError(
            f"{meta.path}: {fp8[0]} is FP8 but config.json declares no quantization_config"
        )
    if meta.config.tie_word_embeddings:
        readers.pop("lm_head.weight", None)
    if meta.fp8_block is None:
        return LazyWeights(readers)
    sd = {}
    for k, read in readers.items():
        t = read()
        sd[k] = t if t.dtype in FP8_DTYPES or k.endswith(SCALE_SUFFIX) else t.float()
    try:
        return dequantize_fp8(sd, meta.fp8_block)
    except ValueError as exc:
        raise ValueError(f"{meta.path}: {exc}") from None


# safetensors' dtype names (its format's header)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_SAFETENSORS_MAX_HEADER = 100 << 20
_TensorEntry = tuple[torch.dtype, list[int], int, int]  # dtype, shape, begin, end of its bytes


def _safetensors_index(path: Path) -> tuple[int, dict[str, _TensorEntry]]:
    """(where a safetensors file's data starts, {name: (dtype, shape, begin, end)} of each of its
    tensors, offsets into the data), from its header, every entry checked against the file's
    size. Read here rather than through the safetensors package, whose tensors are views of the
    file mapped into memory: its pages stayed resident (counted in RSS) until the load ended, a
    second copy of the weights (a 2.2 GB checkpoint: 4.4 GB at the load's peak, 2.3 after)."""

    def corrupt(why: str) -> ValueError:
        return ValueError(f"{path}: corrupt safetensors file ({why})")

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(_SAFETENSORS_MAX_HEADER, size - 8):
            raise corrupt(f"a header of {n} bytes in a file of {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise corrupt(f"its header is not JSON: {exc}") from None
    data_len, index = size - 8 - n, {}
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise corrupt(f"tensor {name}: {type(exc).__name__}: {exc}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_len or end - begin != nbytes:
            raise corrupt(
                f"tensor {name} of shape {shape} ({nbytes} bytes) at [{begin}, {end}) of "
                f"{data_len} bytes of data"
            )
        index[name] = (dtype, shape, begin, end)
    return 8 + n, index


def _safetensors_reader(
    path: Path, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]
) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            view, got = memoryview(buf.numpy()), 0
            while got < nbytes:
                k = f.readinto(view[got:])
                if not k:
                    raise ValueError(
                        f"{path}: corrupt safetensors file (it ended {nbytes - got} bytes into "
                        f"a tensor of {nbytes})"
                    )
                got += k
        t = buf.view(dtype).reshape(shape)
        # 16- and 32-bit floats as stored (the copy into the model rounds them once, as the
        # fp32 copy did); anything else in fp32, as before
        if dtype in (torch.float32, torch.bfloat16, torch.float16) or dtype in FP8_DTYPES:
            return t
        return t.float()

    return read


def _read_weights(
    ckpt: Checkpoint, config: ModelConfig, meta: GgufMeta | HfMeta | None
) -> Mapping[str, torch.Tensor]:
    """The checkpoint's weights in HF names (`meta`: what read_checkpoint read of it), read as
    the model's loader asks for them where the format allows (LazyWeights)."""
    if ckpt.kind == "tiny-random":
        return tiny_random_weights(config)
    if ckpt.kind == "gguf":
        return read_gguf_weights(meta, ckpt.path)
    return read_hf_weights(meta)


def save_hf_dir(lm: LoadedModel, path: str | Path) -> Path:
    """Write `lm` as a HF checkpoint directory (config, model.safetensors, tokenizer) in fp32."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(lm.config.to_hf(), indent=2))
    save_file(lm.model.hf_state_dict(), str(path / "model.safetensors"), metadata={"format": "pt"})
    lm.tokenizer.to_dir(path)
    return path


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        dtype = DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype} (supported: float32, bfloat16, float16)")
    return dtype


def _build(
    config: ModelConfig, sd: Mapping[str, torch.Tensor], dtype: torch.dtype, device: str
) -> LlamaModel | DeepseekModel:
    with torch.device("meta"):
        model = model_class(config)(config)
    # Cast while on meta (free; a model keeps what it keeps in fp32, as DeepSeek's router), then
    # storage for each tensor by shape, as Module.to_empty gives it but not through its
    # empty_like, which goes through torch._refs and imports torch.fx and sympy on first call
    # (~35 MiB of Python objects in every worker, and ~1 s). The fp32 checkpoint is copied in
    # rounding as .to(dtype) would, and a load never holds an fp32 model beside it (SmolLM2's
    # bf16 load peaked at 1.31 GB resident, now 1.14).
    model = model.to(dtype=dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype))
    model.load_hf_state_dict(sd)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    # Not in the checkpoint, and stays fp32 whatever the dtype.
    inv_freq = mla_rope(config)[0] if config.is_mla else rope_inv_freq(config)
    model.inv_freq = inv_freq.to(device)
    return model


def load_model(
    name_or_path: str,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    prepack: str = "panels",
) -> LoadedModel:
    """A registered model by name, a .gguf file, or a HF safetensors directory. With `prepack`
    ("panels" | "onednn" | "none"; on CPU, where the dtype has a packed path) a Llama-family
    model's linear weights are held packed (kernels/packed_linear.py): same values, faster
    small-batch matmuls."""
    dtype = _torch_dtype(dtype)
    ckpt = resolve_checkpoint(name_or_path)
    info, meta = read_checkpoint(ckpt)
    model = _build(info.config, _read_weights(ckpt, info.config, meta), dtype, device)
    if prepack != "none" and isinstance(model, LlamaModel):
        model.prepack_weights(prepack)
    fingerprint = kv_fingerprint(info.weights_id, info.config.kv_layout(DEFAULT_BLOCK_SIZE, dtype))
    return LoadedModel(model, info.tokenizer, info.config, fingerprint, info.name, info.weights_id)
