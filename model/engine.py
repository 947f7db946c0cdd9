"""The single-process engine: chunked prefill then batched decode over one paged KV pool (the
reference)."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from model.kv_pool import KVPool
from model.loader import LoadedModel
from model.rules import finish_reason, prompt_problem
from model.sampling import SamplingParams, sample


class Timing(NamedTuple):
    prefill_s: float  # wall time from the call to every sequence's first token
    decode_s: float  # wall time of the batched decode steps after that
    decode_steps: int  # batched decode steps taken
    decode_tokens: int  # tokens the decode steps produced (all sequences)


class Engine:
    """Generates for one prompt or a batch of prompts in this process; the cluster is checked
    against it."""

    def __init__(
        self,
        lm: LoadedModel,
        num_blocks: int | None = None,
        block_size: int = 16,
        chunk_size: int = 512,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.lm = lm
        self.model = lm.model
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.kv_dtype = kv_dtype or lm.model.dtype
        # num_blocks=None: a pool sized on demand (grown when a batch needs more).
        self.fixed_blocks = num_blocks
        self.pool = (
            KVPool(lm.config, num_blocks, block_size, self.kv_dtype, lm.model.device)
            if num_blocks
            else None
        )
        self.last_timing = Timing(0.0, 0.0, 0, 0)  # of the last generate call

    def _pool_for(self, blocks: int) -> KVPool:
        if self.pool is None or (self.fixed_blocks is None and self.pool.num_blocks < blocks):
            self.pool = KVPool(
                self.lm.config, max(blocks, 64), self.block_size, self.kv_dtype, self.model.device
            )
        return self.pool

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """ValueError naming what is wrong with a prompt (empty, out-of-vocabulary ids, too
        long)."""
        c = self.lm.config
        problem = prompt_problem(prompt_ids, c.vocab_size, c.max_position_embeddings)
        if problem:
            raise ValueError(problem)

    def prefill(
        self, prompt_ids: list[int], pool: KVPool, block_table: list[int], start_pos: int = 0
    ) -> torch.Tensor:
        """Prefill prompt_ids[start_pos:] in chunks of chunk_size; next-token logits [vocab]."""
        ids = torch.as_tensor(prompt_ids, dtype=torch.long)
        logits = None
        for s in range(start_pos, len(prompt_ids), self.chunk_size):
            e = min(s + self.chunk_size, len(prompt_ids))
            logits = self.model.prefill(ids[s:e], pool, block_table, start_pos=s, last_only=True)
        assert logits is not None, "nothing to prefill"
        return logits[0]

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> list[int]:
        """New token ids for one prompt."""
        return self.generate_batch([prompt_ids], params)[0]

    @torch.inference_mode()
    def generate_batch(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """New token ids for each prompt: one prefill each, then decode steps over all unfinished
        sequences at once."""
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        if not prompts:
            return []
        for p in prompts:
            self.check_prompt(p)
        window = self.lm.config.max_position_embeddings
        budgets = [min(sp.max_tokens, window - len(p)) for p, sp in zip(prompts, plist)]
        bs = self.block_size
        need = [-(-(len(p) + n) // bs) for p, n in zip(prompts, budgets)]
        pool = self._pool_for(sum(need))
        tables: list[list[int]] = []
        try:
            for n in need:
                tables.append(pool.allocate(n))
            return self._run(prompts, plist, budgets, pool, tables)
        finally:
            for t in tables:
                pool.free(t)

    def _run(self, prompts, plist, budgets, pool: KVPool, tables) -> list[list[int]]:
        t0 = time.perf_counter()
        device = self.model.device
        gens = [sp.generator() for sp in plist]
        outs: list[list[int]] = [[] for _ in prompts]
        eos = self.lm.tokenizer.eos_token_ids

        def finished(i: int, tok: int) -> bool:
            outs[i].append(tok)
            return bool(finish_reason(outs[i], plist[i], eos, budgets[i], self.lm.tokenizer.decode))

        active = []
        for i, p in enumerate(prompts):
            logits = self.prefill(p, pool, tables[i])
            tok = int(sample(logits[None], [plist[i]], [gens[i]])[0])
            if not finished(i, tok):
                active.append(i)
        t1 = time.perf_counter()
        self.last_timing = Timing(t1 - t0, 0.0, 0, 0)
        if not active:
            return outs

        width = max(len(tables[i]) for i in active)
        table_t = torch.zeros(len(active), width, dtype=torch.int32)
        for row, i in enumerate(active):
            table_t[row, : len(tables[i])] = torch.tensor(tables[i], dtype=torch.int32)
        table_t = table_t.to(device)
        positions = torch.tensor([len(prompts[i]) for i in active], dtype=torch.long, device=device)
        tokens = torch.tensor([outs[i][-1] for i in active], dtype=torch.long, device=device)
        steps = produced = 0
        while active:
            steps += 1
            produced += len(active)
            logits = self.model.decode(tokens, pool, table_t, positions)
            tokens = sample(logits, [plist[i] for i in active], [gens[i] for i in active])
            positions += 1
            keep = [
                row
                for row, (i, tok) in enumerate(zip(active, tokens.tolist()))
                if not finished(i, tok)
            ]
            if len(keep) < len(active):
                active = [active[r] for r in keep]
                idx = torch.tensor(keep, dtype=torch.long, device=device)
                table_t, positions, tokens = table_t[idx], positions[idx], tokens[idx]
        self.last_timing = Timing(t1 - t0, time.perf_counter() - t1, steps, produced)
        return outs
