"""The ClusterState one routing decision judges: each worker's last load report, its model scaled
by the worker's correction, plus the work routed to it since that report was asked for."""

from __future__ import annotations

import time

from conductor.config import ConductorConfig
from conductor.fleet import Fleet, PrefillWorker
from conductor.policy_types import ClusterState, DecodeCandidate, Link, PrefillCandidate
from protos import halfmoon_pb2 as pb
from servekit import is_kivi


def cluster_state(fleet: Fleet, matches: dict[str, int], config: ConductorConfig) -> ClusterState:
    """What the policy sees now: the workers that have reported a load, and `matches` (the
    index's answer for the prompt)."""
    prefill, decode = [], []
    device_nodes: set[str] = set()
    block_bytes = 0
    now = time.perf_counter()
    with fleet.lock:
        for w in fleet.prefill:
            ld = w.load
            if ld is None:
                continue
            block_bytes = max(block_bytes, ld.block_bytes)
            nodes = tuple(ld.nodes)
            if ld.device_node:
                # Its own pool: counts toward its own match, never a fetch source.
                device_nodes.add(ld.device_node)
                if ld.device_node not in nodes:
                    nodes += (ld.device_node,)
            queue_ms, queued_tokens = _prefill_queue(w, ld, now)
            prefill.append(
                PrefillCandidate(
                    worker_id=ld.worker_id,
                    nodes=nodes,
                    queue_ms=queue_ms,
                    coef=w.routed_coef(),
                    healthy=w.routable,
                    fetch_block_bytes=ld.fetch_block_bytes,
                    queued_tokens=queued_tokens,
                    links=tuple(Link(x.node, x.fixed_ms, x.bytes_per_ms) for x in ld.links),
                    checked=w.correction.checked(),
                    cpu_peers=_cpu_peers(ld, fleet),
                )
            )
        for d in fleet.decode:
            ld = d.load
            if ld is None:
                continue
            # Routed here and not in the report: admitted after what it reports waiting.
            unseen = tuple(b.as_waiting() for b in d.unseen())
            local_ms = sum(b.local_ms for b in d.inflight.values())
            waiting = tuple(zip(ld.waiting_positions, ld.waiting_remaining, ld.waiting_blocks))
            decode.append(
                DecodeCandidate(
                    worker_id=ld.worker_id,
                    running=ld.running + ld.waiting + len(unseen),
                    free_blocks=ld.free_blocks,
                    total_blocks=ld.total_blocks,
                    context_tokens=ld.total_context_tokens,
                    coef=d.routed_coef(),
                    healthy=d.routable,
                    seqs=tuple(zip(ld.seq_positions, ld.seq_remaining, ld.seq_blocks)),
                    waiting=waiting + unseen,
                    max_batch=ld.max_batch,
                    pull_ms_per_block=d.pull_ms_per_block,
                    nodes=tuple(ld.nodes),
                    local_queue_ms=local_ms,
                    checked=d.correction.checked(),
                    wait_scale=d.wait_scale,
                    offered_slack_ms=ld.offered_slack_ms,
                    tbt_scale=d.tbt_scale,
                    local_scale=d.local.ratio,
                )
            )
    return ClusterState(
        prefill=prefill,
        decode=decode,
        matches=matches,
        block_size=config.block_size,
        block_bytes=block_bytes,
        device_nodes=frozenset(device_nodes),
        window_tokens=config.kivi_residual if is_kivi(config.kv_cache_dtype) else 0,
    )


def _cpu_peers(ld: pb.WorkerLoad, fleet: Fleet) -> tuple[str, ...]:
    """The decode workers that take turns with this prefill worker at its CPUs: the same turn
    lock (it names the CPU set) on the same host (a store node in common; none on either: one
    host). Under fleet.lock."""
    if not ld.cpu_turns:
        return ()
    mine = set(ld.nodes)
    return tuple(
        d.load.worker_id
        for d in fleet.decode
        if d.load is not None
        and d.load.cpu_turns == ld.cpu_turns
        and (mine & set(d.load.nodes) or not (mine or d.load.nodes))
    )


def _prefill_queue(w: PrefillWorker, ld: pb.WorkerLoad, now: float) -> tuple[float, int]:
    """(predicted wait, prompt tokens ahead) of a new request on prefill worker `w`: what its
    last report held (queued and computing, by its own model: scaled by the correction), less
    the time it has worked off since, plus what was routed to it after that report was asked
    for (booked as the corrected model predicted it: scaling it again squared the correction,
    and a burst behind a 2x correction read as 4x its work)."""
    unseen = w.unseen()
    left = max(0.0, ld.predicted_queue_ms * w.correction.ratio - (now - w.report_at) * 1000.0)
    tokens = ld.queued_tokens + ld.running_tokens + sum(b.tokens for b in unseen)
    return left + sum(b.compute_ms for b in unseen), tokens
