"""A running cluster's recent requests (the conductor's RecentTrace) as a Mooncake trace file,
for `halfmoon plan --conductor`: the plan is made for the load the cluster was offered."""

from __future__ import annotations

import json
from pathlib import Path

from client.api import Client
from protos import halfmoon_pb2 as pb


def fetch_recent(address: str, limit: int = 0) -> pb.RecentTraceReply:
    """The conductor's newest `limit` requests (0: all it keeps); ValueError when it kept none."""
    if limit < 0:
        raise ValueError(f"--recent: 0 (all) or a number of requests, got {limit}")
    with Client(address) as c:
        reply = c.recent_trace(limit)
    if not reply.requests:
        raise ValueError(
            f"the conductor at {address} keeps no requests yet (none arrived, or "
            "conductor.recent_requests is 0)"
        )
    return reply


def write_trace(reply: pb.RecentTraceReply, path: Path) -> Path:
    """The records as Mooncake JSONL (a hash id per `reply.block_size` tokens), written whole to
    a temporary name first so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {
                "timestamp": round(r.timestamp_ms, 3),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
                **({"refused": True} if r.refused else {}),
            }
        )
        for r in reply.requests
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
