"""Small tensor helpers both decoders (model/llama.py, model/deepseek.py) share."""

from __future__ import annotations

import torch

import kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kernels.rms_norm(x, weight, eps)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, D] -> [1, heads, T, D]: SDPA takes its CPU flash kernel only for 4-D inputs."""
    return x.transpose(0, 1)[None]
