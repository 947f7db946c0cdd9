"""`halfmoon status`: the cluster as tables (workers and loads, store occupancy by tier, hit
rate)."""

from __future__ import annotations

import argparse
import json

from google.protobuf.json_format import MessageToDict

from client.api import Client


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_status(reply) -> str:
    """The StatusReply as text tables."""
    hit = (
        reply.cached_tokens_total / reply.prompt_tokens_total if reply.prompt_tokens_total else 0.0
    )
    judged = reply.requests_slo_met + reply.requests_slo_missed + reply.requests_rejected
    attained = f"{100 * reply.requests_slo_met / judged:.1f}%" if judged else "-"
    lines = [
        f"model {reply.model or '?'}  block_size {reply.block_size}  "
        f"policy {reply.default_policy or '?'}",
        f"requests {reply.requests_total} (rejected {reply.requests_rejected})  prompt tokens "
        f"{reply.prompt_tokens_total}, cached {reply.cached_tokens_total}  "
        f"hit rate {100 * hit:.1f}%",
        f"objectives met {reply.requests_slo_met}, missed {reply.requests_slo_missed} "
        f"(best-effort {reply.requests_best_effort}): "
        f"attainment {attained} (rejected requests count as missed)",
        "",
    ]
    rows = []
    for w in reply.workers:
        ld = w.load
        used = ld.total_blocks - ld.free_blocks
        rows.append(
            [
                w.worker_id,
                w.kind,
                w.address,
                "yes" if w.healthy else "NO",
                str(ld.queued_requests),
                str(ld.queued_tokens),
                f"{ld.predicted_queue_ms:.0f}",
                str(ld.running),
                f"{used}/{ld.total_blocks}" if ld.total_blocks else "-",
            ]
        )
    lines += _table(
        [
            "worker",
            "kind",
            "address",
            "healthy",
            "queued",
            "queued_tok",
            "wait_ms",
            "running",
            "kv_blocks",
        ],
        rows,
    )
    lines.append("")
    rows = []
    for s in reply.stores:
        for t in s.tiers:
            looks = t.hits + t.misses
            rows.append(
                [
                    s.node_id,
                    s.address,
                    str(s.bulk_port) if s.bulk_port else "off",
                    t.tier,
                    f"{_bytes(t.used_bytes)} / {_bytes(t.capacity_bytes)}",
                    f"{100 * t.used_bytes / t.capacity_bytes:.1f}%" if t.capacity_bytes else "-",
                    str(t.blocks),
                    f"{100 * t.hits / looks:.1f}%" if looks else "-",
                    str(t.evictions),
                ]
            )
    lines += _table(
        [
            "store",
            "address",
            "bulk_port",
            "tier",
            "used / capacity",
            "full",
            "blocks",
            "hit_rate",
            "evictions",
        ],
        rows,
    )
    lines.append("")
    lines += format_memory(reply)
    return "\n".join(lines)


def memory_rows(reply) -> list[tuple[str, object]]:
    """(server, MemoryReport) of every server that reported its memory."""
    out = [("conductor", reply.conductor_memory)] if reply.HasField("conductor_memory") else []
    out += [(w.worker_id, w.load.memory) for w in reply.workers if w.load.HasField("memory")]
    out += [(s.node_id or s.address, s.memory) for s in reply.stores if s.HasField("memory")]
    return out


def format_memory(reply) -> list[str]:
    """Each server's resident memory against what it was configured to hold (weights, pools,
    in-memory tiers). PSS splits shared pages (the store's slab, which the workers map too)
    among the processes mapping them, so the PSS column sums to the cluster's memory."""
    rows, total_pss, total_cfg = [], 0, 0
    for name, m in memory_rows(reply):
        total_pss += m.pss_bytes
        total_cfg += m.configured_bytes
        rows.append(
            [
                name,
                _bytes(m.rss_bytes),
                _bytes(m.uss_bytes),
                _bytes(m.pss_bytes),
                _bytes(m.configured_bytes),
                f"{m.pss_bytes / m.configured_bytes:.2f}" if m.configured_bytes else "-",
            ]
        )
    if not rows:
        return []
    rows.append(
        [
            "total",
            "",
            "",
            _bytes(total_pss),
            _bytes(total_cfg),
            f"{total_pss / total_cfg:.2f}" if total_cfg else "-",
        ]
    )
    return _table(["server", "rss", "uss", "pss", "configured", "pss/configured"], rows)


def run(args: argparse.Namespace) -> int:
    with Client(args.address) as c:
        reply = c.status()
    if args.json:
        print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True)))
    else:
        print(format_status(reply))
    return 0
