"""The decode runner of a KIVI KV cache (kv_cache_dtype kivi4 | kivi2): each sequence keeps its
quantized part in packed blocks and its most recent tokens (the residual window, at most
kivi_residual + block_size of them) in full-precision window blocks. A window block is packed as
it leaves the window; attention covers both parts, merged exactly."""

from __future__ import annotations

import time

import torch

from decode_node.runner import DecodeRunner, _tables
from decode_node.seq import Seq
from kvstore.client import write_tokens
from model import KiviPool, KVPool
from model.cuda_graphs import StaticInput
from servekit import blocks_needed


class KiviDecodeRunner(DecodeRunner):
    """DecodeRunner over a model.KiviPool; packed blocks travel to and from the store as they
    are, never through full precision."""

    def _make_pool(self) -> KiviPool:
        c, layout = self.config, self.layout
        per_seq = layout.residual // c.block_size + 1
        # and one more for the padding rows of CUDA graphs' batches (model/cuda_graphs.py)
        window_blocks = c.max_batch * per_seq + (1 if self._graphs_wanted() else 0)
        num_blocks = c.num_blocks
        if c.kv_cache_bytes:
            window_bytes = window_blocks * layout.window_layout.block_bytes
            num_blocks = (c.kv_cache_bytes - window_bytes) // layout.block_bytes
            if num_blocks < 1:
                raise ValueError(
                    f"DecodeConfig.kv_cache_bytes ({c.kv_cache_bytes}) does not hold the windows "
                    f"of {c.max_batch} sequences ({window_bytes} bytes) and a packed block"
                )
        return KiviPool(self.lm.config, layout, num_blocks, window_blocks, self.device)

    # ---- the pool ----

    def blocks_to_reserve(self, tokens: int) -> int:
        """Packed blocks only: a sequence's last `residual` tokens (at least) stay in its window
        and are never packed, so it packs at most (tokens - residual) // block_size blocks (the
        rule `step` and the prefill's handle follow). Its window blocks are reserved apart."""
        return blocks_needed(tokens, 0, self.config.block_size, self.layout.residual)

    def as_if_filled(self, s: Seq) -> None:
        """All but the last `residual` (or more) prompt tokens packed, as `fill` leaves them."""
        s.n_packed = blocks_needed(len(s.prompt), 0, self.config.block_size, self.layout.residual)

    def admit(self, s: Seq) -> bool:
        """Packed blocks for the whole answer and the window's blocks; False when short."""
        pool = self.pool
        with self._pool_lock:
            per_seq = pool.window_blocks_per_seq
            if pool.packed.num_free < s.need_blocks or pool.window.num_free < per_seq:
                return False
            s.table = pool.packed.allocate(s.need_blocks)
            s.window = pool.window.allocate(per_seq)
            s.n_packed = 0
        self.metrics.free.set(pool.num_free)
        return True

    def release(self, s: Seq) -> None:
        with self._pool_lock:
            if s.table:
                self.pool.packed.free(s.table)
                s.table = []
            if s.window:
                self.pool.window.free(s.window)
                s.window = []
        self.metrics.free.set(self.pool.num_free)

    def _window_tokens(self, s: Seq, written: int) -> int:
        """Tokens in the window once `written` tokens of the sequence are in the pool."""
        return written - s.n_packed * self.config.block_size

    # ---- KV in (io threads) ----

    @torch.inference_mode()
    def fill(self, s: Seq) -> None:
        """Packed blocks from the store straight into the packed pool, the window from the
        handle's inline tail; what is missing is recomputed (in full precision, attending to
        the dequantized packed part, as KIVI's own prefill would) and then split the same way."""
        t0 = time.perf_counter()
        h = s.request.handle
        stored = len(h.block_keys) - h.window_blocks
        got = self._pull_stored(s)
        tail = None
        if got == stored:
            tail = (
                self.kv.decode_tail(h.tail, h.tail_tokens, self.pool.window.block_shape)
                if h.tail_tokens
                else torch.empty(0)
            )
        if tail is not None and self._window_fits(h.tail_tokens):
            s.n_packed = stored
            if h.tail_tokens:
                write_tokens(
                    self.pool.window.kv, s.window, tail.to(self.device, self.pool.window.dtype)
                )
            self._filled(s, t0, len(s.prompt))
            return
        self._filled(s, t0, got * self.config.block_size)
        self._recompute(s, got)

    def _window_fits(self, tokens: int) -> bool:
        return tokens < self.pool.window_blocks_per_seq * self.config.block_size

    def _recompute(self, s: Seq, got: int) -> None:
        """Prefill the prompt after its first `got` packed blocks in a scratch full-precision
        pool, then keep the prompt's last residual tokens (and its partial block) in the window
        and pack the full blocks before them."""
        bs, layout = self.config.block_size, self.layout
        n = len(s.prompt)
        blocks = -(-n // bs)
        scratch = KVPool(self.lm.config, blocks, bs, self.dtype, device=self.device)
        ids = list(range(blocks))
        if got:
            packed = self.pool.packed.kv[torch.tensor(s.table[:got], device=self.device)]
            scratch.kv[:got] = layout.unpack(packed, self.dtype)
        self._recompute_forward(s.prompt[got * bs :], scratch, ids, got * bs)
        window_full = min(n // bs, layout.residual // bs)
        s.n_packed = n // bs - window_full
        if s.n_packed > got:
            idx = torch.tensor(s.table[got : s.n_packed], device=self.device)
            self.pool.packed.kv[idx] = layout.pack(scratch.kv[got : s.n_packed])
        rest = scratch.kv[s.n_packed :]  # the window's blocks, in order
        win = torch.tensor(s.window[: rest.shape[0]], device=self.device)
        self.pool.window.kv[win] = rest.to(self.pool.window.dtype)

    # ---- KV out ----

    def publish(self, s: Seq) -> None:
        """The full blocks the answer added, packed (from the packed pool, or packed now from
        the window), to the store."""
        keys, start = self._new_full_blocks(s)
        if len(keys) <= start:
            return
        out = []
        for i in range(start, len(keys)):
            if i < s.n_packed:
                out.append(self.pool.packed.kv[s.table[i]])
            else:
                block = self.pool.window.kv[s.window[i - s.n_packed]][None]
                out.append(self.layout.pack(block)[0])
        parent = keys[start - 1] if start else None
        self.kv.put_blocks(keys[start:], torch.stack(out), parent)

    # ---- one step ----

    @torch.inference_mode()
    def step(self, batch: list[Seq]) -> list[int]:
        """One decode forward over packed blocks + windows; then every window that outgrew
        residual + block_size tokens packs its oldest block."""
        bs = self.config.block_size
        tokens = torch.tensor([s.out[-1] for s in batch], dtype=torch.long)
        positions = torch.tensor([s.position for s in batch], dtype=torch.long)
        packed_lens = torch.tensor([s.n_packed * bs for s in batch], dtype=torch.int32)
        packed_tables = _tables([s.table[: s.n_packed] for s in batch])
        window_tables = _tables([s.window for s in batch])
        with self.turns.turn() as waited:
            self.turn_wait_ms = waited * 1000.0
            logits = (self.graphs or self._eager_step)(
                tokens, packed_tables, packed_lens, window_tables, positions
            )
        for s in batch:
            if self._window_tokens(s, s.position + 1) >= self.layout.residual + bs:
                self._pack_oldest(s)
        return self._sample(batch, logits)

    def _eager_step(self, tokens, packed_tables, packed_lens, window_tables, positions):
        return self.lm.model.decode_kivi(
            tokens, self.pool, packed_tables, packed_lens, window_tables, positions
        )

    def _graph_inputs(self) -> list[StaticInput]:
        """As DecodeRunner's: padding rows have no packed tokens and write their KV into a
        window block of their own (the pool has one more for them)."""
        pool = self.pool
        pad = pool.window.allocate(1)[0]
        return [
            StaticInput(torch.long, 0, 0),  # tokens
            StaticInput(torch.int32, self._table_width(pool.packed.num_blocks), 0),  # packed
            StaticInput(torch.int32, 0, 0),  # packed tokens
            StaticInput(torch.int32, pool.window_blocks_per_seq, pad),  # window tables
            StaticInput(torch.long, 0, 0),  # positions
        ]

    def _pack_oldest(self, s: Seq) -> None:
        """The window's oldest (full) block becomes the sequence's next packed block; its window
        block goes to the back of the window, for the tokens to come."""
        oldest = s.window[0]
        dst = s.table[s.n_packed]
        block = self.pool.window.kv[oldest][None]
        self.pool.packed.kv[dst] = self.layout.pack(block)[0]
        s.window = s.window[1:] + [oldest]
        s.n_packed += 1
