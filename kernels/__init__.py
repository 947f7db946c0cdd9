"""Triton kernels, their torch reference twins, and the dispatch between them."""

from kernels.paged_attention_ref import paged_decode_attention_ref

# The dispatch (Triton on CUDA, torch on CPU) replaces this alias.
paged_decode_attention = paged_decode_attention_ref

__all__ = ["paged_decode_attention", "paged_decode_attention_ref"]
