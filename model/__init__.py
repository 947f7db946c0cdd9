"""Model engine: config, loaders (GGUF, HF safetensors), tokenizer, Llama-family and
DeepSeek-V2-family (MLA) forwards, sampling.

What describes a model without its weights (config, tokenizer, checkpoint metadata, prompt and
stop rules) loads at once; the names whose modules import torch load on first use: the conductor
tokenizes and computes block keys, and torch alone costs a process ~170 MB."""

import importlib

from model.checkpoint import MODEL_NAMES, ModelInfo, kv_fingerprint, load_model_info
from model.config import ModelConfig
from model.rules import finish_reason, prompt_problem
from model.tokenizer import Tokenizer

_LAZY = {
    "absorbed_decode_attention": "model.deepseek",
    "DeepseekModel": "model.deepseek",
    "Engine": "model.engine",
    "Timing": "model.engine",
    "KiviPool": "model.kivi_pool",
    "KVPool": "model.kv_pool",
    "PoolExhausted": "model.kv_pool",
    "LlamaModel": "model.llama",
    "DTYPES": "model.loader",
    "LoadedModel": "model.loader",
    "load_model": "model.loader",
    "save_hf_dir": "model.loader",
    "SamplingParams": "model.sampling",
    "sample": "model.sampling",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # looked up once
    return value


__all__ = [
    "DTYPES",
    "absorbed_decode_attention",
    "DeepseekModel",
    "MODEL_NAMES",
    "Engine",
    "KVPool",
    "KiviPool",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelInfo",
    "PoolExhausted",
    "SamplingParams",
    "Timing",
    "Tokenizer",
    "finish_reason",
    "kv_fingerprint",
    "load_model",
    "load_model_info",
    "prompt_problem",
    "sample",
    "save_hf_dir",
]
