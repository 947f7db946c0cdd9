r"""What KIVI's lossy KV cache costs in quality on SmolLM2-135M: perplexity and greedy agreement.

KIVI (Liu et al., ICML 2024) as the paper and its reference code define it: keys quantized per
channel with groups of G tokens, values per token with groups of G channels, asymmetric, 2 or 4
bits; the most recent R tokens (R a multiple of G, or 0) stay in full precision. Keys leave that
window a whole group at a time (once R + G keys are held in full precision, the oldest G are
quantized); values leave one token at a time. The quantizers are the project's own
(`kernels.kivi_quantize` then `kernels.kivi_dequantize`: fake quantization, same numbers as the
packed store format).

Reference: a 16-bit KV cache (every K/V rounded through bfloat16) with fp32 weights and compute
(fp32 compute is fast on this AVX2 CPU, bf16 compute is emulated). The KIVI runs use the same fp32
compute, so every ratio is KIVI against that 16-bit cache; the fp32-KV perplexity is printed for
information only.

How the cache is built: each window of the text runs through the model's chunked `prefill`
(`--chunk` tokens at a time, 16 by default) over a KVPool that holds one sequence. The pool is
float64, so it holds bf16 and dequantized fp32 values exactly (and so the model always attends
through the pool, never to its fresh K/V); `on_layer_done` rounds each new chunk's K/V to bf16
before the chunk attends to it. After each chunk, the K/V of the positions that have left the
full-precision window is rewritten in place by its quantize->dequantize round trip (keys in whole
G-token groups, values per token), each position once, from its bf16 value. The next chunk's tokens
then attend to exactly the cache decode would hold at that chunk's start.
Chunk-granularity approximation: the quantization that falls due during a chunk happens at its
end, so the j-th token of a chunk (j = 0 .. chunk-1) sees the cache of the chunk's start plus the
chunk's earlier tokens at 16 bits: the values of up to j more tokens, and the keys of at most one
more group, are at 16 bits than decode would hold (the window is in effect R + j). The first token
of each chunk sees exactly decode's cache (its own K/V at 16 bits, as decode appends it to the
window before attending).
The 16-bit and fp32 caches do not depend on the chunking (nothing is rewritten after the fact), so
they run in `--ref-chunk` tokens at a time, which is faster and gives the same numbers up to fp32
summation order.

Measured, over `--windows` consecutive non-overlapping windows of `--window-tokens` tokens of the
text (`--text`, Pride and Prejudice by default): perplexity of each setting and its ratio to the
16-bit cache's; the share of positions whose argmax matches the 16-bit run's (teacher forced); a
sweep of R for each bit width (`--residual-sweep`, `--sweep-bits`) and the smallest R at which the
ratio is <= 1.05; greedy continuations (`--greedy-tokens` tokens after `--greedy-prompts` prompts of
`--greedy-prompt-tokens` tokens from the text, every setting decoding its own continuation, one
token at a time by the same simulation), compared with the 16-bit cache's: the share of tokens
before the first divergence, and the share of positions that agree overall.

Bytes per token against fp16: the store's packed KIVI block (`kernels.kivi_packed_nbytes` of a
16-token block at the model's shape, float16 scales and zero points included; a 16-token block
groups its keys over its 16 tokens when G > 16) for the tokens outside the window, plus the R
full-precision tokens (2 bytes a number) amortised over a window of `--window-tokens` tokens.

Prints progress, a table, writes a PNG (ppl ratio against R, and against bytes per token) and ends
with one JSON line.

    .venv/bin/python bench/kv_quality.py [--windows 16] [--window-tokens 2048] [--bits 4,2] \
        [--group-size 32] [--residual 32] [--residual-sweep 32,64,128,256] [--greedy-tokens 32] \
        [--plot runs/bench/kv_quality.png]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from bench.kivi_sim import (  # noqa: E402
    BF16,
    FP32,
    STORE_BLOCK,
    KVSetting,
    SeqRun,
    SimCache,
    keys_due,
    kivi_setting,
    run_sequence,
    values_due,
)
from bench.machine import cpu_flags, finish  # noqa: E402
from model import ModelConfig  # noqa: E402

# The simulated cache's names stay importable from here (tests/test_kv_quality.py and
# bench/cachegen_codec.py import them from this module).
__all__ = [
    "BF16",
    "DEFAULT_TEXT",
    "FP32",
    "RATIO_TARGET",
    "STORE_BLOCK",
    "KVSetting",
    "SeqRun",
    "SimCache",
    "Tally",
    "greedy_agreement",
    "int_list",
    "keys_due",
    "kivi_bytes_vs_fp16",
    "kivi_setting",
    "main",
    "run_sequence",
    "say",
    "values_due",
]

DEFAULT_TEXT = ROOT / "bench" / "data" / "pride_and_prejudice.txt"
RATIO_TARGET = 1.05


def say(*a) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------- sizes, agreement, machine


def kivi_bytes_vs_fp16(
    config: ModelConfig, bits: int, group: int, residual: int, window: int
) -> float:
    """Bytes per token of a KIVI cache (store blocks + R fp16 tokens over `window`) / fp16's."""
    h, d = config.num_kv_heads, config.head_dim
    fp16 = 2 * h * d * 2
    packed = kernels.kivi_packed_nbytes(STORE_BLOCK, h, d, bits, group) / STORE_BLOCK
    r = min(residual, window)
    return ((window - r) * packed + r * fp16) / (window * fp16)


def greedy_agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    """prefix: mean share of tokens before the first divergence; overall: share of equal
    positions."""
    prefix, equal, total = [], 0, 0
    for a, b in zip(ref, got):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(first / max(1, len(a)))
        equal += sum(x == y for x, y in zip(a, b))
        total += len(a)
    return {
        "prefix": round(sum(prefix) / max(1, len(prefix)), 4),
        "overall": round(equal / max(1, total), 4),
    }


def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


# ---------------------------------------------------------------- the benchmark


class Tally:
    """Running sums of one setting over the windows."""

    def __init__(self) -> None:
        self.nll, self.count, self.top1 = 0.0, 0, 0
        self.window_ppl: list[float] = []

    def add(self, run: SeqRun, ref_argmax: torch.Tensor | None) -> None:
        self.nll -= float(run.logprobs.sum())
        self.count += run.logprobs.numel()
        self.window_ppl.append(math.exp(-float(run.logprobs.mean())))
        if ref_argmax is not None:
            self.top1 += int((run.argmax == ref_argmax).sum())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window-tokens", type=int, default=2048)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--residual", type=int, default=32)
    ap.add_argument("--bits", default="4,2")
    ap.add_argument("--residual-sweep", default="32,64,128,256", help="'' for none")
    ap.add_argument("--sweep-bits", default=None, help="bit widths swept over R (default: --bits)")
    ap.add_argument("--chunk", type=int, default=16, help="prefill chunk of the KIVI runs")
    ap.add_argument(
        "--ref-chunk", type=int, default=256, help="prefill chunk of the 16-bit and fp32 runs"
    )
    ap.add_argument("--greedy-prompts", type=int, default=4)
    ap.add_argument("--greedy-prompt-tokens", type=int, default=512)
    ap.add_argument("--greedy-tokens", type=int, default=32, help="0 skips the greedy runs")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--plot", default="runs/bench/kv_quality.png", help="'' for none")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    bits_list = int_list(args.bits)
    sweep_bits = int_list(args.sweep_bits) if args.sweep_bits is not None else bits_list
    sweep_r = int_list(args.residual_sweep)
    g, r0, wt = args.group_size, args.residual, args.window_tokens
    for b in set(bits_list) | set(sweep_bits):
        if b not in (2, 4, 8):
            raise SystemExit(f"--bits: KIVI has 2, 4 or 8 bits, not {b}")

    from model import load_model

    say(
        f"loading {args.model} (fp32 weights and compute); {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}, load average {load_start:.2f}, "
        f"cpu flags {cpu_flags()}"
    )
    lm = load_model(args.model, dtype="float32")
    model, config = lm.model, lm.config
    text = Path(args.text).read_text(encoding="utf-8")
    tokens = lm.tokenizer.encode(text, add_bos=False)
    if args.windows * wt > len(tokens):
        raise SystemExit(f"{args.windows} x {wt} tokens asked, the text has {len(tokens)}")
    if wt + args.greedy_tokens > config.max_position_embeddings:
        raise SystemExit(f"--window-tokens {wt} exceeds the model's context")

    settings = [BF16, FP32]  # the reference first: the others' top-1 agreement compares with it
    kivi: dict[tuple[int, int], KVSetting] = {}
    for b in bits_list:
        kivi[b, r0] = kivi_setting(b, g, r0)
    for b in sweep_bits:
        for r in sweep_r:
            kivi.setdefault((b, r), kivi_setting(b, g, r))
    settings += list(kivi.values())
    say(
        f"{len(tokens)} tokens of {Path(args.text).name}; {args.windows} windows x {wt} tokens; "
        f"G={g}, R={r0}, chunk {args.chunk} (16-bit/fp32: {args.ref_chunk}); settings: "
        + ", ".join(s.name for s in settings)
    )

    tally = {s.name: Tally() for s in settings}
    for w in range(args.windows):
        ids = tokens[w * wt : (w + 1) * wt]
        ref_argmax = None
        tw = time.perf_counter()
        for s in settings:
            t0 = time.perf_counter()
            run = run_sequence(model, ids, s, args.ref_chunk if s.chunk_free else args.chunk)
            tally[s.name].add(run, ref_argmax)
            if s is BF16:
                ref_argmax = run.argmax
            t = tally[s.name]
            say(
                f"window {w + 1}/{args.windows} {s.name:<12} ppl {t.window_ppl[-1]:8.3f}"
                f"  (all windows so far: {t.ppl:8.3f}, x{t.ppl / tally[BF16.name].ppl:.4f}"
                " of 16-bit)"
                f"  {time.perf_counter() - t0:6.1f} s"
            )
        done = time.perf_counter() - t_start
        say(
            f"window {w + 1}/{args.windows} done in {time.perf_counter() - tw:.0f} s; "
            f"elapsed {done:.0f} s, load average {os.getloadavg()[0]:.2f}"
        )

    ref_ppl = tally[BF16.name].ppl
    ratio = {s.name: tally[s.name].ppl / ref_ppl for s in settings}
    scored = tally[BF16.name].count
    top1 = {s.name: tally[s.name].top1 / scored for s in settings if s is not BF16}

    # Greedy continuations: every setting decodes its own, compared with the 16-bit cache's.
    greedy: dict[str, dict[str, float]] = {}
    greedy_settings = [FP32] + [kivi[b, r0] for b in bits_list]
    if args.greedy_tokens > 0 and args.greedy_prompts > 0:
        p = args.greedy_prompt_tokens
        n = args.greedy_prompts
        span = max(0, len(tokens) - p)
        starts = [i * span // max(1, n - 1) for i in range(n)] if n > 1 else [0]
        outs: dict[str, list[list[int]]] = {s.name: [] for s in [BF16] + greedy_settings}
        for i, st in enumerate(starts):
            prompt = tokens[st : st + p]
            t0 = time.perf_counter()
            for s in [BF16] + greedy_settings:
                chunk = args.ref_chunk if s.chunk_free else args.chunk
                run = run_sequence(model, prompt, s, chunk, generate=args.greedy_tokens)
                outs[s.name].append(run.generated)
            agree = {
                s.name: greedy_agreement(outs[BF16.name][-1:], outs[s.name][-1:])["prefix"]
                for s in greedy_settings
            }
            say(
                f"greedy {i + 1}/{n}: prompt at token {st}, {args.greedy_tokens} tokens; "
                f"agreeing prefix {agree}  {time.perf_counter() - t0:.0f} s"
            )
        greedy = {s.name: greedy_agreement(outs[BF16.name], outs[s.name]) for s in greedy_settings}

    # The table.
    say("")
    say(
        f"{'setting':<14}{'bits':>5}{'G':>4}{'R':>5}{'ppl':>10}{'vs 16-bit':>11}"
        f"{'top-1 = 16-bit':>16}{'bytes vs fp16':>15}"
    )
    for s in settings:
        size = (
            kivi_bytes_vs_fp16(config, s.bits, s.group, s.residual, wt)
            if s.bits
            else (2.0 if not s.bf16 else 1.0)
        )
        say(
            f"{s.name:<14}{s.bits or (32 if not s.bf16 else 16):>5}"
            f"{s.group if s.bits else '-':>4}{s.residual if s.bits else '-':>5}"
            f"{tally[s.name].ppl:>10.3f}{ratio[s.name]:>11.4f}"
            f"{top1.get(s.name, 1.0):>16.4f}{size:>15.3f}"
        )
    if greedy:
        say("")
        say(f"greedy agreement with the 16-bit cache ({args.greedy_tokens} tokens, {n} prompts)")
        for name, a in greedy.items():
            say(f"  {name:<14} prefix {a['prefix']:.3f}  overall {a['overall']:.3f}")

    sweep: dict[str, dict[str, float]] = {}
    r_at: dict[int, int | None] = {}
    for b in sorted(set(bits_list) | set(sweep_bits), reverse=True):
        rs = sorted(r for (bb, r) in kivi if bb == b)
        sweep[f"kivi{b}"] = {str(r): round(ratio[kivi[b, r].name], 5) for r in rs}
        r_at[b] = next((r for r in rs if ratio[kivi[b, r].name] <= RATIO_TARGET), None)

    result: dict = {"bench": "kv_quality", "model": args.model}
    for b in bits_list:
        name = kivi[b, r0].name
        result[f"kivi{b}_ppl_vs_fp"] = round(ratio[name], 5)
    for b in sorted(r_at, reverse=True):
        result[f"kivi{b}_r_at_1_05"] = r_at[b]
    for b in bits_list:
        result[f"kivi{b}_bytes_vs_fp16"] = round(kivi_bytes_vs_fp16(config, b, g, r0, wt), 4)
    for b in bits_list:
        result[f"kivi{b}_top1_vs_fp"] = round(top1[kivi[b, r0].name], 5)
    result.update(
        {
            "reference": "bf16 KV cache, fp32 weights and compute",
            "ppl_bf16_kv": round(ref_ppl, 4),
            "ppl_fp32_kv": round(tally[FP32.name].ppl, 4),
            "fp32_kv_ppl_vs_fp": round(ratio[FP32.name], 6),
            **{f"ppl_{s.name}": round(tally[s.name].ppl, 4) for s in kivi.values()},
            "residual_sweep": sweep,
            "greedy_agreement": greedy,
            "greedy": {
                "prompts": args.greedy_prompts if greedy else 0,
                "prompt_tokens": args.greedy_prompt_tokens,
                "new_tokens": args.greedy_tokens,
            },
            "group_size": g,
            "residual": r0,
            "bits": bits_list,
            "windows": args.windows,
            "window_tokens": wt,
            "tokens_scored": scored,
            "chunk": args.chunk,
            "ref_chunk": args.ref_chunk,
            "bytes_block_tokens": STORE_BLOCK,
            "text": os.path.relpath(args.text, ROOT),
            "torch_threads": torch.get_num_threads(),
            "wall_s": round(time.perf_counter() - t_start, 1),
        }
    )
    draw = (lambda: plot(result, kivi, ratio, config, ROOT / args.plot)) if args.plot else None
    return finish(result, load_start, draw, args.plot)


def plot(result: dict, kivi: dict, ratio: dict, config: ModelConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    wt = result["window_tokens"]
    for bits, color in ((8, "tab:green"), (4, "tab:blue"), (2, "tab:red")):
        rs = sorted(r for (bb, r) in kivi if bb == bits)
        if not rs:
            continue
        ys = [ratio[kivi[bits, r].name] for r in rs]
        xs = [kivi_bytes_vs_fp16(config, bits, result["group_size"], r, wt) for r in rs]
        a.plot(rs, ys, "o-", color=color, label=f"kivi{bits}")
        b.plot(xs, ys, "o-", color=color, label=f"kivi{bits}")
        for x, y, r in zip(xs, ys, rs):
            b.annotate(f"R={r}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for ax in (a, b):
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(RATIO_TARGET, color="grey", lw=0.8, ls="--")
        ax.set_ylabel("perplexity / 16-bit cache's")
        ax.legend()
    rs_all = sorted({r for (_, r) in kivi})
    if rs_all and rs_all[0] > 0:
        a.set_xscale("log", base=2)
    a.set_xticks(rs_all, [str(r) for r in rs_all])
    a.set_xlabel("R: most recent tokens kept at 16 bits")
    b.set_xlabel(f"bytes per token / fp16's (window {wt})")
    fig.suptitle(
        f"KIVI on {result['model']}: {result['windows']} x {wt} tokens, G={result['group_size']}, "
        f"16-bit ppl {result['ppl_bf16_kv']:.2f}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
