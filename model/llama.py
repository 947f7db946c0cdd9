"""The Llama-family decoder with a paged KV cache: `prefill` (a prompt or its continuation) and
batched `decode`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn

import kernels
from model.config import ModelConfig
from model.kv_pool import KVPool


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim/2] in fp32, with the checkpoint's scaling applied."""
    d = config.head_dim
    # on the CPU even under a meta-device build: meta arithmetic imports torch._dynamo (and
    # triton), ~100 MB resident in a server that never compiles
    steps = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (config.rope_theta ** (steps / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = (
            float(scaling.get("low_freq_factor", 1.0)),
            float(scaling.get("high_freq_factor", 4.0)),
        )
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kernels.rms_norm(x, weight, eps)


# The table of a fresh K/V passed as one block
_ONE_BLOCK = torch.zeros(1, dtype=torch.long)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, D] -> [1, heads, T, D]: SDPA takes its CPU flash kernel only for 4-D inputs."""
    return x.transpose(0, 1)[None]


class _SeqPlan(NamedTuple):
    """One sequence's part of a prefill forward."""

    token_ids: torch.Tensor  # [T] new tokens
    positions: torch.Tensor  # [T] their positions, start_pos.. start_pos+T-1
    table: torch.Tensor  # [n_blocks] pool blocks covering [0, end)
    slot_block: torch.Tensor  # [T] pool block each new token's KV goes to
    slot_off: torch.Tensor  # [T] offset in that block
    end: int  # positions attended: start_pos + T
    mask: (
        torch.Tensor | None
    )  # [T, end] causal mask over the pool's prefix + new KV; None = causal SDPA on fresh K/V


# A layer's projection weights, the ones prepack_weights packs.
_PACKED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LlamaLayer(nn.Module):
    """One decoder layer; Q, K, V and gate, up are fused into one matmul each."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_norm = nn.Parameter(torch.ones(h))
        self.qkv_proj = nn.Parameter(torch.empty(config.q_size + 2 * config.kv_size, h))
        self.o_proj = nn.Parameter(torch.empty(h, config.q_size))
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * config.intermediate_size, h))
        self.down_proj = nn.Parameter(torch.empty(h, config.intermediate_size))


class LlamaModel(nn.Module):
    """RMSNorm, RoPE, grouped-query attention, SwiGLU; tied or untied embeddings."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(LlamaLayer(config) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        )
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        # the tied LM head packed (prepack_weights). In panels, token lookups gather their rows
        # from it and the plain embedding goes (None): SmolLM2's head is 108 MiB in fp32. A
        # oneDNN-packed head is opaque, and the plain embedding stays beside it.
        self.register_buffer("packed_head", None, persistent=False)
        self.scale = config.head_dim**-0.5
        # decode's layers in one C call where they apply (kernels/decode_step.py); False runs
        # them layer by layer from Python (the same bits: tests compare the two)
        self.fused_decode = True
        self._fused_layers: kernels.DecodeLayers | None | bool = None  # None: not built yet

    def _apply(self, fn, recurse=True):
        self._fused_layers = None  # moved or cast weights: the pointers change
        return super()._apply(fn, recurse)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def decode_graph_safe(self) -> bool:
        """`decode` and `decode_kivi` run no host sync and allocate by shape alone: a CUDA
        graph can capture them (model/cuda_graphs.py)."""
        return True

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `token_ids` [n] -> [n, hidden], from the plain table or, where
        a tied head replaced it, gathered from the head's panels."""
        if self.embed_tokens is not None:
            return self.embed_tokens[token_ids]
        return kernels.weight_rows(self.packed_head, token_ids)

    # ---- weights in oneDNN's packed layout (kernels/packed_linear.py) ----

    def prepack_weights(self, form: str = "panels") -> bool:
        """Swap every projection and the LM head for a packed copy, which is faster for the few
        rows of a decode step (kernels/packed_linear.py; `form`: its PACK_FORMS); the values
        are unchanged and `hf_state_dict` unpacks them. A tied head in panels replaces the plain
        embedding (lookups gather from it); packed by oneDNN it is a copy beside it. False, and
        nothing changed, where the device and dtype have no packed path."""
        if not kernels.prepack_supported(self.dtype, self.device):
            return False
        self._fused_layers = None
        with torch.no_grad():
            # (module, attribute) of each weight still plain, in the order a step reads them
            todo = [
                (layer, name)
                for layer in self.layers
                for name in _PACKED_PROJECTIONS
                if not kernels.is_packed(getattr(layer, name))
            ]
            if self.lm_head is not None and not kernels.is_packed(self.lm_head):
                todo.append((self, "lm_head"))
            # each packed weight takes its plain one's place at once (prepack_many lets go of
            # it), so the load never holds two copies of the weights
            plain = [getattr(m, name) for m, name in todo]
            for (module, name), weight in zip(todo, kernels.prepack_many(plain, form)):
                setattr(module, name, nn.Parameter(weight, False))
            if self.lm_head is None and self.packed_head is None:
                # "auto" packs a tied head in panels whatever it picks for the projections: the
                # head multiplies a few rows (decode steps, prefill's last tokens), where panels
                # are the fastest form, and panels double as the embedding
                head_form = "panels" if form == "auto" else form
                (self.packed_head,) = kernels.prepack_many([self.embed_tokens], head_form)
                if not self.packed_head.is_mkldnn:  # panels: lookups read them (embed)
                    self.embed_tokens = None
        return True

    def _head(self) -> torch.Tensor:
        """The LM head's weight, packed where prepack_weights made it so."""
        if self.lm_head is not None:
            return self.lm_head
        return self.embed_tokens if self.packed_head is None else self.packed_head

    # ---- weights in HF naming (LlamaForCausalLM), for loaders and exporters ----

    def load_hf_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Copy weights named as in HF's LlamaForCausalLM (q/k/v and gate/up are fused here)."""
        missing = []

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                missing.append(name)
                return torch.empty(0)
            return sd[name]

        with torch.no_grad():
            self._copy(
                self.embed_tokens, take("model.embed_tokens.weight"), "model.embed_tokens.weight"
            )
            self._copy(self.norm, take("model.norm.weight"), "model.norm.weight")
            if self.lm_head is not None:
                self._copy(self.lm_head, take("lm_head.weight"), "lm_head.weight")
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                parts = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
                gate_up = [take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
                if missing:
                    break
                self._copy(
                    layer.input_norm,
                    take(p + "input_layernorm.weight"),
                    p + "input_layernorm.weight",
                )
                self._copy(layer.qkv_proj, torch.cat(parts), p + "self_attn.qkv")
                self._copy(
                    layer.o_proj, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight"
                )
                self._copy(
                    layer.post_norm,
                    take(p + "post_attention_layernorm.weight"),
                    p + "post_attention_layernorm.weight",
                )
                self._copy(layer.gate_up_proj, torch.cat(gate_up), p + "mlp.gate_up")
                self._copy(
                    layer.down_proj, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight"
                )
        if missing:
            raise ValueError(
                f"checkpoint lacks tensors: {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}"
            )

    @staticmethod
    def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"tensor {name}: shape {tuple(value.shape)} does not match the config's "
                f"{tuple(param.shape)}"
            )
        param.copy_(value)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights named as in HF's LlamaForCausalLM (fp32 copies)."""
        c = self.config
        embed = self.embed_tokens
        if embed is None:  # a tied head in panels holds the embedding
            embed = kernels.unpack(self.packed_head)
        sd = {"model.embed_tokens.weight": embed, "model.norm.weight": self.norm}
        if self.lm_head is not None:
            sd["lm_head.weight"] = kernels.unpack(self.lm_head)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, k, v = kernels.unpack(layer.qkv_proj).split([c.q_size, c.kv_size, c.kv_size])
            gate, up = kernels.unpack(layer.gate_up_proj).split([c.intermediate_size] * 2)
            sd.update(
                {
                    p + "input_layernorm.weight": layer.input_norm,
                    p + "self_attn.q_proj.weight": q,
                    p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v,
                    p + "self_attn.o_proj.weight": kernels.unpack(layer.o_proj),
                    p + "post_attention_layernorm.weight": layer.post_norm,
                    p + "mlp.gate_proj.weight": gate,
                    p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": kernels.unpack(layer.down_proj),
                }
            )
        return {k: v.detach().float().contiguous().clone() for k, v in sd.items()}

    # ---- forward pieces ----

    def _rope_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [N, 1, head_dim/2] for positions [N], computed in fp32 once per forward
        (as HF), in the model dtype."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(self.dtype)[:, None, :], freqs.sin().to(self.dtype)[:, None, :]

    def _qkv(self, layer: LlamaLayer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        c = self.config
        h = _rms_norm(x, layer.input_norm, c.rms_norm_eps)
        qkv = kernels.linear(h, layer.qkv_proj)
        n = x.shape[0]
        # q and k rotated in place, in the projection's own output
        qk = kernels.rope_(
            qkv[:, : c.q_size + c.kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim), *rope
        )
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        v = qkv[:, c.q_size + c.kv_size :].view(n, c.num_kv_heads, c.head_dim)
        return q, k, v

    def _mlp(self, layer: LlamaLayer, x: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(x, layer.post_norm, self.config.rms_norm_eps)
        # the residual is added in place (in the matmul's own pass where it can be)
        act = kernels.linear_silu_mul(h, layer.gate_up_proj)
        return kernels.linear_add_(x, act, layer.down_proj)

    def _decode_layers(self, pool: KVPool):
        """The fused decode layers for this pool, or None where they do not apply."""
        if not self.fused_decode or pool.dtype != self.dtype or pool.kv.dim() != 6:
            return None
        if self._fused_layers is None:
            c = self.config
            fused = kernels.DecodeLayers.build(
                [
                    kernels.LayerWeights(
                        layer.input_norm, layer.qkv_proj, layer.o_proj, layer.post_norm,
                        layer.gate_up_proj, layer.down_proj,
                    )  # fmt: skip
                    for layer in self.layers
                ],
                c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                c.rms_norm_eps, self.scale,
            )  # fmt: skip
            self._fused_layers = fused or False
        fused = self._fused_layers
        return fused if fused and fused.fits_pool(*pool.layer_kv(0)) else None

    def _fused_step(self, fused, token_ids, positions, pool, tables, pool_positions, kivi=None):
        """One decode step on the fused layers: each token's KV written at pool_positions of its
        table's blocks in `pool` (a full-precision pool, or a KIVI pool's window after its
        packed blocks `kivi`), rotated for its position in the sequence; fp32 logits."""
        cos, sin = self._rope_table(positions)
        x = self.embed(token_ids)
        # layer l's K lies pool.kv.stride(1) elements after layer l-1's (full layout)
        fused.run(x, pool.layer_kv(0), pool.kv.stride(1), tables, pool_positions, cos, sin, kivi)
        return self._logits(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = _rms_norm(x, self.norm, self.config.rms_norm_eps)
        return kernels.linear(x, self._head()).float()

    def _check_tokens(self, token_ids: torch.Tensor) -> None:
        if token_ids.numel() and (
            int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size
        ):
            raise ValueError(f"token id out of range [0, {self.config.vocab_size})")

    def _plan(
        self, token_ids: torch.Tensor, pool: KVPool, block_table: list[int], start_pos: int
    ) -> _SeqPlan:
        """Validate one sequence's prefill arguments and work out its positions, slots and attention
        mode."""
        c, bs = self.config, pool.block_size
        token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        t = token_ids.numel()
        end = start_pos + t
        if t == 0:
            raise ValueError("prefill needs at least one token")
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        if end > c.max_position_embeddings:
            raise ValueError(
                f"positions up to {end} exceed the context window of "
                f"{c.max_position_embeddings} tokens"
            )
        n_blocks = -(-end // bs)
        if len(block_table) < n_blocks:
            raise ValueError(
                f"block table has {len(block_table)} blocks, {n_blocks} needed for {end} tokens"
            )
        self._check_tokens(token_ids)

        positions = torch.arange(start_pos, end, device=self.device)
        table = torch.as_tensor(block_table[:n_blocks], dtype=torch.long, device=self.device)
        direct = (
            start_pos == 0 and pool.dtype == self.dtype
        )  # no cached prefix: attend to the fresh K/V
        mask = None
        if not direct:
            mask = (
                torch.arange(end, device=self.device)[None, :] <= positions[:, None]
            )  # causal over prefix + new tokens
        return _SeqPlan(
            token_ids, positions, table, table[positions // bs], positions % bs, end, mask
        )

    def _attend(
        self, plan: _SeqPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache, v_cache
    ) -> torch.Tensor:
        """One sequence's attention output [T, q_size], its new KV being in the pool already:
        over the fresh K/V when nothing precedes them (and the pool keeps the model's dtype),
        else over the pool's blocks of the sequence."""
        t = q.shape[0]
        if plan.mask is None:
            keys, values, table = k[None], v[None], _ONE_BLOCK
        else:
            keys, values, table = k_cache, v_cache, plan.table
        attn = kernels.prefill_attention(q, keys, values, table, plan.end - t, self.scale)
        return attn.reshape(t, self.config.q_size)

    # ---- entry points ----

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: torch.Tensor,
        pool: KVPool,
        block_table: list[int],
        start_pos: int = 0,
        on_layer_done: Callable[[int], None] | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Compute positions [start_pos, start_pos+T), the KV of [0, start_pos) being in the pool
        already.

        Writes the new KV into the pool at the slots `block_table` names; returns fp32 logits
        [T, vocab] ([1, vocab] with last_only). on_layer_done(l) runs after layer l's KV is written.
        """
        plan = self._plan(token_ids, pool, block_table, start_pos)
        rope = self._rope_table(plan.positions)
        x = self.embed(plan.token_ids)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, rope)
            k_cache, v_cache = pool.layer_kv(li)
            k_cache[plan.slot_block, plan.slot_off] = k.to(pool.dtype)
            v_cache[plan.slot_block, plan.slot_off] = v.to(pool.dtype)
            if on_layer_done is not None:
                on_layer_done(li)
            kernels.linear_add_(x, self._attend(plan, q, k, v, k_cache, v_cache), layer.o_proj)
            x = self._mlp(layer, x)
        if last_only:
            x = x[-1:]
        return self._logits(x)

    @torch.inference_mode()
    def prefill_batch(
        self,
        seqs: Sequence[tuple[torch.Tensor, list[int], int]],
        pool: KVPool,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> list[torch.Tensor]:
        """`prefill` of several sequences (token_ids, block_table, start_pos) in one forward;
        last-position fp32 logits [1, vocab] each.

        The projections and MLP run once over all new tokens; attention runs per sequence.
        on_layer_done(l) runs after layer l's KV of every sequence is written.
        """
        plans = [self._plan(ids, pool, table, start) for ids, table, start in seqs]
        if not plans:
            return []
        bounds = torch.tensor([0] + [p.token_ids.numel() for p in plans]).cumsum(0).tolist()
        positions = torch.cat([p.positions for p in plans])
        slot_block = torch.cat([p.slot_block for p in plans])
        slot_off = torch.cat([p.slot_off for p in plans])
        rope = self._rope_table(positions)
        x = self.embed(torch.cat([p.token_ids for p in plans]))
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, rope)
            k_cache, v_cache = pool.layer_kv(li)
            k_cache[slot_block, slot_off] = k.to(pool.dtype)
            v_cache[slot_block, slot_off] = v.to(pool.dtype)
            if on_layer_done is not None:
                on_layer_done(li)
            attns = [
                self._attend(p, q[s:e], k[s:e], v[s:e], k_cache, v_cache)
                for p, s, e in zip(plans, bounds[:-1], bounds[1:])
            ]
            # one sequence (a long prompt's forward): its output as it is, not copied by cat
            attn = attns[0] if len(attns) == 1 else torch.cat(attns)
            kernels.linear_add_(x, attn, layer.o_proj)
            x = self._mlp(layer, x)
        logits = self._logits(x[torch.tensor(bounds[1:]) - 1])
        return list(logits.split(1))

    @torch.inference_mode()
    def decode(
        self,
        token_ids: torch.Tensor,
        pool: KVPool,
        block_tables: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """One new token per sequence at positions[i] (its KV written there), attending over
        [0, pos]; fp32 logits [B, vocab]."""
        c, bs = self.config, pool.block_size
        token_ids = token_ids.to(device=self.device, dtype=torch.long)
        positions = positions.to(device=self.device, dtype=torch.long)
        block_tables = block_tables.to(device=self.device, dtype=torch.int32)
        b = token_ids.shape[0]
        fused = self._decode_layers(pool)
        if fused is not None:
            return self._fused_step(fused, token_ids, positions, pool, block_tables, positions)
        slot_block = block_tables.gather(1, (positions // bs)[:, None]).squeeze(1).long()
        slot_off = positions % bs
        seq_lens = (positions + 1).to(torch.int32)

        rope = self._rope_table(positions)
        x = self.embed(token_ids)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, rope)
            k_cache, v_cache = pool.layer_kv(li)
            k_cache[slot_block, slot_off] = k.to(pool.dtype)
            v_cache[slot_block, slot_off] = v.to(pool.dtype)
            attn = kernels.paged_decode_attention(
                q, k_cache, v_cache, block_tables, seq_lens, self.scale
            )
            kernels.linear_add_(x, attn.reshape(b, c.q_size).to(x.dtype), layer.o_proj)
            x = self._mlp(layer, x)
        return self._logits(x)

    @torch.inference_mode()
    def decode_kivi(
        self,
        token_ids: torch.Tensor,
        pool,
        packed_tables: torch.Tensor,
        packed_lens: torch.Tensor,
        window_tables: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """`decode` over a KIVI pool (model.KiviPool): sequence i's tokens [0, packed_lens[i])
        are packed blocks (packed_tables[i]); the rest, up to and including positions[i] (whose
        KV is written now), are its full-precision window blocks (window_tables[i]). Attention
        merges the two parts exactly. fp32 logits [B, vocab]."""
        c, bs = self.config, pool.block_size
        token_ids = token_ids.to(device=self.device, dtype=torch.long)
        positions = positions.to(device=self.device, dtype=torch.long)
        packed_tables = packed_tables.to(device=self.device, dtype=torch.int32)
        packed_lens = packed_lens.to(device=self.device, dtype=torch.int32)
        window_tables = window_tables.to(device=self.device, dtype=torch.int32)
        b = token_ids.shape[0]
        in_window = positions - packed_lens.long()
        window = pool.window
        fused = self._decode_layers(window)
        if fused is not None:
            packed = kernels.KiviBlocks(
                pool.packed_layers[0], pool.packed.kv.stride(1), packed_tables, packed_lens
            )
            return self._fused_step(
                fused, token_ids, positions, window, window_tables, in_window, packed
            )
        slot_block = window_tables.gather(1, (in_window // bs)[:, None]).squeeze(1).long()
        slot_off = in_window % bs
        window_lens = (in_window + 1).to(torch.int32)

        rope = self._rope_table(positions)
        x = self.embed(token_ids)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, rope)
            k_win, v_win = window.layer_kv(li)
            k_win[slot_block, slot_off] = k.to(window.dtype)
            v_win[slot_block, slot_off] = v.to(window.dtype)
            attn = kernels.paged_decode_attention_kivi_window(
                q,
                pool.packed_layers[li],
                packed_tables,
                packed_lens,
                k_win,
                v_win,
                window_tables,
                window_lens,
                self.scale,
            )
            kernels.linear_add_(x, attn.reshape(b, c.q_size).to(x.dtype), layer.o_proj)
            x = self._mlp(layer, x)
        return self._logits(x)
