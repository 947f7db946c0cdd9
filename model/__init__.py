"""Model engine: config, loaders (GGUF, HF safetensors), tokenizer, Llama-family forward, sampling."""

from model.config import ModelConfig
from model.engine import Engine, Timing
from model.kv_pool import KVPool, PoolExhausted
from model.llama import LlamaModel
from model.loader import DTYPES, MODEL_NAMES, LoadedModel, load_model, save_hf_dir
from model.sampling import SamplingParams, sample
from model.tokenizer import Tokenizer

__all__ = [
    "DTYPES",
    "MODEL_NAMES",
    "Engine",
    "KVPool",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "PoolExhausted",
    "SamplingParams",
    "Timing",
    "Tokenizer",
    "load_model",
    "sample",
    "save_hf_dir",
]
