r"""Model speed on SmolLM2: prefill and decode tokens/s beside transformers' `generate`.

Prefill tokens/s of a 512-token prompt and decode tokens/s at batch 1 and 16, fp32 and bf16, beside
transformers' `generate` on the same GGUF weights measured in the same run. Last line: one JSON
object.

Decode tokens/s counts the tokens after each sequence's first one over the time from the first to
the last step (our engine's own timing; a streamer's timestamps for transformers), so the prompt's
prefill does not count.

    .venv/bin/python bench/model_speed.py [--threads N] [--new-tokens 33] \
        [--plot runs/bench/model_speed.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import Engine, SamplingParams, load_model  # noqa: E402
from model.fetch import fetch_smollm2  # noqa: E402


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
    """A run -> prefill tokens/s of transformers' generate for one new token."""
    ids = torch.tensor(prompts(1, length, vocab))

    def run() -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
        return length / (time.perf_counter() - t)

    run()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt length before decode")
    ap.add_argument(
        "--new-tokens", type=int, default=33, help="new tokens per sequence in the decode runs"
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per workload (best of)")
    ap.add_argument("--plot", default="runs/bench/model_speed.png")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    path = fetch_smollm2(quiet=True)
    print(
        f"threads={torch.get_num_threads()} load average at start={os.getloadavg()[0]:.2f}",
        flush=True,
    )
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    vocab = hf.config.vocab_size
    ours = {
        "fp32": load_model("smollm2-135m"),
        "bf16": load_model("smollm2-135m", dtype="bfloat16"),
    }
    b = args.batch
    res: dict[str, float] = {}
    # Each workload runs the three systems in turn, `repeats` rounds, best of each: on a shared
    # machine the load drifts, and interleaving spreads it evenly over the systems compared.
    workloads = [
        (
            "prefill",
            lambda m: prefill_theirs(m, args.prefill_len, vocab),
            lambda m: prefill_ours(m, args.prefill_len),
        ),
        (
            "decode_b1",
            lambda m: decode_theirs(m, 1, args.prompt_len, args.new_tokens, vocab),
            lambda m: decode_ours(m, 1, args.prompt_len, args.new_tokens),
        ),
        (
            f"decode_b{b}",
            lambda m: decode_theirs(m, b, args.prompt_len, args.new_tokens, vocab),
            lambda m: decode_ours(m, b, args.prompt_len, args.new_tokens),
        ),
    ]
    for work, make_theirs, make_ours in workloads:
        t0 = time.perf_counter()
        runs = {
            f"hf_{work}_fp32": make_theirs(hf),
            f"{work}_fp32": make_ours(ours["fp32"]),
            f"{work}_bf16": make_ours(ours["bf16"]),
        }
        best = {k: 0.0 for k in runs}
        for r in range(args.repeats):
            print(f"{work}: round {r + 1}/{args.repeats}", flush=True)
            for k, run in runs.items():
                best[k] = max(best[k], run())
        for k, v in best.items():
            res[k] = round(v, 2)
            print(f"  {k:<24} {v:>9.1f} tok/s", flush=True)
        print(f"{work}: {time.perf_counter() - t0:.0f} s", flush=True)

    summary = {
        "bench": "model_speed",
        "model": "smollm2-135m",
        "threads": torch.get_num_threads(),
        "load_average_end": round(os.getloadavg()[0], 2),
        **res,
        "decode_b1_vs_transformers": round(res["decode_b1_fp32"] / res["hf_decode_b1_fp32"], 3),
        f"decode_b{b}_vs_transformers": round(
            res[f"decode_b{b}_fp32"] / res[f"hf_decode_b{b}_fp32"], 3
        ),
        "prefill_vs_transformers": round(res["prefill_fp32"] / res["hf_prefill_fp32"], 3),
        f"decode_b{b}_vs_b1": round(res[f"decode_b{b}_fp32"] / res["decode_b1_fp32"], 3),
        f"decode_b{b}_vs_b1_bf16": round(res[f"decode_b{b}_bf16"] / res["decode_b1_bf16"], 3),
        "decode_b1_bf16_vs_transformers_fp32": round(
            res["decode_b1_bf16"] / res["hf_decode_b1_fp32"], 3
        ),
    }
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
        names = ["transformers fp32", "halfmoon fp32", "halfmoon bf16"]
        vals = [s[f"hf_{key}_fp32"], s[f"{key}_fp32"], s[f"{key}_bf16"]]
        ax.bar(names, vals, color=["#999999", "#3b6ea5", "#e0a030"])
        ax.set_title(title)
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"SmolLM2-135M on CPU, {s['threads']} threads (load avg {s['load_average_end']})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
