"""Block keys: the chained 128-bit prefix hash that names every cached KV block."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

KEY_BYTES = 16  # 128-bit digests
_ROOT = bytes(KEY_BYTES)  # the parent of the first block


def block_keys(
    tokens: Sequence[int],
    block_size: int,
    model_fingerprint: str,
    salt: str = "",
    parent: bytes = _ROOT,
) -> list[bytes]:
    """Keys of the full blocks of `tokens`:
    key_i = blake2b(key_{i-1} || fingerprint || salt || block_i).

    Equal prefixes give equal keys; a changed token changes that block's key and every later one.
    A trailing partial block gets no key. `parent` continues a chain from an earlier block's key.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    context = _context(model_fingerprint, salt)
    keys: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = array("I", tokens[start : start + block_size]).tobytes()
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(context)
        h.update(block)
        parent = h.digest()
        keys.append(parent)
    return keys


def _context(model_fingerprint: str, salt: str) -> bytes:
    # Length-prefixed so that ("ab", "c") and ("a", "bc") never collide.
    fp, s = model_fingerprint.encode(), salt.encode()
    return len(fp).to_bytes(4, "little") + fp + len(s).to_bytes(4, "little") + s
