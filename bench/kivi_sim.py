"""The simulated KIVI cache of bench/kv_quality.py: one sequence's KV in a float64 KVPool, kept
as decode with a KIVI setting would keep it (keys quantized in whole G-token groups, values per
token, past the R most recent tokens), and the chunked prefill plus greedy decode that runs a
sequence through it. bench/kv_quality.py's docstring gives the method and its approximation;
bench/cachegen_codec.py reuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

import kernels
from model import KVPool, LlamaModel, ModelConfig

STORE_BLOCK = 16  # tokens per KV block in the pool and the store (model.loader's default)


class KVSetting(NamedTuple):
    """How a simulated cache keeps its K/V."""

    name: str
    bits: int | None = None  # None: no quantization
    group: int = 32  # G: tokens per key group, channels per value group
    residual: int = 32  # R: most recent tokens kept at 16 bits
    bf16: bool = True  # round every K/V through bfloat16 (False: the fp32 cache)

    @property
    def chunk_free(self) -> bool:
        """Whether the cache's contents do not depend on the prefill chunking."""
        return self.bits is None


FP32 = KVSetting("fp32_kv", bf16=False)
BF16 = KVSetting("bf16_kv")


def kivi_setting(bits: int, group: int, residual: int) -> KVSetting:
    if residual < 0 or residual % group:
        raise ValueError(f"residual {residual} must be 0 or a multiple of the group size {group}")
    return KVSetting(f"kivi{bits}_r{residual}", bits, group, residual)


def keys_due(n: int, residual: int, group: int) -> int:
    """Keys quantized once n tokens are held: whole groups, leaving R to R+G-1 at 16 bits."""
    return max(0, (n - residual) // group * group)


def values_due(n: int, residual: int) -> int:
    """Values quantized once n tokens are held: all but the last R."""
    return max(0, n - residual)


class SimCache:
    """One sequence's KV in a float64 KVPool, kept as decode with `setting` would keep it."""

    def __init__(
        self, config: ModelConfig, capacity: int, setting: KVSetting, block_size: int = STORE_BLOCK
    ) -> None:
        blocks = -(-capacity // block_size)
        self.setting = setting
        self.pool = KVPool(config, blocks, block_size, dtype=torch.float64)
        self.table = self.pool.allocate(blocks)
        self._table = torch.tensor(self.table, dtype=torch.long)
        self.keys_quantized = 0  # positions [0, keys_quantized) hold dequantized keys
        self.values_quantized = 0
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None

    def slots(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of positions [a, b)."""
        pos = torch.arange(a, b)
        bs = self.pool.block_size
        return self._table[pos // bs], pos % bs

    def read(self, a: int, b: int) -> torch.Tensor:
        """A copy of positions [a, b): float64 [num_layers, 2, b - a, kv_heads, head_dim]."""
        blk, off = self.slots(a, b)
        return self.pool.kv[blk, :, :, off].permute(1, 2, 0, 3, 4).clone()

    def prefill(self, model: LlamaModel, ids: torch.Tensor, start: int) -> torch.Tensor:
        """The model's prefill of ids at positions start.. over this cache; fp32 logits [T, V]."""
        self._new = self.slots(start, start + ids.numel())
        hook = self._round_layer if self.setting.bf16 else None
        return model.prefill(ids, self.pool, self.table, start, on_layer_done=hook)

    def _round_layer(self, layer: int) -> None:
        """Round the chunk's new K/V of one layer through bfloat16 (before the chunk attends)."""
        blk, off = self._new
        for cache in self.pool.layer_kv(layer):
            cache[blk, off] = cache[blk, off].to(torch.bfloat16).to(cache.dtype)

    def settle(self, n: int) -> None:
        """With n tokens held, replace the K/V that has left the window by its KIVI round trip."""
        s = self.setting
        if s.bits is None:
            return
        kd, vd = keys_due(n, s.residual, s.group), values_due(n, s.residual)
        if kd > self.keys_quantized:
            self._round_trip(self.keys_quantized, kd, 0)
            self.keys_quantized = kd
        if vd > self.values_quantized:
            self._round_trip(self.values_quantized, vd, 1)
            self.values_quantized = vd

    def _round_trip(self, a: int, b: int, which: int) -> None:
        """Quantize->dequantize positions [a, b) of keys (0; a, b on group bounds) or values (1)."""
        x = self.read(a, b).float()  # [L, 2, n, heads, dim]: bf16 values, exact in fp32
        back = kernels.kivi_dequantize(
            kernels.kivi_quantize(x, self.setting.bits, self.setting.group)
        )
        blk, off = self.slots(a, b)
        half = self.pool.kv.select(2, which)  # [blocks, L, slot, heads, dim]
        half[blk, :, off] = back[:, which].permute(1, 0, 2, 3).to(half.dtype)


class SeqRun(NamedTuple):
    logprobs: torch.Tensor  # float64 [N-1]: log p(token i+1 | tokens <= i)
    argmax: torch.Tensor  # long [N-1]: the model's top token at each of those positions
    generated: list[int]  # greedy continuation
    cache: SimCache


@torch.inference_mode()
def run_sequence(
    model: LlamaModel,
    token_ids,
    setting: KVSetting,
    chunk: int = 16,
    generate: int = 0,
    on_chunk: Callable[[SimCache, int, int], None] | None = None,
) -> SeqRun:
    """Prefill token_ids `chunk` tokens at a time over a SimCache (settled after each chunk), then
    greedily decode `generate` tokens one at a time the same way.

    on_chunk(cache, start, end) runs after each prompt chunk is computed, before the cache settles.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    n = ids.numel()
    if n < 1 or chunk < 1:
        raise ValueError("run_sequence needs at least one token and chunk >= 1")
    cache = SimCache(model.config, n + generate, setting)
    lps, tops = [], []
    logits = None
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        logits = cache.prefill(model, ids[s:e], s)
        if on_chunk is not None:
            on_chunk(cache, s, e)
        cache.settle(e)
        target = ids[s + 1 : e + 1]
        k = target.numel()
        if k:
            lps.append(
                torch.log_softmax(logits[:k], dim=-1).gather(1, target[:, None])[:, 0].double()
            )
            tops.append(logits[:k].argmax(dim=-1))
    generated: list[int] = []
    pos = n
    while len(generated) < generate:
        nxt = int(logits[-1].argmax())
        generated.append(nxt)
        if len(generated) == generate:
            break
        logits = cache.prefill(model, ids.new_tensor([nxt]), pos)
        pos += 1
        cache.settle(pos)
    empty = torch.empty(0)
    return SeqRun(
        torch.cat(lps) if lps else empty.double(),
        torch.cat(tops) if tops else empty.long(),
        generated,
        cache,
    )
