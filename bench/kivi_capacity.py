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
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.kivi_capacity_run import (  # noqa: E402
    PREFIX,
    SETTINGS,
    kv_cache_dtype,
    run_setting,
    say,
)
from bench.machine import cpu_flags, finish  # noqa: E402

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
    from servekit import blocks_needed
    from servekit.worker import torch_dtype

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
