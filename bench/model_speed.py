r"""Model speed on SmolLM2: prefill and decode tokens/s beside transformers, and decode at
batch 16 against the machine's floor for it.

Like with like, same dtype (--dtype, `auto`: the machine's fastest), same weights (the GGUF),
medians of --repeats rounds run in turn so that load drifts fall on every system alike:
- prefill: one forward over a 512-token prompt that writes its KV and returns the last
  position's logits (ours: `prefill` into a paged pool; transformers: `forward` with a cache and
  `logits_to_keep=1`);
- decode: tokens after each sequence's first one over the time from the first to the last step,
  at batch 1 and 16 (ours: the engine's own step timing; transformers: `generate`'s streamer).
- roofline: a decode step reads every weight once, so its floor is the weights' bytes plus the
  step's KV bytes over the read bandwidth (a sum over 512 MiB) measured in each round of the
  batch-16 runs, beside them (median, with its range);
  `decode_16_vs_roofline` is that floor over the achieved step time (1.0 = at the floor).
  Beside it the arithmetic floor: the step's FLOPs at the rate of one large matmul, measured
  likewise (`matmul_gflops`); `decode_16_vs_roofline_and_compute` puts the higher of the two
  floors over the step time (at batch 16 on 2 cores the FLOPs can take longer than the reads).
Last line: one JSON object, with the CPU's flags and the load.

    .venv/bin/python bench/model_speed.py [--threads N] [--new-tokens 33] \
        [--plot runs/bench/model_speed.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import median_s  # noqa: E402
from model import Engine, SamplingParams, load_model  # noqa: E402
from model.fetch import fetch_smollm2  # noqa: E402
from servekit.machine import cpu_flags, native_dtype  # noqa: E402
from servekit.memory import tensor_bytes  # noqa: E402


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, length), generator=g).tolist()


class StepClock:
    """A transformers streamer that only notes when each step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def decode_ours(lm, batch: int, prompt_len: int, new_tokens: int):
    """A run -> decode tokens/s of our engine (all sequences together), from the engine's own step
    timing."""
    engine = Engine(lm)
    ps = prompts(batch, prompt_len, lm.config.vocab_size)
    engine.generate_batch(
        ps, SamplingParams(max_tokens=2, ignore_eos=True)
    )  # warm-up (pool, allocator)

    def run() -> float:
        engine.generate_batch(ps, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        t = engine.last_timing
        return t.decode_tokens / t.decode_s

    return run


def decode_theirs(hf, batch: int, prompt_len: int, new_tokens: int, vocab: int):
    """A run -> decode tokens/s of transformers' generate (greedy, EOS off so it runs all
    tokens)."""
    ids = torch.tensor(prompts(batch, prompt_len, vocab))

    def gen(n: int) -> list[float]:
        clock = StepClock()
        with torch.inference_mode():
            hf.generate(
                ids,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                streamer=clock,
            )
        return clock.times

    gen(2)

    def run() -> float:
        times = gen(new_tokens)
        # put() #0 is the prompt, #1 the first new token (after prefill), then one per decode step.
        return batch * (len(times) - 2) / (times[-1] - times[1])

    return run


def prefill_ours(lm, length: int):
    """A run -> prefill tokens/s (one prompt of `length` tokens, logits of the last position)."""
    from model import KVPool

    ids = torch.tensor(prompts(1, length, lm.config.vocab_size)[0])
    pool = KVPool(lm.config, -(-length // 16), 16, dtype=lm.model.dtype)
    table = pool.allocate(pool.num_blocks)
    lm.model.prefill(ids[:32], pool, table, last_only=True)

    def run() -> float:
        t = time.perf_counter()
        lm.model.prefill(ids, pool, table, last_only=True)
        return length / (time.perf_counter() - t)

    return run


def prefill_theirs(hf, length: int, vocab: int):
    """A run -> prefill tokens/s of transformers' forward over the prompt, filling a KV cache and
    keeping the last position's logits (what our prefill does)."""
    ids = torch.tensor(prompts(1, length, vocab))

    def run() -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            hf(ids, use_cache=True, logits_to_keep=1)
        return length / (time.perf_counter() - t)

    run()
    return run


def read_bandwidth() -> float:
    """Bytes read per second by a sum over 512 MiB (a read-only pass, as a decode step's weight
    reads are)."""
    x = torch.ones(128 << 20, dtype=torch.float32)
    return x.numel() * 4 / median_s(lambda: x.sum(), 5)


def matmul_rate(dtype: torch.dtype) -> float:
    """FLOP/s of one large square matmul in `dtype` (torch's, oneDNN's on the CPU): the
    arithmetic ceiling a decode step's matmuls could reach here."""
    n = 2048
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / median_s(lambda: a @ b, 7)


def step_flops(c, batch: int, context: int) -> int:
    """FLOPs of one Llama-family decode step over `batch` sequences of `context` tokens: every
    projection and the LM head once per row, attention's scores and values over the context."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * (
        c.intermediate_size
    )
    matmuls = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    attention = c.num_layers * 2 * 2 * context * q
    return 2 * batch * matmuls + batch * attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="both systems' dtype (auto: bfloat16 with avx512_bf16, else float32)",
    )
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt length before decode")
    ap.add_argument(
        "--new-tokens", type=int, default=33, help="new tokens per sequence in the decode runs"
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per workload (median)")
    ap.add_argument("--plot", default="runs/bench/model_speed.png")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    flags = cpu_flags()
    if args.dtype == "auto":
        args.dtype = native_dtype(flags)
    dtype = getattr(torch, args.dtype)
    load_start = os.getloadavg()[0]
    path = fetch_smollm2(quiet=True)
    print(
        f"threads={torch.get_num_threads()} dtype={args.dtype} load average at start="
        f"{load_start:.2f} flags={flags}",
        flush=True,
    )
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    vocab = hf.config.vocab_size
    lm = load_model("smollm2-135m", dtype=args.dtype)
    b = args.batch
    res: dict[str, float] = {}
    # Each workload runs both systems in turn, `repeats` rounds, median of each: on a shared
    # machine the load drifts, and interleaving spreads it evenly over the systems compared.
    workloads = [
        (
            "prefill",
            lambda: prefill_theirs(hf, args.prefill_len, vocab),
            lambda: prefill_ours(lm, args.prefill_len),
        ),
        (
            "decode_b1",
            lambda: decode_theirs(hf, 1, args.prompt_len, args.new_tokens, vocab),
            lambda: decode_ours(lm, 1, args.prompt_len, args.new_tokens),
        ),
        (
            f"decode_b{b}",
            lambda: decode_theirs(hf, b, args.prompt_len, args.new_tokens, vocab),
            lambda: decode_ours(lm, b, args.prompt_len, args.new_tokens),
        ),
    ]
    # the machine's two ceilings, measured in each round of the batch-b decode runs, beside them
    # (on this shared machine one read pass has measured 25 to 56 GB/s over minutes, one matmul
    # 216 to 415 GFLOP/s): the read floor is taken at the moment of the step it bounds
    bws: list[float] = []
    flop_rates: list[float] = []
    for work, make_theirs, make_ours in workloads:
        t0 = time.perf_counter()
        runs = {f"hf_{work}": make_theirs(), work: make_ours()}
        rates: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.repeats):
            print(f"{work}: round {r + 1}/{args.repeats}", flush=True)
            for k, run in runs.items():
                rates[k].append(run())
            if work == f"decode_b{b}":
                bws.append(read_bandwidth())
                flop_rates.append(matmul_rate(dtype))
        for k, v in rates.items():
            res[f"{k}_tok_s"] = round(statistics.median(v), 2)
            print(f"  {k:<24} {res[f'{k}_tok_s']:>9.1f} tok/s (median)", flush=True)
        print(f"{work}: {time.perf_counter() - t0:.0f} s", flush=True)

    bw, flop_rate = statistics.median(bws), statistics.median(flop_rates)
    # the floor of a batch-b decode step: every weight read once, plus the step's KV
    # parameters and buffers: a tied head packed as the embedding is a buffer, read every step
    weights = tensor_bytes(*lm.model.parameters(), *lm.model.buffers())
    c = lm.config
    context = args.prompt_len + args.new_tokens // 2  # the mean context over the run
    kv = b * context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * dtype.itemsize
    floor_s = (weights + kv) / bw
    step_s = b / res[f"decode_b{b}_tok_s"]
    # the arithmetic floor beside it: the step's FLOPs at this run's large-matmul rate (a decode
    # step's floor is the higher of the two: the roofline's other ceiling)
    compute_s = step_flops(c, b, context) / flop_rate
    summary = {
        "bench": "model_speed",
        "model": "smollm2-135m",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "cpu_flags": flags,
        "load_average_start": round(load_start, 2),
        "load_average_end": round(os.getloadavg()[0], 2),
        **res,
        "read_gbps": round(bw / 1e9, 2),
        "read_gbps_range": [round(min(bws) / 1e9, 1), round(max(bws) / 1e9, 1)],
        "weights_mb": round(weights / 2**20, 1),
        f"decode_b{b}_floor_ms": round(floor_s * 1e3, 2),
        f"decode_b{b}_step_ms": round(step_s * 1e3, 2),
        f"decode_{b}_vs_roofline": round(floor_s / step_s, 3),
        "matmul_gflops": round(flop_rate / 1e9, 1),
        "matmul_gflops_range": [round(min(flop_rates) / 1e9), round(max(flop_rates) / 1e9)],
        f"decode_b{b}_compute_floor_ms": round(compute_s * 1e3, 2),
        f"decode_{b}_vs_roofline_and_compute": round(max(floor_s, compute_s) / step_s, 3),
        "prefill_forward_vs_transformers_forward": round(
            res["prefill_tok_s"] / res["hf_prefill_tok_s"], 3
        ),
        "decode_b1_steps_vs_transformers_generate": round(
            res["decode_b1_tok_s"] / res["hf_decode_b1_tok_s"], 3
        ),
        f"decode_b{b}_steps_vs_transformers_generate": round(
            res[f"decode_b{b}_tok_s"] / res[f"hf_decode_b{b}_tok_s"], 3
        ),
        f"decode_b{b}_vs_b1": round(res[f"decode_b{b}_tok_s"] / res["decode_b1_tok_s"], 3),
    }
    print(
        f"decode at batch {b}: step {step_s * 1e3:.1f} ms against a floor of "
        f"{floor_s * 1e3:.1f} ms ({weights / 2**20:.0f} MiB of weights + {kv / 2**20:.0f} MiB "
        f"of KV at {bw / 1e9:.1f} GB/s read): {floor_s / step_s:.2f} of the roofline; its "
        f"FLOPs at this run's {flop_rate / 1e9:.0f} GFLOP/s matmul rate take {compute_s * 1e3:.1f}"
        f" ms: {max(floor_s, compute_s) / step_s:.2f} of the higher floor",
        flush=True,
    )
    if args.plot:
        plot(summary, b, Path(args.plot))
        print(f"plot: {args.plot}")
    print(json.dumps(summary))


def plot(s: dict, b: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    groups = [
        ("prefill 512", "prefill"),
        ("decode b1", "decode_b1"),
        (f"decode b{b}", f"decode_b{b}"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, (title, key) in zip(axes, groups):
        names = [f"transformers {s['dtype']}", f"halfmoon {s['dtype']}"]
        vals = [s[f"hf_{key}_tok_s"], s[f"{key}_tok_s"]]
        ax.bar(names, vals, color=["#999999", "#3b6ea5"])
        ax.set_title(title)
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"SmolLM2-135M on CPU, {s['threads']} threads (load avg {s['load_average_end']})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
