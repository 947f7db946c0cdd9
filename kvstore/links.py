"""What fetches from one store node measured of the link to it, for the conductor's policy to weigh
fetching a prefix against recomputing it: a fetch takes `fixed_ms + bytes / bytes_per_ms`.

A fetch is a lookup (a small request: one round trip and the node's work) and then the transfer
(another round trip, then the bytes). The lookup's time is the fixed part's measure, paid twice; the
rate is the bytes over the transfer's time less one round trip. Without the fixed part, the small
fetches that warm a link (a few blocks, mostly round trip) would make every later, larger fetch
look several times slower than it is.
"""

from __future__ import annotations

from typing import NamedTuple

# Weight of the newest fetch (as CacheGen's throughput estimate): a link that changes is followed
# within a fetch or two.
WEIGHT = 0.7


class LinkSpeed(NamedTuple):
    """A link as measured: a fetch of `n` bytes takes fixed_ms + n / bytes_per_ms."""

    fixed_ms: float
    bytes_per_ms: float
    fetches: int


class LinkModel:
    """One link's measured speed, smoothed. The rate is averaged as time per byte, so one fetch
    over a link that has become slow counts at once (an average of rates would let the old, fast
    ones hide it)."""

    def __init__(self, weight: float = WEIGHT):
        self.weight = weight
        self.fixed_ms = 0.0
        self.ms_per_byte = 0.0
        self.fetches = 0

    def add(self, lookup_ms: float, nbytes: int, transfer_ms: float) -> None:
        """One fetch: its lookup took `lookup_ms`, then `nbytes` arrived in `transfer_ms`."""
        if nbytes <= 0 or transfer_ms <= 0 or lookup_ms < 0:
            return
        # the transfer's own round trip is the lookup's; a hiccup in the lookup must not leave
        # the bytes next to no time
        flow_ms = max(transfer_ms - lookup_ms, 0.25 * transfer_ms)
        fixed, per_byte = 2.0 * lookup_ms, flow_ms / nbytes
        if self.fetches == 0:
            self.fixed_ms, self.ms_per_byte = fixed, per_byte
        else:
            w = self.weight
            self.fixed_ms = w * fixed + (1 - w) * self.fixed_ms
            self.ms_per_byte = w * per_byte + (1 - w) * self.ms_per_byte
        self.fetches += 1

    def speed(self) -> LinkSpeed:
        return LinkSpeed(self.fixed_ms, 1.0 / max(self.ms_per_byte, 1e-12), self.fetches)
