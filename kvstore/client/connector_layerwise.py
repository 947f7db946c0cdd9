"""Publishing a run of new full blocks to the store layer by layer, while prefill computes the
layers after (KVConnector.open_layerwise opens one)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvstore.client.store_client import BlockWriter

if TYPE_CHECKING:  # the connector makes publishers of itself: a cycle only for the checker
    from kvstore.client.connector import KVConnector


class LayerPublisher:
    """Streams the layers of a run of new full blocks to the store as prefill computes them.

    A CPU pool whose blocks are stored as they are, into this host's shared memory, is copied
    (and hashed) layer by layer in the caller's thread, straight from the pool: one C pass of a
    few tens of microseconds a layer. Handing that to a thread cost a 1,024-token prefill on 2
    cores 45-60 ms: the forward's OpenMP threads wait at every barrier for a core the publisher
    holds, and its Python work (a gather, then a copy and a hash per block) for the GIL. Other
    pools (a device, a packed store layout, a store across the network) gather each layer and
    send it from a background thread, while later layers compute. The commit goes out as soon as
    the last layer is written, from that thread, while the forward's last layer and its LM head
    still compute: a cold prompt's first token had waited 2.6-5.8 ms for it after the forward.
    Blocks whose every layer is written are complete whatever the forward does afterwards, so a
    forward that fails after that leaves them stored."""

    def __init__(self, connector: KVConnector, writer: BlockWriter, ids: torch.Tensor):
        self._pool, self._metrics = connector._pool, connector._metrics
        # the connector's one publishing thread: layers, commit and abort go out in order
        self._publisher = connector._publisher
        self._writer, self._ids = writer, ids
        self._futures: list[Future] = []
        self._inline_error: BaseException | None = None
        self._commit: Future | None = None  # sent at the last layer
        pool = self._pool.kv
        self._pool_bytes: np.ndarray | None = None  # the pool's bytes, where copied in place
        if not self._pool.packs and writer.can_copy_layers(pool):
            self._pool_bytes = self._pool.pool_bytes()
            elt = pool.element_size()
            self._layer_bytes = pool.stride(1) * elt
            self._offsets = [int(b) * pool.stride(0) * elt for b in ids.tolist()]

    def layer_done(self, layer: int) -> None:
        """Called after `layer` is computed: copied into the store now, or gathered now (a copy)
        and sent in the background."""
        if self._pool_bytes is not None:
            if self._inline_error is None:
                try:
                    shift = layer * self._layer_bytes
                    # the forward's threads would only wait for this copy: they share it
                    self._writer.copy_layer(
                        layer,
                        self._pool_bytes,
                        [o + shift for o in self._offsets],
                        threads=torch.get_num_threads(),
                    )
                except Exception as exc:  # noqa: BLE001 - raised again at finish (aborts)
                    self._inline_error = exc
        else:
            data = self._pool.kv[self._ids, layer]
            self._futures.append(self._publisher.submit(self._write, layer, data))
        if layer == self._writer.header.num_layers - 1 and self._inline_error is None:
            # after every layer's write on the publisher's one thread
            self._commit = self._publisher.submit(self._writer.commit)

    def _write(self, layer: int, data: torch.Tensor) -> None:
        if self._pool.packs:
            data = self._pool.packer().pack_layer(data)
        self._writer.write_layer(layer, data.to("cpu"))

    def finish(self, ok: bool) -> bool:
        """The commit's outcome where every layer went (sent at the last one); else commit when
        the forward succeeded, abort when it did not. Whether the store holds every one of the
        blocks now (it may have taken fewer: full, or evicting). A failure is counted and logged;
        `ensure_stored` tries again."""
        try:
            if self._inline_error is not None:
                raise self._inline_error
            for f in self._futures:
                f.result()
            if self._commit is not None:  # every layer went: complete blocks, stored
                result = self._commit.result()
            elif not ok:
                raise RuntimeError("the forward failed")
            else:
                result = self._publisher.submit(self._writer.commit).result()
            return result.held == self._ids.numel()
        except Exception as exc:  # noqa: BLE001 - counted and logged; the blocks are put again later
            if ok:
                self._metrics.error("publish_layerwise", exc)
            try:
                self._publisher.submit(self._writer.abort).result()
            except Exception as abort_exc:  # noqa: BLE001
                self._metrics.error("abort", abort_exc)
            return False
