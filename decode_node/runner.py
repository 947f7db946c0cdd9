"""The decode runner: the model, the paged pool and the KV connector; fills a sequence's blocks,
runs one batched decode step, and publishes a finished sequence's blocks."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from decode_node.config import DecodeConfig
from decode_node.metrics import DecodeMetrics
from decode_node.seq import Seq
from kernels import native_status
from kvstore import block_keys
from kvstore.client import KVConnector
from model import KVPool, finish_reason, sample
from model.cuda_graphs import GraphedStep, StaticInput, batch_sizes_upto
from protos import halfmoon_pb2 as pb
from servekit import blocks_needed, cpu_turns
from servekit.worker import load_worker_model

log = logging.getLogger(__name__)


def _tables(rows: list[list[int]]) -> torch.Tensor:
    """Block tables [B, widest] int32, zero-padded (built in numpy: a torch op per row cost a
    batch of 64 0.44 ms a step on a 2-core EPYC, now 0.05)."""
    out = np.zeros((len(rows), max(1, max(len(r) for r in rows))), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


class DecodeRunner:
    """Owns the model and a full-precision pool; the scheduler admits, steps and ends sequences
    through it. (KiviDecodeRunner keeps a KIVI-packed pool instead.)"""

    def __init__(self, config: DecodeConfig, metrics: DecodeMetrics, registry, lm=None):
        self.config, self.metrics = config, metrics
        wm = load_worker_model(config, lm)
        self.device, self.dtype, self.lm = wm.device, wm.dtype, wm.lm
        self.layout, self.fingerprint = wm.layout, wm.fingerprint
        self.eos = set(self.lm.tokenizer.eos_token_ids)
        self._pool_lock = threading.Lock()
        self.pool = self._make_pool()
        # forwards take turns at the CPUs with the host's other workers on them
        self.turns = cpu_turns(config, registry, self.device)
        self.turn_wait_ms = 0.0  # the last step's wait for its turn
        if self.device.type == "cpu":  # builds the fused kernels now, not in the first step
            metrics.fused_attention.set(1 if native_status().available else 0)
        self.kv = KVConnector(
            self.pool.kv if isinstance(self.pool, KVPool) else self.pool.packed.kv,
            self.layout,
            self.fingerprint,
            config.store_address,
            store_node=config.store_node,
            worker=config.worker_id,
            registry=registry,
            security=config.security,
            timeout_s=config.kv_timeout_s,
        )
        # on CUDA the step replays graphs captured now, one per batch size (model/cuda_graphs.py)
        self.graphs: GraphedStep | None = None
        if self._graphs_wanted():
            self.graphs = self._capture_graphs()

    def _graphs_wanted(self) -> bool:
        return (
            self.config.cuda_graphs
            and self.device.type == "cuda"
            and self.lm.model.decode_graph_safe
        )

    def _table_width(self, num_blocks: int) -> int:
        """Block-table columns a sequence can use: its longest context's blocks, at most the
        pool's."""
        longest = -(-self.lm.config.max_position_embeddings // self.config.block_size)
        return min(longest, num_blocks)

    def _graph_inputs(self) -> list[StaticInput]:
        """The step's inputs as the graphs hold them. Padding rows write their KV into a block
        of their own, taken from the pool here so that no sequence ever holds it."""
        pad = self.pool.allocate(1)[0]
        return [
            StaticInput(torch.long, 0, 0),  # each sequence's last token
            StaticInput(torch.int32, self._table_width(self.pool.num_blocks), pad),  # tables
            StaticInput(torch.long, 0, 0),  # positions
        ]

    def _capture_graphs(self) -> GraphedStep:
        t0 = time.perf_counter()
        graphs = GraphedStep(
            self._eager_step,
            self._graph_inputs(),
            batch_sizes_upto(self.config.max_batch),
            self.device,
            on_fallback=self._graph_fallback,
        )
        with torch.inference_mode():
            graphs.capture()
        self.metrics.graph_sizes.set(len(graphs.captured))
        log.info(
            "%s: decode step captured as CUDA graphs for batch sizes %s in %.1f s",
            self.config.worker_id, graphs.captured, time.perf_counter() - t0,
        )  # fmt: skip
        return graphs

    def _graph_fallback(self, reason: str) -> None:
        """A step that ran eagerly where a graph was meant to: counted and logged."""
        self.metrics.graph_fallbacks.labels(worker=self.config.worker_id, reason=reason).inc()
        log.warning("%s: a decode step ran without its CUDA graph (%s)", self.config.worker_id,
                    reason)  # fmt: skip

    def _make_pool(self):
        c = self.config
        num_blocks = c.num_blocks
        if c.kv_cache_bytes:
            num_blocks = c.kv_cache_bytes // self.layout.block_bytes
            if num_blocks < 1:
                raise ValueError(f"DecodeConfig.kv_cache_bytes ({c.kv_cache_bytes}) holds no block")
        # blocks hold the cache type's dtype (kv_cache_dtype fp16/bf16: 16 bits under fp32 compute)
        return KVPool(
            self.lm.config,
            num_blocks,
            c.block_size,
            self.layout.dtype,
            device=self.device,
            layout=self.layout,
        )

    def close(self) -> None:
        self.kv.close()

    @property
    def capacity_tokens(self) -> int:
        """KV tokens the pool holds when full."""
        return self.pool.num_blocks * self.config.block_size

    # ---- the pool ----

    def blocks_to_reserve(self, tokens: int) -> int:
        """Pool blocks a sequence of `tokens` tokens (prompt + every new token) holds at its
        longest: what admission reserves."""
        return blocks_needed(tokens, 0, self.config.block_size)

    def as_if_filled(self, s: Seq) -> None:
        """Make an admitted scratch sequence look as if its prompt's KV were in the pool (its
        slots hold whatever they hold): for timing steps, not for answers."""

    def admit(self, s: Seq) -> bool:
        """Reserve the sequence's blocks (its whole answer); False when the pool is short."""
        with self._pool_lock:
            if self.pool.num_free < s.need_blocks:
                return False
            s.table = self.pool.allocate(s.need_blocks)
        self.metrics.free.set(self.pool.num_free)
        return True

    def release(self, s: Seq) -> None:
        with self._pool_lock:
            if s.table:
                self.pool.free(s.table)
                s.table = []
        self.metrics.free.set(self.pool.num_free)

    # ---- KV in and out (io threads) ----

    def _pull_stored(self, s: Seq) -> int:
        """The prompt's stored blocks (all full blocks but the window the handle carries
        inline) into s.table; how many."""
        h = s.request.handle
        stored = list(h.block_keys)[: len(h.block_keys) - h.window_blocks]
        address = h.store_address or self.config.store_address
        return self.kv.pull(address, stored, s.table[: len(stored)])

    @torch.inference_mode()
    def fill(self, s: Seq) -> None:
        """The sequence's blocks with its prompt's KV: stored blocks from the store, the rest
        from the handle's inline tail. What cannot be loaded (evicted, corrupt, unreachable) is
        recomputed here: slower, never wrong."""
        if s.prefill_here:
            self._prefill_here(s)
            return
        t0 = time.perf_counter()
        h, bs = s.request.handle, self.config.block_size
        got = self._pull_stored(s)
        have = got * bs
        if got == len(h.block_keys) - h.window_blocks and h.tail_tokens:
            if self.kv.load_tail(h.tail, h.tail_tokens, s.table[got:]):
                have += h.tail_tokens
        self._filled(s, t0, have)
        if have < len(s.prompt):
            self._recompute_forward(s.prompt[have:], self.pool, s.table, have)

    def _prefill_here(self, s: Seq) -> None:
        """A prompt no prefill worker ran (conditional disaggregation): the leading blocks the
        handle names from this host's store, the rest computed here a chunk at a time between
        this worker's steps, and the first token sampled from the last position's logits as a
        prefill worker samples it (a fresh generator: the stream's own draws stay as they would
        be after a prefill worker). A planned block that cannot be loaded is computed: counted,
        never wrong."""
        t0 = time.perf_counter()
        bs, keys = self.config.block_size, list(s.request.handle.block_keys)
        got = self.kv.pull(self.config.store_address, keys, s.table[: len(keys)]) if keys else 0
        loaded_ms = (time.perf_counter() - t0) * 1000.0
        if got < len(keys):
            s.recomputed = (len(keys) - got) * bs
            self.metrics.recomputed.inc(s.recomputed)
        # the last position is computed whatever is stored: its logits give the first token
        start = min(got * bs, len(s.prompt) - 1)
        chunk = self.config.prefill_chunk_tokens
        logits = None
        for at in range(start, len(s.prompt), chunk):
            logits = self._recompute_forward(s.prompt[at : at + chunk], self.pool, s.table, at)
        assert logits is not None  # start < len(prompt)
        first = int(sample(logits.float(), [s.params], [s.params.generator()])[0])
        s.out = [first]
        s.transfer_ms = loaded_ms
        prefill_ms = (time.perf_counter() - t0) * 1000.0 - loaded_ms
        self.metrics.prefilled_here.inc(len(s.prompt) - start)
        s.prefilled = pb.PrefillReply(
            first_token=first,
            # from this host's store: its DRAM or SSD tier (the store counts which)
            cached_dram_tokens=start,
            computed_tokens=len(s.prompt) - start,
            prefill_ms=prefill_ms,
            transfer_ms=loaded_ms,
        )

    def _recompute_forward(
        self, tokens: list[int], pool, table: list[int], start: int
    ) -> torch.Tensor:
        """A prompt's `tokens` from position `start` on computed into `pool`'s blocks `table`:
        a forward like any other, taking its turn at the CPUs and handing it to a waiting step
        between layers. The last position's logits."""
        ids = torch.tensor(tokens, dtype=torch.long)
        with self.turns.turn():
            return self.lm.model.prefill(
                ids, pool, table, start, last_only=True, on_layer_done=lambda _: self.turns.share()
            )

    def _filled(self, s: Seq, t0: float, have: int) -> None:
        s.transfer_ms = (time.perf_counter() - t0) * 1000.0
        self.metrics.pull.observe(s.transfer_ms / 1000.0)
        if have < len(s.prompt):
            s.recomputed = len(s.prompt) - have
            self.metrics.recomputed.inc(s.recomputed)

    def _new_full_blocks(self, s: Seq) -> tuple[list[bytes], int]:
        """(keys of every full block whose KV is in the pool, the first one this host's store
        lacks)."""
        bs = self.config.block_size
        tokens = (s.prompt + s.out[:-1])[: s.position // bs * bs]
        keys = block_keys(tokens, bs, self.fingerprint, s.request.cache_salt)
        h = s.request.handle
        # The prompt's blocks are in this host's store only when the prefill's store is this
        # worker's own; else everything goes from block 0: the index counts a node's prefix
        # from the first block, so answer blocks alone would never be a hit on this host.
        if h.store_node and self.config.store_node:
            here = h.store_node == self.config.store_node
        else:
            here = (h.store_address or self.config.store_address) == self.config.store_address
        return keys, len(h.block_keys) if here else 0

    def publish(self, s: Seq) -> None:
        """The full blocks the answer added (prompt tail + answer) to this host's store, and the
        prompt's too when they were computed on another host."""
        keys, start = self._new_full_blocks(s)
        if len(keys) > start:
            parent = keys[start - 1] if start else None
            self.kv.put(keys[start:], s.table[start : len(keys)], parent)

    # ---- one step ----

    @torch.inference_mode()
    def step(self, batch: list[Seq]) -> list[int]:
        """One decode forward for every sequence of the batch; the token each samples."""
        tokens = torch.tensor([s.out[-1] for s in batch], dtype=torch.long)
        positions = torch.tensor([s.position for s in batch], dtype=torch.long)
        tables = _tables([s.table for s in batch])
        with self.turns.turn() as waited:
            self.turn_wait_ms = waited * 1000.0
            logits = (self.graphs or self._eager_step)(tokens, tables, positions)
        return self._sample(batch, logits)

    def _eager_step(self, tokens, tables, positions) -> torch.Tensor:
        return self.lm.model.decode(tokens, self.pool, tables, positions)

    @staticmethod
    def _sample(batch: list[Seq], logits: torch.Tensor) -> list[int]:
        """The token each row samples. Sampled rows run on the host: seeded generators give the
        same draws on any device. Greedy rows on a GPU take their argmax there, so that B token
        ids cross to the host rather than B rows of logits (at batch 64 SmolLM2's are 12.6 MB:
        the replayed step on an H200 went 4.56 -> 3.62 ms)."""
        params, gens = [s.params for s in batch], [s.generator for s in batch]
        if logits.device.type == "cpu":
            return sample(logits.float(), params, gens).tolist()
        out = logits.argmax(dim=-1).cpu()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            picked = sample(
                logits[rows].float().cpu(), [params[i] for i in rows], [gens[i] for i in rows]
            )
            out[rows] = picked
        return out.tolist()

    def finish_reason(self, s: Seq) -> str:
        """'' while the sequence goes on; else why it ends (model.finish_reason, as Engine)."""
        return finish_reason(s.out, s.params, self.eos, s.budget, self.lm.tokenizer.decode)
