"""The Llama-family decoder with a paged KV cache: `prefill` (a prompt or its continuation) and
batched `decode`.

Here the parameters, the per-layer halves (attention's projections, the MLP) and the entry
points; the rest one job a file: model/llama_weights.py (HF naming, packing),
model/llama_prefill.py and model/llama_decode.py (the forwards over the pool),
model/prefill_plan.py (a prefill's slots and mask), model/rope.py (the frequencies)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

import kernels
from model import llama_decode, llama_prefill, llama_weights
from model.config import ModelConfig
from model.kv_pool import KVPool
from model.ops import heads_first, rms_norm
from model.prefill_plan import SeqPlan
from model.rope import rope_inv_freq

# Names model.llama held before its split, kept importable from here
_rms_norm, _heads_first, _SeqPlan = rms_norm, heads_first, SeqPlan


class LlamaLayer(nn.Module):
    """One decoder layer; Q, K, V and gate, up are fused into one matmul each."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.input_norm = nn.Parameter(torch.ones(h))
        self.qkv_proj = nn.Parameter(torch.empty(config.q_size + 2 * config.kv_size, h))
        self.o_proj = nn.Parameter(torch.empty(h, config.q_size))
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * config.intermediate_size, h))
        self.down_proj = nn.Parameter(torch.empty(h, config.intermediate_size))

    def qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """(q [N, heads, head_dim], k, v [N, kv_heads, head_dim]) of hidden states x [N, hidden],
        q and k rotated by rope's (cos, sin)."""
        c = self.config
        h = rms_norm(x, self.input_norm, c.rms_norm_eps)
        qkv = kernels.linear(h, self.qkv_proj)
        n = x.shape[0]
        # q and k rotated in place, in the projection's own output
        qk = kernels.rope_(
            qkv[:, : c.q_size + c.kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim), *rope
        )
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        v = qkv[:, c.q_size + c.kv_size :].view(n, c.num_kv_heads, c.head_dim)
        return q, k, v

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream x after the SwiGLU MLP, x itself updated in place."""
        h = rms_norm(x, self.post_norm, self.config.rms_norm_eps)
        # the residual is added in place (in the matmul's own pass where it can be)
        act = kernels.linear_silu_mul(h, self.gate_up_proj)
        return kernels.linear_add_(x, act, self.down_proj)


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

    # ---- weights: packed (kernels/packed_linear.py), in HF naming (model/llama_weights.py) ----

    def prepack_weights(self, form: str = "panels") -> bool:
        """Swap every projection and the LM head for a packed copy, which is faster for the few
        rows of a decode step (kernels/packed_linear.py; `form`: its PACK_FORMS); the values
        are unchanged and `hf_state_dict` unpacks them. A tied head in panels replaces the plain
        embedding (lookups gather from it); packed by oneDNN it is a copy beside it. False, and
        nothing changed, where the device and dtype have no packed path."""
        if not kernels.prepack_supported(self.dtype, self.device):
            return False
        self._fused_layers = None
        llama_weights.prepack(self, form)
        return True

    def _head(self) -> torch.Tensor:
        """The LM head's weight, packed where prepack_weights made it so."""
        if self.lm_head is not None:
            return self.lm_head
        return self.embed_tokens if self.packed_head is None else self.packed_head

    def load_hf_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Copy weights named as in HF's LlamaForCausalLM (q/k/v and gate/up are fused here)."""
        llama_weights.load_hf_state_dict(self, sd)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights named as in HF's LlamaForCausalLM (fp32 copies)."""
        return llama_weights.hf_state_dict(self)

    # ---- forward pieces the paths share ----

    def _rope_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [N, 1, head_dim/2] for positions [N], computed in fp32 once per forward
        (as HF), in the model dtype."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(self.dtype)[:, None, :], freqs.sin().to(self.dtype)[:, None, :]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return kernels.linear(x, self._head()).float()

    def _decode_layers(self, pool: KVPool):
        """The fused decode layers for this pool, or None where they do not apply."""
        if not self.fused_decode or pool.dtype != self.dtype or pool.kv.dim() != 6:
            return None
        if self._fused_layers is None:
            # built once per placement of the weights: _apply and prepack_weights forget it
            self._fused_layers = llama_decode.build_fused_layers(self) or False
        fused = self._fused_layers
        return fused if fused and fused.fits_pool(*pool.layer_kv(0)) else None

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
        return llama_prefill.prefill(
            self, token_ids, pool, block_table, start_pos, on_layer_done, last_only
        )

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
        return llama_prefill.prefill_batch(self, seqs, pool, on_layer_done)

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
        return llama_decode.decode(self, token_ids, pool, block_tables, positions)

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
        return llama_decode.decode_kivi(
            self, token_ids, pool, packed_tables, packed_lens, window_tables, positions
        )
