"""Decode capacity with a KIVI KV cache: the same decode pool bytes, the same many-request
workload, for full precision, kivi4 and kivi2, each on a local cluster of its own (store node,
prefill worker, decode worker, conductor: one process each, as bench/e2e.py runs them).

The decode worker's `kv_cache_bytes` is sized so that full precision holds only --fp-sequences
whole sequences (prompt + answer); --requests requests of --prompt-tokens random ordinary tokens,
each asking for --new-tokens tokens (ignore_eos), are sent at once through the conductor. The
prompts share their first --shared-prefix-tokens tokens (cached in the store before the burst,
like a system prompt), so the prefill worker keeps up and the decode pool bounds the batch. Per
setting: the pool's capacity (Load.capacity_tokens), the largest decode batch reached, generated
tokens/s end to end (all tokens / wall time from the first send to the last token), and the mean
decode step time at that batch (from the decode worker's Prometheus metrics).

The KIVI decode runner reserves a full-precision window (kivi_residual // block_size + 1 blocks)
for each of max_batch sequences up front, so a KIVI setting's max_batch is capped at the number of
whole sequences the bytes hold (a larger cap only takes blocks from the packed pool).

"Full precision" is a 16-bit KV cache by default (--fp-kv-cache-dtype fp16, under fp32 compute
on a CPU whose fast dtype is fp32), and KIVI's window is 16-bit too (--kivi-window-dtype fp16):
the comparison KIVI's paper makes. With `auto` and --dtype float32 the baseline pool is twice a
16-bit cache's bytes and the *_vs_fp ratios would flatter KIVI by up to 2x.
The last line printed is one JSON object.

    .venv/bin/python bench/kivi_capacity.py [--requests 32 --prompt-tokens 2048
        --shared-prefix-tokens 1984 --new-tokens 128 --fp-sequences 4]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_flags, finish  # noqa: E402

SETTINGS = ("fp", "kivi4", "kivi2")  # fp: full precision, kv_cache_dtype --fp-kv-cache-dtype
PREFIX = {"fp": "fp", "kivi4": "kivi4", "kivi2": "kivi2"}


def kv_cache_dtype(setting: str, args) -> str:
    return args.fp_kv_cache_dtype if setting == "fp" else setting


def say(*a) -> None:
    print(*a, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- sizes from the layouts


def layout_of(model_config, setting: str, args, dtype):
    """The KV layout a server of this setting stores blocks in (servekit.kv_cache_layout)."""
    from servekit import kv_cache_layout

    cfg = SimpleNamespace(
        block_size=args.block_size,
        kv_cache_dtype=kv_cache_dtype(setting, args),
        kivi_group_size=args.kivi_group_size,
        kivi_residual=args.kivi_residual,
        kivi_window_dtype=args.kivi_window_dtype,
    )
    return kv_cache_layout(model_config, cfg, dtype)


def reserved_blocks(layout, tokens: int, block_size: int) -> int:
    """Pool blocks the decode worker reserves for a sequence of `tokens` tokens
    (DecodeRunner.blocks_to_reserve): all of them in full precision; with KIVI only the packed
    ones, since its last `residual` tokens stay in the window it reserves apart."""
    from kernels import KiviKVLayout

    if isinstance(layout, KiviKVLayout):
        return max(0, (tokens - layout.residual) // block_size)
    return -(-tokens // block_size)


def pool_fit(layout, budget: int, tokens: int, block_size: int, max_batch: int) -> tuple[int, int]:
    """(whole sequences of `tokens` tokens a decode pool of `budget` bytes holds at this
    max_batch, its capacity in tokens), as DecodeRunner / KiviDecodeRunner size their pools."""
    from kernels import KiviKVLayout

    need = max(1, reserved_blocks(layout, tokens, block_size))
    if not isinstance(layout, KiviKVLayout):
        blocks = budget // layout.block_bytes
        return min(max_batch, blocks // need), blocks * block_size
    per_seq = layout.residual // block_size + 1
    blocks = (budget - max_batch * per_seq * layout.window_layout.block_bytes) // layout.block_bytes
    if blocks < 1:
        return 0, 0
    return min(max_batch, blocks // need), blocks * block_size


def best_kivi_batch(layout, budget: int, tokens: int, block_size: int, cap: int) -> int:
    """The max_batch (<= cap) at which a KIVI pool of `budget` bytes holds the most sequences."""
    best, best_n = 1, 0
    for m in range(1, cap + 1):
        n, _ = pool_fit(layout, budget, tokens, block_size, m)
        if n > best_n:
            best, best_n = m, n
    return best


# ---------------------------------------------------------------- one cluster, one workload


def start_cluster(args, setting: str, budget: int, max_batch: int, metrics_port: int, dram: int):
    from deploy import LocalCluster, cluster_config_from_dict

    t = args.threads
    cfg = cluster_config_from_dict(
        {
            "model": args.model,
            "dtype": args.dtype,
            "block_size": args.block_size,
            "kv_cache_dtype": kv_cache_dtype(setting, args),
            "kivi_group_size": args.kivi_group_size,
            "kivi_residual": args.kivi_residual,
            "kivi_window_dtype": args.kivi_window_dtype,
            "store": {"dram_bytes": dram},
            # no device tier: every prompt's blocks go to the store, the decode worker pulls them
            "prefill": {
                "num_blocks": 1024,
                "chunk_size": 512,
                "device_cache": False,
                "torch_threads": t,
            },
            "decode": {
                "kv_cache_bytes": budget,
                "max_batch": max_batch,
                "torch_threads": t,
                "metrics_port": metrics_port,
                "publish": False,  # answers are not reused here: keep the store out of the run
            },
            # no early rejection: the decode worker's memory, not the SLOs, limits the batch
            # prompts queue behind each other's prefill for minutes: long deadlines
            "conductor": {
                "load_poll_s": 0.05,
                "ttft_slo_ms": 0,
                "tbt_slo_ms": 0,
                "load_timeout_s": 30.0,
                "prefill_timeout_s": 3600.0,
                "decode_timeout_s": 3600.0,
            },
        }
    )
    cluster = LocalCluster(cfg, processes=True)
    cluster.start()
    return cluster


def scrape(port: int) -> dict[str, float]:
    """The decode worker's counters this benchmark reads, from its Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {
        "halfmoon_decode_step_seconds_sum": "step_s",
        "halfmoon_decode_step_seconds_count": "steps",
        "halfmoon_decode_batch_size_sum": "batch_sum",
        "halfmoon_decode_batch_size_count": "batch_n",
        "halfmoon_decode_tokens_total": "tokens",
        "halfmoon_decode_recomputed_tokens_total": "recomputed",
    }
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = dict.fromkeys(want.values(), 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in want:
                out[want[s.name]] = s.value
    return out


def step_at_batch(samples: list[dict], batch: int) -> tuple[float | None, int]:
    """(mean step ms over the scrape intervals whose every step carried `batch` sequences,
    steps counted)."""
    step_s, steps = 0.0, 0
    for a, b in zip(samples, samples[1:]):
        n = b["batch_n"] - a["batch_n"]
        if n <= 0 or b["steps"] - a["steps"] != n:
            continue
        if (b["batch_sum"] - a["batch_sum"]) / n >= batch - 1e-6:
            step_s += b["step_s"] - a["step_s"]
            steps += int(n)
    return (step_s / steps * 1000.0 if steps else None), steps


def run_setting(args, setting: str, prompts: list, budget: int, max_batch: int, dram: int):
    import grpc

    from protos import halfmoon_pb2 as pb
    from protos import halfmoon_pb2_grpc as pb_grpc

    name = PREFIX[setting]
    port = free_port()
    say(f"{name}: starting the store node, the workers and the conductor (one process each)")
    t_start = time.perf_counter()
    cluster = start_cluster(args, setting, budget, max_batch, port, dram)
    say(f"{name}: cluster up in {time.perf_counter() - t_start:.0f} s at {cluster.address}")
    channel = grpc.insecure_channel(cluster.address)
    decode_addr = next(s.address for s in cluster.servers if s.role == "decode")
    dchannel = grpc.insecure_channel(decode_addr)
    try:
        stub = pb_grpc.ConductorStub(channel)
        dstub = pb_grpc.DecodeWorkerStub(dchannel)
        salt = f"kivi-capacity-{setting}-{time.time_ns()}"
        got: list[dict | None] = [None] * len(prompts)
        counts = [0] * len(prompts)

        def one(i: int, ids: list[int], max_tokens: int, t0: float) -> dict:
            req = pb.GenerateRequest(
                sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                cache_salt=salt,
            )
            req.token_ids.ids.extend(ids)
            first = last = None
            n, usage = 0, None
            for msg in stub.Generate(req, timeout=3600):
                if msg.token_ids:
                    last = time.perf_counter() - t0
                    first = last if first is None else first
                    n += len(msg.token_ids)
                    if i >= 0:
                        counts[i] = n
                if msg.HasField("usage"):
                    usage = msg.usage
            return {"first": first, "last": last, "n": n, "usage": usage}

        say(f"{name}: warming up (first forward passes)")
        rng = random.Random(1)
        for _ in range(2):
            warm = [rng.randrange(100, args.vocab - 100) for _ in range(2 * args.block_size + 3)]
            one(-1, warm, 4, time.perf_counter())
        if args.shared_prefix:  # the shared prefix's blocks in the store before the burst
            say(f"{name}: caching the {len(args.shared_prefix)}-token shared prefix")
            one(-1, args.shared_prefix + warm[:3], 2, time.perf_counter())

        samples: list[dict] = []
        done = threading.Event()
        load = dstub.Load(pb.LoadRequest(), timeout=10)

        def monitor(t0: float) -> None:
            last_say = 0.0
            while not done.is_set():
                try:
                    s = scrape(port)
                    ld = dstub.Load(pb.LoadRequest(), timeout=5)
                except Exception:  # noqa: BLE001 - a missed sample is only a gap
                    done.wait(0.25)
                    continue
                now = time.perf_counter() - t0
                s.update(t=now, running=ld.running, waiting=ld.waiting)
                samples.append(s)
                if now - last_say >= args.progress_s:
                    last_say = now
                    finished = sum(1 for g in got if g is not None)
                    say(
                        f"{name}: {now:6.1f} s  {sum(counts):5d}/{len(prompts) * args.new_tokens}"
                        f" tokens  running {ld.running:3d}  waiting {ld.waiting:3d}  "
                        f"done {finished}/{len(prompts)}"
                    )
                done.wait(0.25)

        before = scrape(port)
        barrier = threading.Barrier(len(prompts) + 1)
        errors: list[str] = []

        def worker(i: int) -> None:
            barrier.wait()
            try:
                got[i] = one(i, prompts[i], args.new_tokens, t0_box[0])
            except grpc.RpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}")
                got[i] = {"first": None, "last": None, "n": 0, "usage": None}

        t0_box = [0.0]
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        t0_box[0] = time.perf_counter()
        barrier.wait()
        mon = threading.Thread(target=monitor, args=(t0_box[0],), daemon=True)
        mon.start()
        for t in threads:
            t.join()
        done.set()
        mon.join()
        after = scrape(port)
        samples.append({**after, "t": time.perf_counter() - t0_box[0], "running": 0, "waiting": 0})
        load = dstub.Load(pb.LoadRequest(), timeout=10)
    finally:
        channel.close()
        dchannel.close()
        cluster.stop()
    if errors:
        say(f"{name}: {len(errors)} request(s) failed, first: {errors[0]}")

    ok = [g for g in got if g["usage"] is not None]
    tokens = sum(g["n"] for g in got)
    wall = max((g["last"] for g in got if g["last"] is not None), default=float("nan"))
    reached = max((g["usage"].max_decode_batch for g in ok), default=0)
    batch = max(reached, load.max_batch_seen)
    step_ms, step_n = step_at_batch(samples, batch)
    step_s = after["step_s"] - before["step_s"]
    dec_tokens = after["tokens"] - before["tokens"]
    out = {
        "max_batch_config": max_batch,
        "capacity_tokens": load.capacity_tokens,
        "pool_blocks": load.total_blocks,
        "block_bytes": load.block_bytes,
        "max_batch": batch,
        "max_decode_batch_usage": reached,
        "max_batch_seen_load": load.max_batch_seen,
        "tokens": tokens,
        "requests_ok": len(ok),
        "wall_s": round(wall, 2),
        "decode_tok_s": tokens / wall if wall == wall and wall > 0 else 0.0,
        "step_ms_at_max_batch": round(step_ms, 2) if step_ms is not None else None,
        "steps_at_max_batch": step_n,
        # tokens per second of decode step time (the decode worker's own rate, prefill aside)
        "step_tok_s": dec_tokens / step_s if step_s > 0 else 0.0,
        "decode_steps": int(after["steps"] - before["steps"]),
        "decode_coef": [round(c, 5) for c in load.decode_coef],
        "recomputed_tokens": int(after["recomputed"] - before["recomputed"]),
        "ttft_p50_ms": round(statistics.median(g["first"] for g in ok) * 1000.0, 1) if ok else None,
        "tbt_mean_ms": round(statistics.fmean(g["usage"].tbt_mean_ms for g in ok), 2)
        if ok
        else None,
    }
    say(
        f"{name}: {tokens} tokens in {wall:.1f} s = {out['decode_tok_s']:.1f} tok/s; "
        f"largest decode batch {batch} (capacity {load.capacity_tokens} tokens, "
        f"step {out['step_ms_at_max_batch']} ms at batch {batch}, "
        f"recomputed {out['recomputed_tokens']})"
    )
    return out


# ---------------------------------------------------------------- report


def plot(result: dict, names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    colors = {"fp": "tab:gray", "kivi4": "tab:blue", "kivi2": "tab:green"}
    xs = range(len(names))
    batches = [result.get(f"{n}_max_batch") or 0 for n in names]
    tput = [result.get(f"{n}_decode_tok_s") or 0 for n in names]
    a.bar(xs, batches, color=[colors[n] for n in names])
    b.bar(xs, tput, color=[colors[n] for n in names])
    for ax, vals, fmt in ((a, batches, "{:d}"), (b, tput, "{:.1f}")):
        for x, v in zip(xs, vals):
            ax.annotate(fmt.format(v), (x, v), ha="center", va="bottom")
        ax.set_xticks(list(xs), names)
    a.set_ylabel("largest decode batch reached")
    b.set_ylabel("generated tokens/s, end to end")
    mb = result["kv_cache_bytes"] / 2**20
    fig.suptitle(
        f"{result['model']} {result['dtype']}: {result['requests']} x "
        f"({result['prompt_tokens']} + {result['new_tokens']}) tokens, "
        f"decode pool {mb:.0f} MiB (fp holds {result['fp_sequences']} sequences)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights and full-precision KV (bf16 is emulated, and slow, on a CPU without "
        "avx512_bf16)",
    )
    ap.add_argument(
        "--fp-kv-cache-dtype",
        default="fp16",
        choices=["fp16", "bf16", "auto"],
        help="the full-precision baseline's KV cache: 16 bits, as KIVI's paper compares "
        "(auto: the compute dtype, which with float32 flatters KIVI by 2x)",
    )
    ap.add_argument(
        "--kivi-window-dtype",
        default="fp16",
        choices=["fp16", "bf16", "auto"],
        help="KIVI's full-precision window (auto: the compute dtype)",
    )
    ap.add_argument("--requests", type=int, default=32, help="concurrent requests")
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="prompt tokens per request")
    ap.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=1984,
        help="leading prompt tokens every request shares (a system prompt, cached in the store "
        "before the burst), so that prefill keeps up and the decode pool, not the prefill "
        "worker, bounds the batch; 0: every prompt distinct",
    )
    ap.add_argument("--new-tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument(
        "--fp-sequences",
        type=int,
        default=4,
        help="whole sequences the decode pool holds in full precision (sizes kv_cache_bytes)",
    )
    ap.add_argument("--kivi-residual", type=int, default=32, help="KIVI full-precision window")
    ap.add_argument("--kivi-group-size", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--max-batch",
        type=int,
        default=64,
        help="decode max_batch; a KIVI setting's is capped at the sequences its bytes hold",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="of fp, kivi4, kivi2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines")
    ap.add_argument("--plot", default="runs/bench/kivi_capacity.png")
    args = ap.parse_args(argv)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in settings if s not in SETTINGS]
    if bad or not settings:
        ap.error(f"--settings: unknown {bad}; known: {', '.join(SETTINGS)}")

    import torch

    from model import load_model_info
    from servekit import blocks_needed, torch_dtype

    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    flags = cpu_flags()
    info = load_model_info(args.model)
    mc = info.config
    args.vocab = mc.vocab_size
    dtype = torch_dtype(args.dtype)
    bs = args.block_size
    need = blocks_needed(args.prompt_tokens, args.new_tokens, bs)
    seq_tokens = args.prompt_tokens + args.new_tokens
    full = layout_of(mc, "fp", args, dtype)
    budget = args.fp_sequences * need * full.block_bytes
    say(
        f"{args.model} ({args.dtype}): {args.requests} requests x ({args.prompt_tokens} prompt + "
        f"{args.new_tokens} new) tokens = {need} blocks each; decode pool {budget / 2**20:.1f} MiB "
        f"= {args.fp_sequences} full-precision ({args.fp_kv_cache_dtype}) sequences; "
        f"{os.cpu_count()} CPUs, "
        f"load average {load_start:.1f}, flags {flags}"
    )

    if not 0 <= args.shared_prefix_tokens < args.prompt_tokens:
        ap.error("--shared-prefix-tokens must be at least 0 and below --prompt-tokens")
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, mc.vocab_size - 100) for _ in range(n)]

    args.shared_prefix = tokens(args.shared_prefix_tokens)
    distinct = args.prompt_tokens - args.shared_prefix_tokens
    prompts = [args.shared_prefix + tokens(distinct) for _ in range(args.requests)]
    # the store holds every prompt's blocks (they are all prefilled before most are decoded)
    dram = max(256 << 20, int(args.requests * need * full.block_bytes * 1.25))

    result: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "shared_prefix_tokens": args.shared_prefix_tokens,
        "new_tokens": args.new_tokens,
        "fp_sequences": args.fp_sequences,
        "fp_kv_cache_dtype": args.fp_kv_cache_dtype,
        "kivi_window_dtype": args.kivi_window_dtype,
        "kivi_residual": args.kivi_residual,
        "kivi_group_size": args.kivi_group_size,
        "block_size": bs,
        "blocks_per_sequence": need,
        "kv_cache_bytes": budget,
        "max_batch": args.max_batch,
        "torch_threads_per_worker": args.threads,
    }
    max_batches: dict[str, int] = {}
    for s in settings:
        layout = layout_of(mc, s, args, dtype)
        p = PREFIX[s]
        result[f"{p}_block_bytes"] = layout.block_bytes
        if s == "fp":
            max_batches[s] = args.max_batch
        else:
            max_batches[s] = best_kivi_batch(layout, budget, seq_tokens, bs, args.max_batch)
            result[f"{p}_window_block_bytes"] = layout.window_layout.block_bytes
            result[f"{p}_bytes_per_token_vs_fp"] = layout.bytes_per_token(
                args.prompt_tokens + args.new_tokens
            ) / (full.block_bytes / bs)
        result[f"{p}_sequences_fit"] = pool_fit(layout, budget, seq_tokens, bs, max_batches[s])[0]
        say(
            f"{p}: max_batch {max_batches[s]}, holds {result[f'{p}_sequences_fit']} sequences "
            f"(block {layout.block_bytes} bytes)"
        )

    for s in settings:
        p = PREFIX[s]
        try:
            r = run_setting(args, s, prompts, budget, max_batches[s], dram)
        except Exception as exc:  # noqa: BLE001 - the other settings still run
            say(f"{p}: failed: {exc}")
            result[f"{p}_error"] = str(exc)
            continue
        result.update({f"{p}_{k}": v for k, v in r.items()})

    fp_batch, fp_tput, fp_cap = (
        result.get(f"fp_{k}") for k in ("max_batch", "decode_tok_s", "capacity_tokens")
    )
    for p in ("kivi4", "kivi2"):
        if f"{p}_max_batch" not in result or not fp_batch:
            continue
        result[f"{p}_max_batch_vs_fp"] = result[f"{p}_max_batch"] / fp_batch
        # decode throughput at the largest batch each pool allows: batch / step time there
        fp_rate, rate = (
            result.get(f"{n}_max_batch") / result[f"{n}_step_ms_at_max_batch"]
            if result.get(f"{n}_step_ms_at_max_batch")
            else None
            for n in ("fp", p)
        )
        result[f"{p}_decode_tput_vs_fp"] = rate / fp_rate if rate and fp_rate else None
        # end to end (prefill of every prompt included): all tokens / wall time
        result[f"{p}_e2e_tput_vs_fp"] = result[f"{p}_decode_tok_s"] / fp_tput if fp_tput else None
        result[f"{p}_capacity_vs_fp"] = result[f"{p}_capacity_tokens"] / fp_cap if fp_cap else None
    if full.dtype == torch.float32:
        result["note"] = (
            "the full-precision pool holds fp32: 2x a 16-bit cache's bytes while packed blocks "
            "are not, so *_vs_fp flatter KIVI by up to 2x in memory (--fp-kv-cache-dtype fp16)"
        )

    names = [PREFIX[s] for s in settings]
    say("")
    say(
        f"{'setting':8} {'max_batch':>9} {'fits':>5} {'capacity':>9} {'reached':>8} "
        f"{'tok/s':>7} {'step ms':>8} {'step tok/s':>10} {'wall s':>7} {'bytes/tok':>9}"
    )
    for n in names:
        if f"{n}_max_batch" not in result:
            say(f"{n:8} failed: {result.get(f'{n}_error')}")
            continue
        g = lambda k: result.get(f"{n}_{k}")  # noqa: E731
        step = g("step_ms_at_max_batch")
        per_tok = g("bytes_per_token_vs_fp") or 1.0
        say(
            f"{n:8} {g('max_batch_config'):9d} {g('sequences_fit'):5d} {g('capacity_tokens'):9d} "
            f"{g('max_batch'):8d} {g('decode_tok_s'):7.1f} "
            f"{(f'{step:.1f}' if step is not None else '-'):>8} {g('step_tok_s'):10.1f} "
            f"{g('wall_s'):7.1f} {per_tok:9.3f}"
        )
    for p in ("kivi4", "kivi2"):
        if f"{p}_max_batch_vs_fp" in result:
            say(
                f"{p} vs fp: max batch {result[f'{p}_max_batch_vs_fp']:.2f}x, "
                f"decode tok/s at max batch {result[f'{p}_decode_tput_vs_fp'] or 0:.2f}x, "
                f"end to end {result[f'{p}_e2e_tput_vs_fp'] or 0:.2f}x, "
                f"capacity {result[f'{p}_capacity_vs_fp']:.2f}x"
            )
    if "note" in result:
        say(result["note"])

    result["cpu_flags"] = flags
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    draw = (lambda: plot(result, names, ROOT / args.plot)) if args.plot else None
    return finish(result, load_start, draw, args.plot)


if __name__ == "__main__":
    sys.exit(main())
