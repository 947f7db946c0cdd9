"""Model engine: config, loaders (GGUF, HF safetensors), tokenizer, Llama-family and
DeepSeek-V2-family (MLA) forwards, sampling.

What describes a model without its weights (config, tokenizer, checkpoint metadata, prompt and
stop rules) loads at once; the names under TYPE_CHECKING, whose modules import torch, load on
first use (kernels/lazy.py): the conductor tokenizes and computes block keys, and torch alone
costs a process ~170 MB."""

from typing import TYPE_CHECKING

from kernels.lazy import deferred
from model.checkpoint import (
    MODEL_NAMES,
    ModelInfo,
    kv_fingerprint,
    load_model_info,
    read_model_config,
)
from model.config import ModelConfig
from model.rules import finish_reason, prompt_problem
from model.tokenizer import Tokenizer

if TYPE_CHECKING:  # loaded on first use (kernels.lazy): each of these modules imports torch
    from model.deepseek import DeepseekModel, absorbed_decode_attention
    from model.engine import Engine, Timing
    from model.kivi_pool import KiviPool
    from model.kv_pool import KVPool, PoolExhausted
    from model.llama import LlamaModel
    from model.loader import DTYPES, LoadedModel, load_model, save_hf_dir
    from model.sampling import SamplingParams, sample

__getattr__ = deferred(__name__, __file__, globals())


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
    "read_model_config",
    "sample",
    "save_hf_dir",
]
