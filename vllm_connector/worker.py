"""The worker side of the connector, without vLLM: loads a step's blocks from the store into
vLLM's per-layer caches (fetched before the forward, written into each layer as the forward
reaches it) and saves the blocks a step completed, layer by layer as the forward computes them,
to the store from a background thread (bounded: past the bound a save is dropped, counted, and
the blocks are only missing from the store later, never wrong)."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from kvstore import StoreFull, StoreUnavailable
from vllm_connector.layout import CacheLayout, detect_layout, gather_blocks, scatter_blocks
from vllm_connector.plan import LoadItem, SaveItem, StepPlan, StoreClients

log = logging.getLogger(__name__)

COUNTERS = (
    "loaded_blocks",  # blocks loaded from the store into vLLM's pool
    "failed_blocks",  # blocks planned for a load that the store did not give (miss, corrupt)
    "saved_blocks",  # blocks the store holds after a save (new or held before)
    "dropped_blocks",  # blocks not saved: the queue was full, or the store refused or failed
)


@dataclass
class _Load:
    item: LoadItem
    staging: torch.Tensor  # [n, layers, 2, H, block, C], the first `got` rows valid
    got: int


@dataclass
class _Save:
    item: SaveItem
    layers: list[torch.Tensor | None]  # one gathered [n, 2, H, block, C] per layer
    nbytes: int = 0


@dataclass
class Counters:
    values: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, n: int) -> None:
        with self.lock:
            self.values[name] += n
            self.totals[name] += n

    def take(self) -> dict[str, int]:
        """The counts since the last take (vLLM takes them every step: its stats are per
        interval)."""
        with self.lock:
            out, self.values = self.values, dict.fromkeys(COUNTERS, 0)
        return out

    def total(self) -> dict[str, int]:
        """The counts since the start."""
        with self.lock:
            return dict(self.totals)


class LayerIO:
    """Loads into and saves from one vLLM worker's KV caches (register() them first)."""

    def __init__(
        self,
        fingerprint: str,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        num_blocks: int,
        transport: str = "auto",
        queue_bytes: int = 256 << 20,
        timeout_s: float = 30.0,
    ):
        self.fingerprint, self.block_size = fingerprint, block_size
        self._heads, self._head_size, self._num_blocks = num_kv_heads, head_size, num_blocks
        self._clients = StoreClients(transport, timeout_s)
        self.layers: list[str] = []
        self._layer_index: dict[str, int] = {}  # a layer's name -> its place in a block
        self._caches: dict[str, torch.Tensor] = {}
        self.layout: CacheLayout | None = None
        self._loads: list[_Load] = []
        self._saves: list[_Save] = []
        self._errors: set[int] = set()
        self.counters = Counters()
        self._queue_bytes = queue_bytes
        self._pending = 0  # bytes queued for the writer
        self._pending_lock = threading.Lock()
        self._queue: queue.Queue[_Save | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="halfmoon-save", daemon=True)
        self._writer.start()

    def register(self, caches: dict[str, torch.Tensor]) -> None:
        """vLLM's caches by layer name, in the model's layer order."""
        self._caches = dict(caches)
        self.layers = list(caches)
        self._layer_index = {name: i for i, name in enumerate(self.layers)}
        first = next(iter(caches.values()))
        self.layout = detect_layout(
            first, self._heads, self._head_size, self.block_size, self._num_blocks
        )
        for name, kv in caches.items():
            if tuple(kv.shape) != tuple(first.shape) or kv.dtype != first.dtype:
                raise ValueError(
                    f"layer {name}'s KV cache {tuple(kv.shape)} differs from the first"
                )

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self._caches.values())).dtype

    # ------------------------------------------------------------------ loads

    def start(self, plan: StepPlan) -> None:
        """Fetch the step's loads (all layers); a block the store does not give, and every one
        after it in its request, is a load error: vLLM recomputes from there."""
        assert self.layout is not None, "register() the caches first"
        self._loads = []
        shape = self.layout.block_shape(len(self.layers))
        for item in plan.loads:
            staging = torch.empty((len(item.keys), *shape), dtype=self.dtype)
            try:
                got = self._clients.get(item.address).get_into(item.keys, staging)
            except (StoreUnavailable, ConnectionError, ValueError) as e:
                log.warning(
                    "halfmoon connector: load of %d blocks from %s failed: %s",
                    len(item.keys),
                    item.address,
                    e,
                )
                got = 0
            if got < len(item.keys):
                log.warning(
                    "halfmoon connector: %s got %d of %d blocks; the rest is recomputed",
                    item.req_id,
                    got,
                    len(item.keys),
                )
                self._errors.update(item.block_ids[got:])
                self.counters.add("failed_blocks", len(item.keys) - got)
            self.counters.add("loaded_blocks", got)
            if got:
                self._loads.append(_Load(item, staging, got))

    def layer_loaded(self, layer: str) -> None:
        """Write the fetched blocks of `layer` into its cache (just before its attention)."""
        i = self._layer_index.get(layer)
        if not self._loads or i is None:
            return
        assert self.layout is not None
        for ld in self._loads:
            ids = ld.item.block_ids[: ld.got]
            scatter_blocks(self._caches[layer], ids, ld.staging[: ld.got, i], self.layout)

    def take_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    # ------------------------------------------------------------------ saves

    def begin_saves(self, plan: StepPlan) -> None:
        self._saves = [_Save(item, [None] * len(self.layers)) for item in plan.saves]

    def save_layer(self, layer: str, kv: torch.Tensor) -> None:
        """Copy this step's saved blocks out of `layer`'s cache (its attention just wrote it)."""
        i = self._layer_index.get(layer)
        if not self._saves or i is None:
            return
        assert self.layout is not None
        for s in self._saves:
            s.layers[i] = gather_blocks(kv, s.item.block_ids, self.layout)

    def submit(self) -> None:
        """Hand the step's saves to the writer, or drop (and count) what would overfill it."""
        for s in self._saves:
            if any(t is None for t in s.layers):
                log.warning(
                    "halfmoon connector: a save of %s missed layers; dropped", s.item.req_id
                )
                self.counters.add("dropped_blocks", len(s.item.keys))
                continue
            s.nbytes = sum(t.numel() * t.element_size() for t in s.layers if t is not None)
            with self._pending_lock:
                full = self._pending + s.nbytes > self._queue_bytes
                if not full:
                    self._pending += s.nbytes
            if full:
                log.warning(
                    "halfmoon connector: save queue full (%d bytes); %d blocks dropped",
                    self._queue_bytes,
                    len(s.item.keys),
                )
                self.counters.add("dropped_blocks", len(s.item.keys))
                continue
            self._queue.put(s)
        self._saves = []

    def _write_loop(self) -> None:
        while (s := self._queue.get()) is not None:
            try:
                blocks = torch.stack([t for t in s.layers if t is not None], dim=1)
                held = self._clients.get(s.item.address).put(
                    s.item.keys, blocks, self.fingerprint, parent=s.item.parent
                )
                self.counters.add("saved_blocks", held)
                self.counters.add("dropped_blocks", len(s.item.keys) - held)
            except (StoreFull, StoreUnavailable, ConnectionError, ValueError) as e:
                log.warning(
                    "halfmoon connector: save of %d blocks to %s failed: %s",
                    len(s.item.keys),
                    s.item.address,
                    e,
                )
                self.counters.add("dropped_blocks", len(s.item.keys))
            finally:
                with self._pending_lock:
                    self._pending -= s.nbytes
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued save is written."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=10)
        self._clients.close()
