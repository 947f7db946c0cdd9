"""The global index: which node holds which block, and how long a prefix of a prompt each node
holds (what the conductor asks Redis for)."""

from __future__ import annotations


class GlobalIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}

    def add(self, key: int, node: str) -> None:
        self._holders.setdefault(key, set()).add(node)

    def remove(self, key: int, node: str) -> None:
        nodes = self._holders.get(key)
        if nodes is not None:
            nodes.discard(node)
            if not nodes:
                del self._holders[key]

    def longest_prefix(self, keys: tuple[int, ...]) -> dict[str, int]:
        """node -> leading blocks of `keys` it holds (nodes holding none are left out)."""
        if not keys:
            return {}
        alive = set(self._holders.get(keys[0], ()))
        out: dict[str, int] = {}
        i = 1
        while alive and i < len(keys):
            holders = self._holders.get(keys[i], ())
            for node in alive.difference(holders):
                out[node] = i
            alive.intersection_update(holders)
            i += 1
        for node in alive:
            out[node] = i
        return out
