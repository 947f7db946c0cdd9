"""The decode runner: the model, the paged pool and the KV connector; fills a sequence's blocks,
runs one batched decode step, and publishes a finished sequence's blocks."""

from __future__ import annotations

import threading
import time

import torch

from decode_node.config import DecodeConfig
from decode_node.metrics import DecodeMetrics
from decode_node.seq import Seq
from kvstore import KVConnector, block_keys
from model import finish_reason, sample
from servekit import load_worker_model


class DecodeRunner:
    """Owns the model and the pool; the scheduler admits, steps and ends sequences through it."""

    def __init__(self, config: DecodeConfig, metrics: DecodeMetrics, registry, lm=None):
        self.config, self.metrics = config, metrics
        self.device, self.lm, self.pool, self.fingerprint = load_worker_model(config, lm)
        self.eos = set(self.lm.tokenizer.eos_token_ids)
        self._pool_lock = threading.Lock()
        self.kv = KVConnector(
            self.pool.kv,
            self.pool.layout,
            self.fingerprint,
            config.store_address,
            store_node=config.store_node,
            worker=config.worker_id,
            registry=registry,
        )

    def close(self) -> None:
        self.kv.close()

    # ---- the pool ----

    def try_allocate(self, n: int) -> list[int] | None:
        """n pool blocks, or None when fewer are free."""
        with self._pool_lock:
            if self.pool.num_free < n:
                return None
            ids = self.pool.allocate(n)
        self.metrics.free.set(self.pool.num_free)
        return ids

    def release(self, s: Seq) -> None:
        with self._pool_lock:
            if s.table:
                self.pool.free(s.table)
                s.table = []
        self.metrics.free.set(self.pool.num_free)

    # ---- KV in and out (io threads) ----

    @torch.inference_mode()
    def fill(self, s: Seq) -> None:
        """The sequence's blocks with its prompt's KV: full blocks from the store, the tail from
        the handle. What cannot be pulled (evicted, corrupt, unreachable) is recomputed here:
        slower, never wrong."""
        t0 = time.perf_counter()
        h, bs = s.request.handle, self.config.block_size
        keys = list(h.block_keys)
        got = self.kv.pull(h.store_address or self.config.store_address, keys, s.table[: len(keys)])
        have = got * bs
        if got == len(keys) and h.tail_tokens:
            if self.kv.load_tail(h.tail, h.tail_tokens, s.table[got]):
                have += h.tail_tokens
        s.transfer_ms = (time.perf_counter() - t0) * 1000.0
        self.metrics.pull.observe(s.transfer_ms / 1000.0)
        if have < len(s.prompt):
            s.recomputed = len(s.prompt) - have
            self.metrics.recomputed.inc(s.recomputed)
            ids = torch.tensor(s.prompt[have:], dtype=torch.long)
            self.lm.model.prefill(ids, self.pool, s.table, have, last_only=True)

    def publish(self, s: Seq) -> None:
        """The full blocks the answer added (prompt tail + answer) to the store."""
        bs = self.config.block_size
        done = s.position  # tokens whose KV is in the pool
        tokens = s.prompt + s.out[:-1]
        keys = block_keys(tokens[: done // bs * bs], bs, self.fingerprint, s.request.cache_salt)
        start = len(s.request.handle.block_keys)
        if len(keys) > start:
            self.kv.put(
                keys[start:], s.table[start : len(keys)], keys[start - 1] if start else None
            )

    # ---- one step ----

    @torch.inference_mode()
    def step(self, batch: list[Seq]) -> list[int]:
        """One decode forward for every sequence of the batch; the token each samples."""
        width = max(len(s.table) for s in batch)
        tables = torch.zeros(len(batch), width, dtype=torch.int32)
        for i, s in enumerate(batch):
            tables[i, : len(s.table)] = torch.tensor(s.table, dtype=torch.int32)
        tokens = torch.tensor([s.out[-1] for s in batch], dtype=torch.long)
        positions = torch.tensor([s.position for s in batch], dtype=torch.long)
        logits = self.lm.model.decode(tokens, self.pool, tables, positions)
        # Sampling runs on the host: seeded generators give the same draws on any device.
        return sample(
            logits.float().cpu(), [s.params for s in batch], [s.generator for s in batch]
        ).tolist()

    def finish_reason(self, s: Seq) -> str:
        """'' while the sequence goes on; else why it ends (model.finish_reason, as Engine)."""
        return finish_reason(s.out, s.params, self.eos, s.budget, self.lm.tokenizer.decode)
