"""Conversions the workers share: proto sampling parameters to the model's, dtype names to torch dtypes."""

from __future__ import annotations

import torch

from model import SamplingParams
from protos import halfmoon_pb2 as pb

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sampling_params(p: pb.SamplingParams) -> SamplingParams:
    """The model's SamplingParams from the proto message (top_p 0 means off, like 1)."""
    return SamplingParams(
        max_tokens=max(1, p.max_tokens), temperature=p.temperature, top_p=p.top_p if p.top_p > 0 else 1.0,
        top_k=p.top_k, seed=p.seed, stop=tuple(p.stop), ignore_eos=p.ignore_eos,
    )


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(_DTYPES)})")
    return _DTYPES[name]
