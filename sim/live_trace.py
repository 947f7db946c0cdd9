"""A running cluster's recent requests (the conductor's RecentTrace) as a Mooncake trace file,
for `halfmoon plan --conductor`: the plan is made for the load the cluster was offered."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from client.api import Client
from protos import halfmoon_pb2 as pb
from sim.profile import Profile, profile_yaml_text


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


def _mean_coef(models: list[pb.WorkerModel]) -> tuple[float, float, float]:
    """The mean of the workers' coefficients: the model of the mean prediction (it is linear)."""
    c0, c1, c2 = (sum(m.coef[i] for m in models) / len(models) for i in range(3))
    return c0, c1, c2


def live_profile(reply: pb.RecentTraceReply, base: Profile, address: str) -> Profile:
    """`base` with the cluster's own time models: each role's coefficients the mean of its
    answering workers' (each fitted model times the conductor's correction of it, as routing
    judges by them), the smallest decode worker's pool and batch bound, blocks of the cluster's
    size. What the workers do not report (tiers, links, overheads, shared_host) stays the
    profile's. A role with no fitted model keeps the profile's coefficients."""
    prefill = [m for m in reply.models if m.kind == "prefill" and len(m.coef) == 3]
    decode = [m for m in reply.models if m.kind == "decode" and len(m.coef) == 3]
    changes: dict = {"name": f"{base.name}+live"}
    said = []
    if prefill:
        changes["prefill_coef"] = _mean_coef(prefill)
        said.append(f"prefill_coef: the mean of {len(prefill)} prefill worker(s)' models")
    if decode:
        changes["decode_coef"] = _mean_coef(decode)
        said.append(f"decode_coef: the mean of {len(decode)} decode worker(s)' models")
        pools = [m.total_blocks for m in decode if m.total_blocks > 0]
        if pools:
            changes["kv_blocks"] = min(pools)
        batches = [m.max_batch for m in decode if m.max_batch > 0]
        if batches:
            changes["max_batch"] = min(batches)
    if reply.block_size > 0 and reply.block_size != base.block_size:
        changes["block_size"] = reply.block_size
        changes["block_bytes"] = base.block_bytes * reply.block_size // base.block_size
    sizes = [m.block_bytes for m in reply.models if m.block_bytes > 0]
    if sizes:
        changes["block_bytes"] = sizes[0]
    if not said:
        said.append("no worker had a fitted model: the profile's coefficients")
    said.append(f"each fitted model times the conductor's correction; the rest from {base.name}")
    note = f"live, from the conductor at {address}: " + "; ".join(said)
    return dataclasses.replace(base, sources=(*base.sources, note), **changes)


def write_profile(profile: Profile, path: Path) -> Path:
    """The profile as YAML that `halfmoon plan --profile PATH` reads again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(profile_yaml_text(profile), encoding="utf-8")
    tmp.replace(path)
    return path
