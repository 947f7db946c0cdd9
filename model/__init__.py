"""Model engine: config, loaders (GGUF, HF safetensors), tokenizer, Llama-family and
DeepSeek-V2-family (MLA) forwards, sampling."""

from model.config import ModelConfig
from model.deepseek import DeepseekModel
from model.engine import Engine, Timing
from model.kivi_pool import KiviPool
from model.kv_pool import KVPool, PoolExhausted
from model.llama import LlamaModel
from model.loader import (
    DTYPES,
    MODEL_NAMES,
    LoadedModel,
    ModelInfo,
    kv_fingerprint,
    load_model,
    load_model_info,
    save_hf_dir,
)
from model.rules import finish_reason, prompt_problem
from model.sampling import SamplingParams, sample
from model.tokenizer import Tokenizer

__all__ = [
    "DTYPES",
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
