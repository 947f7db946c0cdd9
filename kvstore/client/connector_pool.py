"""The connector's view of a worker's pool: its tensor `kv[num_blocks, *layout.block_shape]`, the
layout blocks are stored in (which may pack them), and the copies of stored blocks into and out
of pool blocks (straight into a CPU pool that holds blocks as stored, else staged in host memory:
the pool may live on a GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from kernels.layout import KVLayout
from kvstore.client.block_format import make_header
from kvstore.client.connector_metrics import ConnectorMetrics
from kvstore.client.store_client import StoreClient


@runtime_checkable
class PackingLayout(Protocol):
    """A store layout that packs a full-precision pool's blocks (kernels.KiviKVLayout)."""

    def pack(self, blocks: torch.Tensor) -> torch.Tensor: ...

    def pack_layer(self, layer_blocks: torch.Tensor) -> torch.Tensor: ...

    def unpack(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


class PoolIO:
    """Pool `kv` of `layout`, its blocks stored as `store_layout` under model `fingerprint`.

    packs: the store layout differs from the pool's (a full-precision prefill pool whose blocks
    are stored KIVI-packed: packed on the way out, unpacked on the way in). wire_block_bytes: what
    one stored block moves over a link, encoded at the store layout's codec (int8 and KIVI blocks
    are smaller than the pool's), header included."""

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        store_layout: KVLayout,
        fingerprint: str,
        metrics: ConnectorMetrics,
    ) -> None:
        self.kv, self.layout, self.store_layout = kv, layout, store_layout
        self.fingerprint, self._metrics = fingerprint, metrics
        self.packs = store_layout.fingerprint_id != layout.fingerprint_id
        sl = store_layout
        self._packer = sl if isinstance(sl, PackingLayout) else None
        self.wire_block_bytes = make_header(
            sl.store_codec, sl.dtype, tuple(sl.block_shape), fingerprint
        ).total_len
        self._pool_bytes: np.ndarray | None = None  # pool_bytes(), made on first use

    def packer(self) -> PackingLayout:
        """The store layout, as what packs blocks (only where `packs`)."""
        if self._packer is None:  # the AttributeError a store layout that cannot pack raised
            raise AttributeError(f"{type(self.store_layout).__name__} cannot pack blocks")
        return self._packer

    def pool_bytes(self) -> np.ndarray:
        """The pool's bytes as a flat uint8 array (a view, made once), for copies that read
        blocks where they lie; only for a contiguous CPU pool."""
        if self._pool_bytes is None:
            self._pool_bytes = self.kv.reshape(-1).view(torch.uint8).numpy()
        return self._pool_bytes

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        """Pool block ids as an index tensor on the pool's device."""
        return torch.tensor(list(ids), dtype=torch.long, device=self.kv.device)

    def stored_blocks(self, ids: Sequence[int]) -> torch.Tensor:
        """Pool blocks `ids` in the store layout (packed when it packs)."""
        blocks = self.kv[self.index(ids)]
        if self.packs:
            blocks = self.packer().pack(blocks)
        return blocks

    def get_into(self, client: StoreClient, keys: list[bytes], ids: list[int], op: str) -> int:
        """Copy the leading held blocks of `keys` into pool blocks `ids`; how many. Where the
        pool holds blocks as they are stored (a CPU pool of the store layout), the client
        copies each straight into its pool block: no staging tensor to allocate and fault in,
        and no second copy (a 960-token pull of SmolLM2 in bf16 is 60 blocks, 22 MB)."""
        if self._takes_stored():
            got = self._transfer(client, keys, self.kv, op, rows=ids)
        else:
            staging, got = self.get_staged(client, keys, op)
            self.write_staged(staging[:got], ids[:got])
        self._metrics.miss(op, len(keys) - got)
        return got

    def _transfer(
        self,
        client: StoreClient,
        keys: list[bytes],
        out: torch.Tensor,
        op: str,
        rows: list[int] | None = None,
    ) -> int:
        """client.get_into(keys, out, rows); a failed transfer is counted and logged (0 blocks:
        a miss)."""
        try:
            return client.get_into(keys, out, rows=rows)
        except Exception as exc:  # noqa: BLE001 - a failed transfer is a miss
            self._metrics.error(op, exc)
            return 0

    def _takes_stored(self) -> bool:
        """Whether stored blocks are this pool's blocks byte for byte, in host memory."""
        return (
            not self.packs
            and self.kv.device.type == "cpu"
            and self.kv.is_contiguous()
            and tuple(self.kv.shape[1:]) == tuple(self.store_layout.block_shape)
            and self.kv.dtype == self.store_layout.dtype
        )

    def get_staged(
        self, client: StoreClient, keys: list[bytes], op: str
    ) -> tuple[torch.Tensor, int]:
        """The leading held blocks of `keys` in host memory, as stored (checked by the client: a
        block that fails its checks ends the run): (staging [len(keys), *store block], how many
        of its leading blocks hold them). A failed transfer is counted and logged (0 blocks)."""
        staging = torch.empty(
            (len(keys), *self.store_layout.block_shape),
            dtype=self.store_layout.dtype,
            pin_memory=self.kv.is_cuda,
        )
        return staging, self._transfer(client, keys, staging, op)

    def write_staged(self, staged: torch.Tensor, ids: list[int]) -> None:
        """Stored blocks from `get_staged` (unpacked when the store layout packs) into pool
        blocks `ids`."""
        if not ids:
            return
        idx = self.index(ids)
        blocks = staged.to(self.kv.device, non_blocking=True)
        if self.packs:
            blocks = self.packer().unpack(blocks, self.kv.dtype)
        self.kv[idx] = blocks
