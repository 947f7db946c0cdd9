"""Decode worker: block pull, continuous batching, paged decode, token streaming."""
