"""Leases on a store node's blocks: a read lease pins held blocks while a reader copies them, a
write lease holds a writer's reserved slab ranges until it commits. Each expires unless renewed,
so a holder that dies frees what it held. This table only keeps them; what ending one does to its
blocks is the store's. Not thread-safe: the store's lock guards it."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.node.entry import Entry


# eq=False: a lease is one holder's, found by its id, never compared by value.
@dataclass(eq=False, slots=True)
class Lease:
    id: int  # what its holder names it by (never 0: callers take 0 for "no lease")
    write: bool  # a writer's reservation (else a reader's pin on held blocks)
    expires: float  # the store clock's time past which expire() ends it
    entries: list[Entry] = field(default_factory=list)  # its blocks, in the order of its keys


class LeaseTable:
    """The live leases by id; `clock` is the store's (monotonic seconds, or a test's)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._ids = itertools.count(1)
        self._held: dict[int, Lease] = {}

    def __len__(self) -> int:
        return len(self._held)

    def new(self, write: bool, ttl: float) -> Lease:
        """A lease with the next id, for `ttl` seconds from now; not held until `hold`."""
        return Lease(next(self._ids), write, self.clock() + ttl)

    def hold(self, lease: Lease) -> None:
        self._held[lease.id] = lease

    def get(self, lease_id: int) -> Lease | None:
        return self._held.get(lease_id)

    def pop(self, lease_id: int) -> Lease | None:
        return self._held.pop(lease_id, None)

    def renew(self, lease_id: int, ttl: float) -> bool:
        """Push a held lease's expiry to `ttl` seconds from now; False if it is not held."""
        lease = self._held.get(lease_id)
        if lease is None:
            return False
        lease.expires = self.clock() + ttl
        return True

    def expired(self, now: float) -> list[int]:
        """Ids of the leases past their expiry at `now`."""
        return [i for i, lease in self._held.items() if lease.expires < now]
