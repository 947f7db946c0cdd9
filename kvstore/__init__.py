"""KV store: block keys and format, codecs, tiers, eviction, global index, transfer."""

from kvstore.keys import KEY_BYTES, block_keys

__all__ = ["KEY_BYTES", "block_keys"]
