"""The conductor's recent requests as a trace: each request's arrival, prompt length, answer
length and prompt blocks, kept in a ring, so `halfmoon plan --conductor` plans the P:D split for
the load the cluster is actually offered rather than a file's.

The records are Mooncake's trace records at the cluster's block size: one hash id per full
block of the prompt, equal leading ids for an equal prefix (the ids are the block keys' first 8
bytes, so tenants' prefixes stay apart as their keys do). A refused request is kept too, with the
answer it asked for: the plan must see the load offered, not only what was served."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import NamedTuple

from protos import halfmoon_pb2 as pb

HASH_ID_MASK = (1 << 63) - 1  # ids fit an int64 (the trace's JSON and the proto's field)


class RecentRequest(NamedTuple):
    arrived: float  # perf_counter() at arrival
    input_length: int  # prompt tokens
    output_length: int  # tokens answered (for a refused request: the max_tokens it asked for)
    hash_ids: tuple[int, ...]  # one per full block of the prompt, from its block keys
    refused: bool  # refused at admission (its answer never ran)
    ttft_ms: float = 0.0  # measured, answered ones (0 = no first token)
    predicted_ttft_ms: float = 0.0  # the policy's estimate when it routed it (0 = none)


def hash_ids_of(keys: list[bytes]) -> tuple[int, ...]:
    """The trace's ids of a prompt's block keys (each key chains its whole prefix)."""
    return tuple(int.from_bytes(k[:8], "big") & HASH_ID_MASK for k in keys)


class RecentRequests:
    """The last `capacity` requests to arrive and end (0: none kept), safe across the server's
    threads."""

    def __init__(self, capacity: int):
        self._ring: deque[RecentRequest] = deque(maxlen=max(0, capacity))
        self._lock = threading.Lock()

    def add(
        self,
        arrived: float,
        input_length: int,
        output_length: int,
        keys: list[bytes],
        refused: bool = False,
        ttft_ms: float = 0.0,
        predicted_ttft_ms: float = 0.0,
    ) -> None:
        if self._ring.maxlen == 0:
            return
        r = RecentRequest(arrived, input_length, output_length, hash_ids_of(keys), refused,
                          ttft_ms, predicted_ttft_ms)  # fmt: skip
        with self._lock:
            self._ring.append(r)

    def reply(self, limit: int, block_size: int) -> pb.RecentTraceReply:
        """The newest `limit` records (0: all kept), in arrival order, the first at 0 ms."""
        with self._lock:
            kept = list(self._ring)
        kept.sort(key=lambda r: r.arrived)
        if limit:
            kept = kept[-limit:]
        now = time.perf_counter()
        t0 = kept[0].arrived if kept else now
        return pb.RecentTraceReply(
            block_size=block_size,
            window_s=now - t0,  # from the first record's arrival to this answer
            requests=[
                pb.TraceRecord(
                    timestamp_ms=(r.arrived - t0) * 1000.0,
                    input_length=r.input_length,
                    output_length=r.output_length,
                    hash_ids=r.hash_ids,
                    refused=r.refused,
                    ttft_ms=r.ttft_ms,
                    predicted_ttft_ms=r.predicted_ttft_ms,
                )
                for r in kept
            ],
        )
