"""The event loop: a clock and a heap of timed callbacks, run in time order (ties in the order
they were scheduled, so a run repeats exactly)."""

from __future__ import annotations

import heapq
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0  # ms of simulated time
        self.events = 0  # callbacks run so far
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = 0

    def at(self, t_ms: float, fn: Callable[..., None], *args) -> None:
        """Run fn(*args) at simulated time t_ms (never before now)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(t_ms, self.now), self._seq, fn, args))

    def after(self, delay_ms: float, fn: Callable[..., None], *args) -> None:
        self.at(self.now + delay_ms, fn, *args)

    def run(self) -> None:
        heap = self._heap
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)
