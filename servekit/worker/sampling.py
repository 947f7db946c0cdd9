"""Conversions every worker shares: proto sampling parameters to the model's, dtype and device names
to torch's."""

from __future__ import annotations

import torch

from kernels import PACK_FORMS
from model import SamplingParams
from protos import halfmoon_pb2 as pb
from servekit.kv_cache import DTYPE_NAMES


def sampling_params(p: pb.SamplingParams) -> SamplingParams:
    """The model's SamplingParams from the proto message (top_p 0 means off, like 1)."""
    return SamplingParams(
        max_tokens=max(1, p.max_tokens),
        temperature=p.temperature,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        top_k=p.top_k,
        seed=p.seed,
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
    )


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(DTYPE_NAMES)})")
    return getattr(torch, name)


def check_device(name: str) -> None:
    """ValueError unless `name` is auto, cpu, cuda or cuda:N (a config check: needs no GPU)."""
    head, _, index = name.partition(":")
    if name in ("auto", "cpu", "cuda") or (head == "cuda" and index.isdigit()):
        return
    raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")


def check_dtype_device(owner: str, dtype: str, device: str, prepack: str = "none") -> None:
    """A worker config's dtype, device and packed-weight form, checked; the ValueError names
    `owner`."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"{owner}: dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if prepack not in ("none", *PACK_FORMS):
        raise ValueError(
            f"{owner}: prepack_weights must be one of none, {', '.join(PACK_FORMS)}; "
            f"got {prepack!r}"
        )
    try:
        check_device(device)
    except ValueError as exc:
        raise ValueError(f"{owner}: {exc}") from None


def resolve_device(name: str) -> torch.device:
    """The torch device a worker runs on: auto = the first CUDA device when there is one, else CPU.
    Asking for CUDA where there is none is an error, not a silent fall back to CPU."""
    check_device(name)
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this machine has no CUDA device")
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s)")
        dev = torch.device("cuda", index)
    return dev
