"""Time to first token for a long cached context over a thin link: raw fp16 blocks, int8 blocks,
CacheGen with adaptive levels, and recomputing from text, at --gbps link speeds; plus (unless
--skip-codec) the codec's sizes, quality and speed from bench/cachegen_codec.py.

One real store node serves the prefix over gRPC, paced to each link speed (StoreConfig.link_gbps,
a token bucket per stream); the prefill side is this process (SmolLM2-135M, fp32 compute, an fp16
KV pool). Per link speed and method, TTFT = moving the prefix into the pool (fetch, decode, write)
+ computing the prompt's last --suffix tokens over it (measured, and the same for every method
that loads the prefix) ; recompute = prefilling the whole prompt. CacheGen runs the serving code
itself (`KVConnector.fetch_chunks`): chunk by chunk, the highest option whose cost fits the
measured throughput, the measured decode time and the budget (--slo-ms, or the recompute time
times --slo-fraction), recomputing from text when no option can make it (the chunks it did not
fetch are then computed, and counted). The options are the CacheGen levels and the chunk's stored
fp16 blocks ("R", lossless, no decode): "cachegen" is that rule, "coded only" the rule over the
levels alone (as before the stored blocks were an option), and "tight" the rule with a budget of
--tight-fraction of the raw fetch's time, where only a mix of raw chunks on the link and coded
chunks on the decoder can come close. Each row's options read one character a chunk: R = raw,
1-4 = a level, - = recomputed. The text is an argument (--text); the final line is one JSON
object.

    .venv/bin/python bench/cachegen.py [--context 4096 --gbps 0.1,0.5,1,5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import finish, median_s  # noqa: E402

DEFAULT_TEXT = ROOT / "bench" / "data" / "pride_and_prejudice.txt"


def say(*a) -> None:
    print(*a, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--context", type=int, default=4096, help="cached prompt tokens")
    ap.add_argument("--suffix", type=int, default=16, help="new prompt tokens after the prefix")
    ap.add_argument("--gbps", default="0.1,0.5,1,5", help="link speeds, Gbit/s")
    ap.add_argument("--chunk-blocks", type=int, default=64, help="blocks per CacheGen chunk")
    ap.add_argument("--slo-ms", type=float, default=0.0, help="CacheGen's TTFT budget")
    ap.add_argument(
        "--slo-fraction",
        type=float,
        default=0.1,
        help="without --slo-ms: the budget is this fraction of the recompute time",
    )
    ap.add_argument(
        "--tight-fraction",
        type=float,
        default=0.5,
        help="the tight run's fetch budget, as a fraction of the raw fp16 fetch's time",
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--skip-codec", action="store_true", help="only the TTFT part")
    ap.add_argument("--plot", default="runs/bench/cachegen_ttft.png")
    args = ap.parse_args(argv)

    import torch

    from kernels import FullKVLayout
    from kvstore import block_keys
    from kvstore.client import (
        CACHEGEN_LEVELS,
        RAW_LEVEL,
        ChunkPlan,
        KVConnector,
        StoreClient,
        chunk_keys,
    )
    from kvstore.client.cachegen_stream import encode_chunk
    from kvstore.node import StoreConfig, StoreNode
    from model import KVPool, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    lm = load_model(args.model, torch.float32)
    c = lm.config
    bs = 16
    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    ids = lm.tokenizer.encode(text)[: args.context + args.suffix]
    if len(ids) < args.context + args.suffix:
        raise SystemExit(f"{args.text} holds {len(ids)} tokens, need {args.context + args.suffix}")
    n_blocks = args.context // bs
    prefix_tokens = n_blocks * bs
    layout = FullKVLayout(c.num_layers, c.num_kv_heads, c.head_dim, bs, torch.float16)
    fp = "bench-cachegen"
    total_blocks = n_blocks + args.suffix // bs + 2
    pool = KVPool(c, total_blocks, bs, torch.float16, layout=layout)
    say(
        f"{args.model}: context {prefix_tokens} + {args.suffix} tokens, fp16 KV "
        f"{n_blocks * layout.block_bytes / 2**20:.1f} MiB; {torch.get_num_threads()} threads, "
        f"load {load0:.2f}"
    )

    # ---- the two compute costs every method shares or replaces ----
    table = list(range(total_blocks))
    prompt = torch.tensor(ids, dtype=torch.long)
    recompute_s = median_s(
        lambda: lm.model.prefill(prompt, pool, table, 0, last_only=True),
        args.repeats,
        warmup=False,  # the model ran once already (loading); this is the slow one
    )
    # the pool now holds the prompt's KV: the prefix's blocks are what every store serves
    blocks = pool.kv[:n_blocks].clone()
    suffix_s = median_s(
        lambda: lm.model.prefill(
            prompt[prefix_tokens:], pool, table, prefix_tokens, last_only=True
        ),
        args.repeats,
    )
    say(
        f"recompute {recompute_s * 1000:.0f} ms; "
        f"suffix over a cached prefix {suffix_s * 1000:.0f} ms"
    )

    node = StoreNode(
        StoreConfig(
            node_id="link", dram_bytes=int(n_blocks * layout.block_bytes * 3.2) + (64 << 20)
        )
    )
    node.start()
    result: dict = {"model": args.model, "context_tokens": prefix_tokens, "suffix": args.suffix}
    try:
        keys = block_keys(ids[:prefix_tokens], bs, fp)
        int8_keys = block_keys(ids[:prefix_tokens], bs, fp + "/int8")
        with StoreClient(node.address, transport="grpc") as client:
            client.put(keys, blocks, fp)
            client.put(int8_keys, blocks, fp, codec="int8")
            t0 = time.perf_counter()
            for level in CACHEGEN_LEVELS:
                for i, ck in enumerate(chunk_keys(keys, args.chunk_blocks, level)):
                    lo = i * args.chunk_blocks
                    payload = encode_chunk(blocks[lo : lo + args.chunk_blocks].float(), level)
                    client.put([ck], payload[None], fp, codec=f"cachegen{level}")
            say(f"encoded every chunk at levels {list(CACHEGEN_LEVELS)} in "
                f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
            raw_bytes = sum(client.lookup(keys).sizes)
            int8_bytes = sum(client.lookup(int8_keys).sizes)
            level_bytes = {
                lv: sum(client.lookup(chunk_keys(keys, args.chunk_blocks, lv)).sizes)
                for lv in CACHEGEN_LEVELS
            }
        result.update(
            raw_fp16_bytes=raw_bytes,
            int8_bytes=int8_bytes,
            **{f"level{lv}_bytes": n for lv, n in level_bytes.items()},
            recompute_ms=round(recompute_s * 1000, 1),
            suffix_ms=round(suffix_s * 1000, 1),
        )
        slo_s = args.slo_ms / 1000.0 if args.slo_ms else recompute_s * args.slo_fraction
        result["slo_ms"] = round(slo_s * 1000, 1)
        staging = torch.empty_like(blocks)
        n_chunks = n_blocks // args.chunk_blocks

        def options(levels: list[int]) -> str:
            """One character a chunk: R = its stored blocks, 1-4 = a level, - = recomputed."""
            chars = ["R" if lv == RAW_LEVEL else str(lv) for lv in levels]
            return "".join(chars) + "-" * (n_chunks - len(levels))

        def adaptive(conn, gbps: float, budget_s: float, raw: bool, repeats: int) -> dict:
            """fetch_chunks' TTFT over `repeats` runs (the median; what the median run did)."""
            runs = []
            for _ in range(repeats):
                table: list[int] = []
                free_ids = list(range(total_blocks))
                t0 = time.perf_counter()
                plan = ChunkPlan(
                    levels=tuple(CACHEGEN_LEVELS),
                    chunk_blocks=args.chunk_blocks,
                    deadline=t0 + budget_s,
                    recompute_s_per_chunk=recompute_s * args.chunk_blocks / n_blocks,
                    prior_bytes_per_s=gbps * 1e9 / 8,
                    raw=raw,
                )
                got = conn.fetch_chunks(
                    "link",
                    keys,
                    table,
                    n_blocks,
                    lambda n: [free_ids.pop(0) for _ in range(n)],  # noqa: B023
                    plan,
                )
                fetch_s = time.perf_counter() - t0
                # what was not fetched is computed over what was
                left = prefix_tokens - got.blocks * bs
                compute_s = suffix_s + recompute_s * left / (prefix_tokens + args.suffix)
                runs.append((fetch_s + compute_s, got))
            ttft_s, got = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
            return {
                "ttft_ms": round(ttft_s * 1000, 1),
                "options": options(got.levels),
                "levels": got.levels,
                "bytes": got.bytes,
                "blocks": got.blocks,
                "fetch_ms": round(got.ms, 1),
                "decode_ms": round(got.decode_ms, 1),
                "wait_ms": round(got.wait_ms, 1),
            }

        rows = []
        for gbps in [float(x) for x in args.gbps.split(",")]:
            node.set_link_gbps(gbps)
            with StoreClient(node.address, transport="grpc") as client:

                def fetch(ks):
                    assert client.get_into(ks, staging) == len(ks)
                    pool.kv[: len(ks)] = staging

                raw_s = median_s(lambda: fetch(keys), args.repeats, warmup=False)
                int8_s = median_s(lambda: fetch(int8_keys), args.repeats, warmup=False)
            # A connector per link speed (its throughput and decode times measured afresh), and
            # one untimed fetch first: the rule knows a link only by what crossed it.
            conn = KVConnector(pool.kv, layout, fp, node.address, store_node="link")
            try:
                adaptive(conn, gbps, slo_s - suffix_s, raw=True, repeats=1)
                cg = adaptive(conn, gbps, slo_s - suffix_s, raw=True, repeats=args.repeats)
                coded = adaptive(conn, gbps, slo_s - suffix_s, raw=False, repeats=args.repeats)
                tight_s = raw_s * args.tight_fraction
                tight = adaptive(conn, gbps, tight_s, raw=True, repeats=args.repeats)
            finally:
                conn.close()
            row = {
                "gbps": gbps,
                "raw_fp16_ttft_ms": round((raw_s + suffix_s) * 1000, 1),
                "int8_ttft_ms": round((int8_s + suffix_s) * 1000, 1),
                "cachegen_ttft_ms": cg["ttft_ms"],
                "recompute_ttft_ms": round(recompute_s * 1000, 1),
                "cachegen_levels": cg["levels"],
                "cachegen_options": cg["options"],
                "cachegen_bytes": cg["bytes"],
                "cachegen_blocks": cg["blocks"],
                "cachegen_fetch_ms": cg["fetch_ms"],
                "cachegen_decode_ms": cg["decode_ms"],
                "cachegen_wait_ms": cg["wait_ms"],
                "cachegen_coded_only_ttft_ms": coded["ttft_ms"],
                "cachegen_coded_only_options": coded["options"],
                "cachegen_coded_only_decode_ms": coded["decode_ms"],
                "cachegen_coded_only_wait_ms": coded["wait_ms"],
                "tight_budget_ms": round(tight_s * 1000, 1),
                "cachegen_tight_ttft_ms": tight["ttft_ms"],
                "cachegen_tight_options": tight["options"],
                "cachegen_tight_fetch_ms": tight["fetch_ms"],
                "cachegen_tight_decode_ms": tight["decode_ms"],
                "cachegen_tight_wait_ms": tight["wait_ms"],
            }
            rows.append(row)
            say(
                f"{gbps:5.2f} Gbit/s: raw fp16 {row['raw_fp16_ttft_ms']:7.0f} ms  int8 "
                f"{row['int8_ttft_ms']:7.0f} ms  recompute {row['recompute_ttft_ms']:7.0f} ms\n"
                f"    cachegen   {cg['ttft_ms']:7.0f} ms {cg['options']:>8} "
                f"(fetch {cg['fetch_ms']:.0f}: decode {cg['decode_ms']:.0f}, "
                f"wait {cg['wait_ms']:.0f})\n"
                f"    coded only {coded['ttft_ms']:7.0f} ms {coded['options']:>8} "
                f"(fetch {coded['fetch_ms']:.0f}: decode {coded['decode_ms']:.0f}, "
                f"wait {coded['wait_ms']:.0f})\n"
                f"    tight      {tight['ttft_ms']:7.0f} ms {tight['options']:>8} "
                f"(budget {tight_s * 1000:.0f}, fetch {tight['fetch_ms']:.0f}: decode "
                f"{tight['decode_ms']:.0f}, wait {tight['wait_ms']:.0f})"
            )
    finally:
        node.stop()
    result["rows"] = rows
    by = {r["gbps"]: r for r in rows}
    if 1.0 in by:
        r = by[1.0]
        for key, ttft in (
            ("cachegen_ttft_vs_raw_1gbps", "cachegen_ttft_ms"),
            ("cachegen_coded_only_ttft_vs_raw_1gbps", "cachegen_coded_only_ttft_ms"),
            ("cachegen_tight_ttft_vs_raw_1gbps", "cachegen_tight_ttft_ms"),
        ):
            result[key] = round(r[ttft] / r["raw_fp16_ttft_ms"], 3)
    if 0.1 in by:
        r = by[0.1]
        best = min(r["raw_fp16_ttft_ms"], r["int8_ttft_ms"], r["recompute_ttft_ms"])
        result["cachegen_ttft_vs_best_baseline_0_1gbps"] = round(r["cachegen_ttft_ms"] / best, 3)
    if not args.skip_codec:
        result.update(run_codec_bench(args.text))
    draw = (lambda: plot(rows, result, ROOT / args.plot)) if args.plot else None
    return finish(result, load0, draw, args.plot)


def run_codec_bench(text: str) -> dict:
    """bench/cachegen_codec.py's figures (its own process, its progress shown as it goes): the
    JSON object its last line prints."""
    import subprocess

    say("codec sizes, quality and speed (bench/cachegen_codec.py):")
    cmd = [sys.executable, str(ROOT / "bench" / "cachegen_codec.py"), "--text", text]
    last = ""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            last = line if line.strip() else last
            print("  " + line, end="", flush=True)
    if proc.returncode:
        raise SystemExit(f"bench/cachegen_codec.py failed ({proc.returncode})")
    return json.loads(last)


def plot(rows: list[dict], result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["gbps"] for r in rows]
    for key, label in (
        ("raw_fp16_ttft_ms", "raw fp16 fetch"),
        ("int8_ttft_ms", "int8 fetch"),
        ("cachegen_ttft_ms", "CacheGen (adaptive, raw an option)"),
        ("cachegen_coded_only_ttft_ms", "CacheGen (adaptive, coded only)"),
        ("cachegen_tight_ttft_ms", "CacheGen (tight budget)"),
        ("recompute_ttft_ms", "recompute from text"),
    ):
        ax.plot(xs, [r[key] / 1000 for r in rows], marker="o", label=label)
    for r in rows:
        ax.annotate(
            r["cachegen_options"],
            (r["gbps"], r["cachegen_ttft_ms"] / 1000),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link, Gbit/s")
    ax.set_ylabel("time to first token, s")
    ax.set_title(f"{result['model']}: {result['context_tokens']} cached tokens")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
