"""IndexPublisher: keeps one node's entries in the global index from a thread of its own.

The index is advisory, so nothing on the data path waits for Redis: a store RPC only queues its
changes and wakes this thread, which publishes them in order, renews the node's registration
(heartbeat) and, on a store node, sweeps the entries of nodes whose heartbeat lapsed.

Changes that fail to publish are not retried one by one (they may be stale by then): any index
failure, a change queue that overflowed, a registration found lapsed (Redis restarted empty, or
the node was away too long) or a new Redis run id (restarted, maybe from an old snapshot) marks
the node's entries stale, and the next round that reaches Redis replaces them with the node's
whole listing. So the index is rebuilt from what the nodes hold, whatever it lost. While Redis is
down, one attempt per `retry_s`; each failure is counted and the first of an outage logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from kvstore.index import Index
from kvstore.types import NodeInfo

log = logging.getLogger(__name__)

Events = list[tuple[bytes, str | None]]


class IndexPublisher:
    """Publishes node `info`'s block changes (`take_events() -> (changes, some were dropped)`),
    or its whole `listing()` (key -> tier) when the index's copy is stale; heartbeats every
    `heartbeat_s` with a registration that lives `ttl_s`; `sweep`s dead nodes when asked. A round
    runs when notified or every `period_s` (default: a fraction of the heartbeat). `on_error(op,
    exc)` hears of every failure (for a metric)."""

    def __init__(
        self,
        index: Index,
        info: NodeInfo,
        take_events: Callable[[], tuple[Events, bool]],
        listing: Callable[[], dict[bytes, str]],
        *,
        heartbeat_s: float,
        ttl_s: float,
        sweep: bool = False,
        period_s: float = 0.0,
        retry_s: float = 1.0,
        on_error: Callable[[str, BaseException], None] | None = None,
    ):
        self.index, self.info = index, info
        self._take_events, self._listing = take_events, listing
        self.heartbeat_s, self.ttl_s, self.retry_s = heartbeat_s, ttl_s, retry_s
        self._sweep, self._on_error = sweep, on_error
        self._tick = period_s or min(0.25, heartbeat_s / 2)
        self._wake, self._quit = threading.Event(), threading.Event()
        self._cv = threading.Condition()
        self._started = self._done = 0  # rounds begun / finished (what `sync` waits on)
        self._thread: threading.Thread | None = None
        # publisher-thread state
        self._stale = True  # the index's copy of this node must be replaced by its listing
        self._run = ""  # the Redis run id the node's entries were published to
        self._next_beat = 0.0
        self._down_since = 0.0  # monotonic time of the outage's first failure (0 = up)
        self._retry_at = 0.0
        # counters (read by metrics at scrape time)
        self.errors: Counter[str] = Counter()  # failures by op: publish, republish, heartbeat..
        self.republished = 0  # times the whole listing was published
        self.dropped_events = 0  # changes dropped (a failure or an overflow; the listing covers)

    @property
    def up_to_date(self) -> bool:
        """Whether the last round left the index holding this node's entries as they are."""
        return not self._stale

    # ---- lifecycle ----

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._loop, name=f"index-{self.info.node_id}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._quit.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def notify(self) -> None:
        """Changes are queued: publish them soon (never waits)."""
        self._wake.set()

    def sync(self, timeout_s: float = 2.0) -> bool:
        """Wait (at most timeout_s) for a round that started after this call, so the changes
        queued before it have been tried; whether the index is up to date after it."""
        with self._cv:
            target = self._started + 1
            self._wake.set()
            self._cv.wait_for(lambda: self._done >= target, timeout_s)
        return self.up_to_date

    # ---- the thread ----

    def _loop(self) -> None:
        while not self._quit.is_set():
            self._wake.wait(self._tick)
            if self._quit.is_set():
                return
            self._wake.clear()  # before taking the changes: a later notify wakes a new round
            with self._cv:
                self._started += 1
            try:
                self._round()
            finally:
                with self._cv:
                    self._done += 1
                    self._cv.notify_all()

    def _round(self) -> None:
        events, lost = self._take_events()
        if lost:
            self._stale = True
            log.warning(
                "index changes of %s overflowed their queue: the whole listing goes instead",
                self.info.node_id,
            )
        now = time.monotonic()
        if self._down_since and now < self._retry_at:  # Redis is down: no attempt until retry_at
            self._drop(events)
            return
        op = "publish"
        try:
            if self._stale:
                op = "republish"
                self._republish()
            elif events:
                self.index.publish(self.info.node_id, events)
            if now >= self._next_beat:
                op = "heartbeat"
                self._heartbeat()
                if self._sweep:
                    op = "sweep"
                    self.index.sweep()
                self._next_beat = now + self.heartbeat_s
        except Exception as exc:  # noqa: BLE001 - advisory index: counted, logged, rebuilt later
            if op == "publish":
                self._drop(events)
            self._failed(op, exc)
            return
        if self._down_since:
            log.info(
                "index reachable again for %s after %.1f s; its entries were rebuilt",
                self.info.node_id,
                now - self._down_since,
            )
            self._down_since = 0.0

    def _republish(self) -> None:
        run = self.index.server_run()
        held = self._listing()  # supersedes the changes queued so far
        self.index.republish(self.info, self.ttl_s, held)
        self._stale, self._run = False, run
        self.republished += 1
        log.info("index: %s published its listing (%d blocks)", self.info.node_id, len(held))

    def _heartbeat(self) -> None:
        run = self.index.server_run()
        alive = self.index.heartbeat(self.info.node_id, self.ttl_s)
        if alive and run == self._run:
            return
        # Redis restarted, lost the node's entries, or the node was away past its TTL: the
        # index may hold nothing, or an old copy, of what the node holds.
        log.warning(
            "index lost %s's entries (%s): re-publishing its listing",
            self.info.node_id,
            "Redis restarted" if run != self._run else "registration lapsed",
        )
        self._republish()

    def _drop(self, events: Events) -> None:
        if events:
            self.dropped_events += len(events)
            self._stale = True

    def _failed(self, op: str, exc: BaseException) -> None:
        self._stale = True
        self.errors[op] += 1
        now = time.monotonic()
        self._retry_at = now + self.retry_s
        if not self._down_since:
            self._down_since = now
            log.warning(
                "index %s failed for %s (%s: %s); serving goes on, its entries are rebuilt "
                "when the index answers",
                op,
                self.info.node_id,
                type(exc).__name__,
                exc,
            )
        else:
            log.debug("index %s failed for %s again: %s", op, self.info.node_id, exc)
        if self._on_error is not None:
            self._on_error(op, exc)
