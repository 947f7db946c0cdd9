"""Prefill worker: prefix reuse, chunked prefill, write-out of full blocks."""
