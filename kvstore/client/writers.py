"""What a put returns and the writer every transport's put is: BlockWriter takes n blocks layer
by layer (or whole) and makes them visible at commit(); each transport has its own (shm, tcp,
gRPC, kvstore/client/transport_*.py), and a put of no blocks has NoWriter."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from kvstore.block_header import BlockHeader, pack_header
from kvstore.client.block_format import dtype_name
from kvstore.client.codecs import get_codec


class PutResult(NamedTuple):
    stored: int  # blocks newly written
    held: int  # blocks of the put the store holds now


def byte_rows(data: torch.Tensor) -> np.ndarray | None:
    """data [n, ...] as n rows of its bytes without a copy (numpy views: no tensor per row),
    when every row is contiguous on the CPU; None otherwise."""
    if data.device.type != "cpu" or data.dim() < 2:
        return None
    want, step = [], 1
    for d in reversed(data.shape[1:]):
        want.append(step)
        step *= d
    if list(data.stride()[1:]) != want[::-1]:
        return None
    return data.detach().view(torch.uint8).numpy().reshape(len(data), -1)


class BlockWriter(ABC):
    """Writes n blocks layer by layer; they become visible only at commit()."""

    def __init__(self, keys: list[bytes], header: BlockHeader, parent: bytes | None):
        self.keys, self.header, self.parent = keys, header, parent
        self.codec = get_codec(header.codec)
        self.sums = [[0] * header.num_layers for _ in keys]
        self.written: set[int] = set()
        self.closed = False

    def _check_layer(self, layer: int, data: torch.Tensor) -> None:
        if self.closed:
            raise RuntimeError("writer already committed or aborted")
        want = (len(self.keys), *self.header.shape[1:])
        if not 0 <= layer < self.header.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.header.num_layers - 1}")
        if tuple(data.shape) != want or data.dtype != self.header.dtype:
            raise ValueError(
                f"layer data is {list(data.shape)} {data.dtype}, expected {list(want)} "
                f"{dtype_name(self.header.dtype)}"
            )

    def _check_complete(self) -> None:
        missing = set(range(self.header.num_layers)) - self.written
        if missing:
            self.abort()
            raise ValueError(f"layers {sorted(missing)} were never written; the put is aborted")

    def _header(self, i: int) -> bytes:
        """Block i's final header (its layers' checksums known)."""
        return pack_header(self.header._replace(checksums=tuple(self.sums[i])))

    def _headers(self) -> list[bytes]:
        self._check_complete()
        return [self._header(i) for i in range(len(self.keys))]

    @property
    def _raw_unpadded(self) -> bool:
        """Whether a stored layer is the block tensor's layer as it is (raw, no padding)."""
        h = self.header
        return h.codec == "raw" and self.codec.layer_nbytes(h.shape[1:], h.dtype) == h.layer_bytes

    def _fits_whole(self, blocks: torch.Tensor) -> bool:
        """Whether `blocks` [n, *block shape] are stored exactly as their bytes lie."""
        h = self.header
        return self._raw_unpadded and tuple(blocks.shape[1:]) == h.shape and blocks.dtype == h.dtype

    def _stored_rows(
        self, data: torch.Tensor, indices: Iterable[int]
    ) -> Iterator[tuple[int, memoryview]]:
        """(i, block i's layer as stored) for each i of indices: the caller's own bytes where the
        layer is unpadded raw, else encoded into a fresh buffer."""
        h, layer_bytes = self.header, self.header.layer_bytes
        n = self.codec.layer_nbytes(h.shape[1:], h.dtype)
        rows = byte_rows(data) if self._raw_unpadded else None
        for i in indices:
            if rows is not None:
                raw = rows[i].data
            else:
                buf = np.zeros(layer_bytes, np.uint8)
                self.codec.encode_layer(data[i], torch.from_numpy(buf[:n]))
                raw = buf.data
            yield i, raw

    @abstractmethod
    def write_layer(self, layer: int, data: torch.Tensor) -> None:
        """Layer `layer` of every block: data [n, *layer shape]."""

    def can_write_whole(self, blocks: torch.Tensor) -> bool:
        """Whether `write_whole` takes `blocks` [n, *block shape] in one pass (a transport that
        can send a block's payload from where it lies, unpadded raw blocks)."""
        return False

    def write_whole(self, blocks: torch.Tensor) -> None:
        """Every layer of every block at once (where can_write_whole)."""
        raise NotImplementedError

    def can_copy_layers(self, pool: torch.Tensor) -> bool:
        """Whether `copy_layer` takes layers straight from `pool` [num_blocks, *block shape]: a
        contiguous CPU pool of the blocks exactly as they are stored (only shared memory)."""
        return False

    def copy_layer(
        self, layer: int, pool: np.ndarray, offsets: list[int], threads: int = 1
    ) -> None:
        """`write_layer` of layer `layer` read where it lies: key i's layer at byte offsets[i] of
        the pool's bytes (flat uint8), hashed in the pass that copies it; on `threads` threads
        (a caller whose other threads would only wait)."""
        raise NotImplementedError

    @abstractmethod
    def commit(self) -> PutResult:
        """Publish the blocks (every layer written); what the store took and holds."""

    @abstractmethod
    def abort(self) -> None:
        """Drop the put: nothing of it becomes visible."""


class NoWriter(BlockWriter):
    """A put of no blocks: nothing to send."""

    def write_layer(self, layer: int, data: torch.Tensor) -> None:
        self._check_layer(layer, data)
        self.written.add(layer)

    def commit(self) -> PutResult:
        self.closed = True
        return PutResult(0, 0)

    def abort(self) -> None:
        self.closed = True
