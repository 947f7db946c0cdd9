"""Decode streams' time between tokens while long prompts prefill on the same CPUs: a prefill
forward that hands its turn at the CPUs to the waiting decode steps between layers
(prefill.cpu_turn_slice_ms, servekit.CpuTurns.share) against one that keeps it to the end (0), in
one run, on the same prompts, through a local cluster of processes (bench/e2e.py's).

The workload, each round: --streams short prompts generate --new-tokens each; once every stream
has its first token, --cold prompts of --prompt-tokens never seen before are sent one after
another (one new token each, --pause-s apart). Figures: the gaps between consecutive tokens of the
streams (as the client receives them) that overlap a cold prompt's prefill, against the gaps
outside them; the cold prompts' TTFT; the tokens the streams got per second. Medians over
--repeats rounds. The last line printed is one JSON object, with the CPU's flags and the load.

    .venv/bin/python bench/tbt_prefill.py [--streams 8 --cold 3 --prompt-tokens 1024]
        [--slice-ms 50] [--chunk-size 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.e2e import process_cluster  # noqa: E402
from bench.machine import finish  # noqa: E402
from client import percentiles  # noqa: E402


def say(*a) -> None:
    print(*a, flush=True)


def stream(stub, ids: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(the time sent, each token's arrival time) of one streamed request, on this clock."""
    from protos import halfmoon_pb2 as pb

    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    req.token_ids.ids.extend(ids)
    sent, times = time.perf_counter(), []
    for msg in stub.Generate(req, timeout=600):
        now = time.perf_counter()
        times.extend([now] * len(msg.token_ids))
    return sent, times


def one_round(stub, args, rng: random.Random, vocab: int) -> dict:
    """One round's gaps (during and outside the cold prefills, ms), cold TTFTs and stream rate."""
    rand = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    results: list[tuple[float, list[float]]] = []
    lock = threading.Lock()

    def run(ids):
        r = stream(stub, ids, args.new_tokens)
        with lock:
            results.append(r)

    ths = [threading.Thread(target=run, args=(rand(32),)) for _ in range(args.streams)]
    for t in ths:
        t.start()
    # the streams decode before the first cold prompt arrives: wait out their prefills
    time.sleep(args.pause_s + 0.05 * args.streams)
    windows, ttfts = [], []
    for _ in range(args.cold):
        sent, times = stream(stub, rand(args.prompt_tokens), 1)
        windows.append((sent, times[0]))
        ttfts.append((times[0] - sent) * 1000.0)
        time.sleep(args.pause_s)
    for t in ths:
        t.join()
    during, outside = [], []
    w0, w1 = windows[0][0], windows[-1][1]
    tokens_in_window = 0
    for _, times in results:
        for a, b in zip(times, times[1:]):
            overlaps = any(a < e and b > s for s, e in windows)
            (during if overlaps else outside).append((b - a) * 1000.0)
        tokens_in_window += sum(1 for t in times if w0 <= t <= w1)
    if not during:
        raise RuntimeError("the streams ended before the cold prompts: raise --new-tokens")
    return {
        "during": during,
        "outside": outside,
        "ttfts": ttfts,
        "tok_s": tokens_in_window / (w1 - w0),
        "window_s": w1 - w0,
        "first_stream_start": min(s for s, _ in results),
        "streams": results,
        "windows": windows,
    }


def run_setting(lm, args, slice_ms: float) -> dict:
    """Every round of one setting on a fresh cluster; figures are medians over the rounds."""
    import grpc

    from protos import halfmoon_pb2_grpc as pb_grpc

    overrides = {"cpu_turn_slice_ms": slice_ms, "chunk_size": args.chunk_size}
    cluster = process_cluster(
        lm.name, args.dtype, lm.fingerprint, args.threads, True, ("", ""), 1, overrides
    )
    try:
        stub = pb_grpc.ConductorStub(grpc.insecure_channel(cluster.address))
        rng = random.Random(0)  # the same prompts for both settings
        vocab = lm.config.vocab_size
        for n in (64, args.prompt_tokens):  # warm-up: first forwards, timing models
            stream(stub, [rng.randrange(100, vocab - 100) for _ in range(n)], 4)
        rounds = []
        for r in range(args.repeats):
            rounds.append(one_round(stub, args, rng, vocab))
            x = rounds[-1]
            say(
                f"  slice {slice_ms:g} ms, round {r + 1}/{args.repeats}: gaps during prefill "
                f"p50 {percentiles(x['during']).p50:.0f} p99 {percentiles(x['during']).p99:.0f} "
                f"max {max(x['during']):.0f} ms (outside p50 "
                f"{percentiles(x['outside']).p50:.0f}); cold TTFT "
                f"{statistics.median(x['ttfts']):.0f} ms; streams {x['tok_s']:.0f} tok/s"
            )
    finally:
        cluster.stop()
    med = lambda f: statistics.median(f(x) for x in rounds)  # noqa: E731
    return {
        "tbt_during_prefill_p50_ms": med(lambda x: percentiles(x["during"]).p50),
        "tbt_during_prefill_p99_ms": med(lambda x: percentiles(x["during"]).p99),
        "tbt_during_prefill_max_ms": med(lambda x: max(x["during"])),
        "tbt_outside_p50_ms": med(lambda x: percentiles(x["outside"]).p50),
        "ttft_cold_ms": med(lambda x: statistics.median(x["ttfts"])),
        "stream_tok_s_during": med(lambda x: x["tok_s"]),
        "_last_round": rounds[-1],
    }


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), sharex=True, sharey=True)
    for ax, (label, res) in zip(axes, runs.items()):
        x = res["_last_round"]
        t0 = x["first_stream_start"]
        for s, e in x["windows"]:
            ax.axvspan(s - t0, e - t0, color="tab:orange", alpha=0.25)
        for _, times in x["streams"]:
            ax.plot(
                [b - t0 for b in times[1:]],
                [(b - a) * 1000.0 for a, b in zip(times, times[1:])],
                ".",
                ms=2,
                color="tab:blue",
            )
        ax.set_yscale("log")
        ax.set_ylabel("gap between tokens (ms)")
        ax.set_title(f"{label}: cold prompts' prefills shaded (last round)")
    axes[-1].set_xlabel("seconds from the first stream's start")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: default)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=400, help="tokens each stream generates")
    ap.add_argument("--cold", type=int, default=3, help="cold prompts a round")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--pause-s", type=float, default=0.4, help="between the cold prompts")
    ap.add_argument("--slice-ms", type=float, default=50.0, help="the setting set against 0")
    ap.add_argument("--chunk-size", type=int, default=512, help="prefill.chunk_size (its default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plot", default="runs/bench/tbt_prefill.png")
    args = ap.parse_args(argv)
    import os

    from model import load_model
    from servekit.machine import native_dtype

    load0 = os.getloadavg()[0]
    if args.dtype == "auto":
        args.dtype = native_dtype()
    lm = load_model(args.model, dtype=args.dtype)
    runs = {}
    for label, slice_ms in (("shared", args.slice_ms), ("kept", 0.0)):
        say(f"{label}: prefill.cpu_turn_slice_ms = {slice_ms:g} (a fresh cluster)")
        runs[label] = run_setting(lm, args, slice_ms)
    a, b = runs["shared"], runs["kept"]
    result = {
        "bench": "tbt_prefill",
        "model": args.model,
        "dtype": args.dtype,
        "streams": args.streams,
        "cold_prompts": args.cold,
        "prompt_tokens": args.prompt_tokens,
        "chunk_size": args.chunk_size,
        "slice_ms": args.slice_ms,
        "repeats": args.repeats,
        **{f"{k}_shared": round(v, 1) for k, v in a.items() if not k.startswith("_")},
        **{f"{k}_kept": round(v, 1) for k, v in b.items() if not k.startswith("_")},
        "tbt_max_shared_vs_kept": round(
            a["tbt_during_prefill_max_ms"] / b["tbt_during_prefill_max_ms"], 3
        ),
        "tbt_p99_shared_vs_kept": round(
            a["tbt_during_prefill_p99_ms"] / b["tbt_during_prefill_p99_ms"], 3
        ),
        "ttft_cold_shared_vs_kept": round(a["ttft_cold_ms"] / b["ttft_cold_ms"], 3),
    }
    say(
        f"during the prefills, the longest gap between a stream's tokens: "
        f"{a['tbt_during_prefill_max_ms']:.0f} ms handing turns over against "
        f"{b['tbt_during_prefill_max_ms']:.0f} ms keeping them "
        f"({result['tbt_max_shared_vs_kept']}x); p99 {result['tbt_p99_shared_vs_kept']}x; "
        f"cold TTFT {a['ttft_cold_ms']:.0f} against {b['ttft_cold_ms']:.0f} ms "
        f"({result['ttft_cold_shared_vs_kept']}x)"
    )
    png = Path(args.plot)
    return finish(result, load0, (lambda: plot(runs, png)) if args.plot else None, str(png))


if __name__ == "__main__":
    sys.exit(main())
