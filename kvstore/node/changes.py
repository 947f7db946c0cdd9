"""The store node's block changes waiting for the global index: (key, tier or None when dropped),
oldest first, bounded. Not thread-safe: the store's lock guards it."""

from __future__ import annotations

# Index changes queued at most (a few MB); past that the queue is dropped and the whole listing
# is published instead.
MAX_EVENTS = 1 << 16

Change = tuple[bytes, str | None]  # a block's key and its tier now (None: no longer held)


class ChangeQueue:
    """At most `limit` changes: a full queue is dropped whole and `take` says so, so a publisher
    that cannot keep up costs bounded memory (it then sends the whole listing instead)."""

    def __init__(self, limit: int = MAX_EVENTS):
        self.limit = limit
        self._changes: list[Change] = []
        self._lost = False  # changes were dropped since the last take/reset

    def push(self, key: bytes, tier: str | None) -> None:
        if len(self._changes) >= self.limit:
            self._changes = []
            self._lost = True
        self._changes.append((key, tier))

    def take(self) -> tuple[list[Change], bool]:
        """The changes so far, oldest first, and whether some were dropped; the queue is empty
        after."""
        changes, lost = self._changes, self._lost
        self._changes, self._lost = [], False
        return changes, lost

    def reset(self) -> None:
        """Forget every queued change: a full listing taken now supersedes them."""
        self._changes, self._lost = [], False
