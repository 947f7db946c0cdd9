r"""A HF checkpoint directory of a real model's shape with seeded random weights and SmolLM2's
tokenizer, for the benchmarks that take a model (`bench/e2e.py --model DIR`,
`bench/model_speed.py` does not), where only SmolLM2-135M's weights ship: a step's time does not
depend on the weights' values, but it does on the shapes, and SmolLM2's (hidden size 576) are
not those of most Llama-family models (1,024-8,192).

The vocabulary is the tokenizer's (49,152), whatever the shape's own: prompts are SmolLM2's
tokens. Weights as `model.loader.tiny_random_weights` draws them, stored in --dtype.

    .venv/bin/python bench/random_model.py llama-1b /tmp/llama-1b-shape [--dtype bfloat16]
    .venv/bin/python bench/e2e.py --model /tmp/llama-1b-shape --prefill-cpus 0-1 --decode-cpus 0-1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import ModelConfig  # noqa: E402
from model.checkpoint import load_model_info  # noqa: E402
from model.loader import DTYPES, tiny_random_weights  # noqa: E402

SHAPES = {  # HF config.json fields of the two models
    "smollm2": dict(
        architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama-1b": dict(
        architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}  # fmt: skip


def write_random_model(shape: str, path: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """`path` as a HF directory: config.json, model.safetensors, SmolLM2's tokenizer."""
    from safetensors.torch import save_file

    tokenizer = load_model_info("smollm2-135m").tokenizer
    config = ModelConfig.from_hf(
        dict(
            SHAPES[shape],
            vocab_size=tokenizer.vocab_size,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=sorted(tokenizer.eos_token_ids),
        )
    )
    path.mkdir(parents=True, exist_ok=True)
    weights = tiny_random_weights(config, seed, dtype)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = dict(config.to_hf(), torch_dtype=str(dtype).removeprefix("torch."))
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    tokenizer.to_dir(path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("path", help="the directory to write (created; its files are replaced)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = write_random_model(args.shape, Path(args.path), DTYPES[args.dtype], args.seed)
    size = (path / "model.safetensors").stat().st_size
    print(f"{args.shape} ({args.dtype}, seed {args.seed}): {path} ({size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
