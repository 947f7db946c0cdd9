"""A prompt's tail (the tokens after its last full block), carried inline with the request in
full precision as one block of the block format, checksummed; and writing tokens into pool
blocks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.block_header import BlockCorrupt
from kvstore.client.block_format import decode_block, encode_block
from kvstore.client.connector_metrics import ConnectorMetrics
from kvstore.client.connector_pool import PoolIO


def token_axis(block_shape: Sequence[int]) -> int:
    """Where tokens run in a block: [L, 2, T, H, D] (K and V) or [L, T, C] (an MLA latent)."""
    return 2 if len(block_shape) == 5 else 1


def write_tokens(kv: torch.Tensor, block_ids: list[int], tokens: torch.Tensor) -> None:
    """Write `tokens` ([L, 2, T, heads, head_dim], or [L, T, C] for a latent cache) into the first
    T token slots across the full-precision pool blocks `block_ids` of `kv`, in order."""
    axis = token_axis(kv.shape[1:])
    bs = kv.shape[1 + axis]
    for i, b in enumerate(block_ids):
        n = min(bs, tokens.shape[axis] - i * bs)
        if n <= 0:
            break
        kv[b].narrow(axis, 0, n).copy_(tokens.narrow(axis, i * bs, n))


class InlineTail:
    """Tails of the full-precision pool `pool`, in and out; a tail that cannot be used is
    counted and logged (op "tail") and left to the caller to recompute."""

    def __init__(self, pool: PoolIO, metrics: ConnectorMetrics) -> None:
        self._pool, self._metrics = pool, metrics

    def encode(self, block_ids: Sequence[int], tokens: int) -> bytes:
        """The first `tokens` token slots across pool blocks `block_ids` as one block."""
        kv = self._pool.kv
        blocks = kv[self._pool.index(block_ids)]
        if blocks.dim() == 4:  # MLA latent blocks [n, L, bs, C]
            n, layers, bs, width = blocks.shape
            tail = blocks.permute(1, 0, 2, 3).reshape(layers, n * bs, width)[:, :tokens]
        else:
            n, layers, two, bs, heads, dim = blocks.shape
            tail = blocks.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, n * bs, heads, dim)
            tail = tail[:, :, :tokens]
        return encode_block(tail.contiguous().to("cpu"), self._pool.fingerprint)

    def decode(self, data: bytes, tokens: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """An inline tail of `tokens` tokens (`shape`: a full-precision block's); None (counted)
        when it is corrupt, of another model or of the wrong shape."""
        try:
            tail = decode_block(data, model_fingerprint=self._pool.fingerprint)
            axis = token_axis(shape)
            if tuple(tail.shape) != (*shape[:axis], tokens, *shape[axis + 1 :]):
                raise BlockCorrupt(f"tail block is {list(tail.shape)}, expected {tokens} tokens")
        except Exception as exc:  # noqa: BLE001 - recomputed by the caller
            self._metrics.error("tail", exc)
            return None
        return tail

    def load(self, data: bytes, tokens: int, block_ids: Sequence[int]) -> bool:
        """An inline tail into the first `tokens` slots across pool blocks `block_ids`; False
        (counted) when it cannot be used."""
        kv = self._pool.kv
        tail = self.decode(data, tokens, self._pool.layout.block_shape)
        if tail is None:
            return False
        write_tokens(kv, list(block_ids), tail.to(kv.device, kv.dtype))
        return True
