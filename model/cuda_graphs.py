"""A decode step replayed from CUDA graphs, one graph per batch size (what vLLM's and SGLang's
CUDA-graph runners do).

Why: on a GPU a small model's decode step is hundreds of short kernels (SmolLM2: 30 layers of
~12 each), and launching them one by one from Python takes longer than running them. A graph
captured once per batch size launches the whole step at once (SmolLM2 on an H200 at batch 1:
13.9 ms a step eager, 1.24 ms replayed; bench/decode_cuda.py).

How: the step reads its inputs from static buffers, [largest batch, ...] each, and writes its
logits into a buffer of its own. A batch of b runs the graph of the smallest captured size >= b:
its inputs are copied into the first b rows, and the rows after them are padding, rows that
write their KV into a block no sequence holds (the caller's pad block) and whose logits are
dropped. A block table is copied into a fixed width; the columns past a sequence's blocks are
never read, since the kernels bound each sequence by its length (without a host sync).

A batch that fits no graph (larger than the largest size, or a table wider than the width)
runs the step eagerly; `on_fallback` hears of it (the decode worker counts and logs it). So
does a model whose step cannot be captured: `GraphedStep.capture` then keeps no graph.

On a CPU device the same object runs the step eagerly over its static buffers, padding and
all: the tests check the padding rules there."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

# batch sizes captured by default, up to and including the largest batch: from 8 to 512 each at
# most 1.5x the one before, so a batch there pads by less than half
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class StaticInput(NamedTuple):
    """One input of the step: [batch] or [batch, width], on the step's device."""

    dtype: torch.dtype  # the dtype the step takes it in
    width: int  # columns of a table; 0 for a [batch] vector
    pad: int  # the value of padding rows, and of a table's columns past its own


def batch_sizes_upto(largest: int, sizes: Sequence[int] = DEFAULT_BATCH_SIZES) -> list[int]:
    """The sizes worth capturing for batches of up to `largest`: `sizes` below it, and it."""
    return sorted({s for s in sizes if 0 < s < largest} | {largest})


class GraphedStep:
    """`step(*inputs) -> logits [batch, ...]`, replayed from graphs (module docstring).

    The logits a call returns are a view of the graph's output: valid until the next call."""

    def __init__(
        self,
        step: Callable[..., torch.Tensor],
        inputs: Sequence[StaticInput],
        batch_sizes: Sequence[int],
        device: torch.device | str,
        on_fallback: Callable[[str], None] | None = None,
    ) -> None:
        if not batch_sizes or min(batch_sizes) <= 0:
            raise ValueError(f"GraphedStep needs positive batch sizes, got {list(batch_sizes)}")
        self.step, self.inputs = step, list(inputs)
        self.sizes = sorted(set(batch_sizes))
        self.device = torch.device(device)
        self.on_fallback = on_fallback
        largest = self.sizes[-1]
        # Every input lives in one flat byte buffer (each at an 8-byte-aligned offset), filled on
        # the host through numpy views (no torch op per input: on a GPU host an op costs ~10-35
        # us) and copied to the device in one go, from pinned memory on CUDA.
        offsets, end = [], 0
        for i in self.inputs:
            offsets.append(end)
            end += -(-largest * max(1, i.width) * i.dtype.itemsize // 8) * 8
        pin = self.device.type == "cuda"
        self._host_bytes = torch.empty(end, dtype=torch.uint8, pin_memory=pin)
        self._device_bytes = torch.empty(end, dtype=torch.uint8, device=self.device)
        self._host, self._buffers = [], []
        for i, at in zip(self.inputs, offsets):
            shape = (largest, i.width) if i.width else (largest,)
            n = largest * max(1, i.width) * i.dtype.itemsize
            host = self._host_bytes[at : at + n].view(i.dtype).view(shape)
            host.fill_(i.pad)
            self._host.append(host.numpy())
            self._buffers.append(self._device_bytes[at : at + n].view(i.dtype).view(shape))
        self._device_bytes.copy_(self._host_bytes)
        # marks the last copy out of the pinned bytes, which the next step waits for before
        # writing them (on a GPU the copy runs after the host returns)
        self._copied = None
        if pin:
            with torch.cuda.device(self.device):
                self._copied = torch.cuda.Event()
        # batch size -> (its graph or None when run eagerly on the buffers, its logits)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.replays = 0  # steps run from the buffers (replayed, or eagerly when not captured)

    @property
    def captured(self) -> list[int]:
        """The batch sizes that replay a graph."""
        return sorted(b for b, (g, _) in self._graphs.items() if g is not None)

    def capture(self) -> bool:
        """Capture a graph for every batch size (largest first, sharing one memory pool); on
        a CPU device, set up the eager runs over the buffers. False, with no graph kept and
        `on_fallback("capture")` told, when the step cannot be captured."""
        if self.device.type != "cuda":
            self._graphs = {b: (None, None) for b in self.sizes}
            return True
        try:
            self._capture_all()
        except Exception as exc:  # a step with a host sync, an op capture refuses
            self._graphs = {}
            torch.cuda.synchronize(self.device)
            log.warning("decode step not captured as CUDA graphs, it runs eagerly: %s", exc)
            self._fell_back("capture")
            return False
        return True

    def _capture_all(self) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        # Warm-up on a side stream, as torch's docs ask: kernels compiled (Triton specializes
        # per batch size), library handles made, the allocator's blocks cached.
        with torch.cuda.stream(side):
            for b in self.sizes:
                self.step(*[buf[:b] for buf in self._buffers])
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = self.step(*[buf[:b] for buf in self._buffers])
            self._graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)

    def _fell_back(self, reason: str) -> None:
        if self.on_fallback is not None:
            self.on_fallback(reason)

    def _fit(self, args: Sequence[torch.Tensor]) -> tuple[int, str]:
        """(the batch size to run, '') or (0, why the batch runs eagerly)."""
        if not self._graphs:
            return 0, "capture"
        b = args[0].shape[0]
        i = bisect.bisect_left(self.sizes, b)
        if i == len(self.sizes):
            return 0, "batch"
        for a, spec in zip(args, self.inputs):
            if spec.width and a.shape[1] > spec.width:
                return 0, "width"
        return self.sizes[i], ""

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        size, why = self._fit(args)
        if not size:
            if why != "capture":  # told once, at capture
                self._fell_back(why)
            return self.step(*args)
        b = args[0].shape[0]
        if self._copied is not None:
            self._copied.synchronize()
        for a, spec, host in zip(args, self.inputs, self._host):
            a = a.cpu().numpy()
            if spec.width:
                host[:b, : a.shape[1]] = a
                host[:b, a.shape[1] :] = spec.pad
            else:
                host[:b] = a
            host[b:size] = spec.pad
        self._device_bytes.copy_(self._host_bytes, non_blocking=True)  # before the replay
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        graph, out = self._graphs[size]
        self.replays += 1
        if graph is None:
            out = self.step(*[buf[:size] for buf in self._buffers])
        else:
            graph.replay()
        return out[:b]
