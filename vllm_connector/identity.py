"""What names a vLLM instance's KV blocks in the store: the fingerprint halfmoon's own workers
use (model.kv_fingerprint: the weights' id and the KV layout), with vLLM's layout spelled out.
Two instances of the same weights, dtype and block layout share keys; any other never matches."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from model import kv_fingerprint, load_model_info

log = logging.getLogger(__name__)


def weights_id(model: str) -> str:
    """halfmoon's id of the weights at `model` (an HF directory: the files' digest, as its own
    workers compute it); a model it cannot read (an architecture it does not implement) is
    named by the digest of its config.json and *.safetensors instead, and a hub name by itself."""
    path = Path(model)
    try:
        return load_model_info(model).weights_id
    except (ValueError, KeyError, NotImplementedError, FileNotFoundError) as e:
        if not path.is_dir():
            log.warning(
                "halfmoon connector: %s is no local model directory (%s): keyed by name", model, e
            )
            return hashlib.blake2b(model.encode(), digest_size=16).hexdigest()
        h = hashlib.blake2b(b"vllm-model", digest_size=16)
        for p in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
            with open(p, "rb") as f:
                while chunk := f.read(16 << 20):
                    h.update(chunk)
        return h.hexdigest()


def layout_id(
    dtype: str, num_layers: int, num_kv_heads: int, block_size: int, head_size: int
) -> str:
    """The stored block's layout: dtype and [layers, 2, kv heads, tokens, head size]."""
    return f"vllm-kv/{dtype}/{num_layers}x2x{num_kv_heads}x{block_size}x{head_size}"


def fingerprint(weights: str, layout: str) -> str:
    return kv_fingerprint(weights, layout)
