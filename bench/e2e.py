"""End-to-end benchmark on SmolLM2 through a local cluster (1 prefill + 1 decode worker, store,
conductor).

Two workloads, each beside vLLM's CPU build on the same workload and dtype when it is installed:
- TTFT of a 1024-token prompt cold, and with its first 960 tokens already cached;
- decode throughput (generated tokens per second, end to end) of 16 concurrent requests versus 1.
Every figure is a median of --repeats runs (3 prompts for each TTFT), taken the same way for both
systems; halfmoon runs once before vLLM and once after it, and its figures are the medians over
both runs (each run's own medians are in the JSON as `<figure>_runs`), so that a drift of the
shared machine weighs on both systems alike. halfmoon's KV memory (the store's DRAM slab and both
workers' pools together) is the KV space vLLM is given (--kv-gib, VLLM_CPU_KVCACHE_SPACE), split
as the config's `auto` splits it. The dtype is the machine's fastest (`auto`: bf16 with
avx512_bf16, else fp32), the same for both. Each halfmoon server's resident memory: its peak RSS
(the kernel's high-water mark), and its peak PSS (shared pages split among their mappers, so the
store's slab, which the workers map too, counts once; sampled between workloads, never during one)
with its page tables, against what it was configured to hold (weights, pools, in-memory tiers):
the slab and the pools are written whole when they are made (MADV_POPULATE_WRITE, zeros), so
every configured byte is resident and counted, none is an untouched page.
The last line printed is one JSON object, with the CPU's flags, the load and the pinning used.

    .venv/bin/python bench/e2e.py [--dtype auto] [--repeats 3] [--vllm-python PATH]
        [--prefill-cpus 0-1 --decode-cpus 0-1] [--stream-interval 8] [--kv-gib 4]
        [--set store.dram_bytes=536870912 ...]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.server_memory import (  # noqa: E402
    MemorySampler,
    cluster_pids,
    configured_bytes,
    dram_used_bytes,
    kv_sizes,
)
from bench.vllm_peer import DEFAULT_VLLM, VLLM_KV_GIB, run_vllm  # noqa: E402

PROMPT_TOKENS, CACHED_TOKENS, NEW_TOKENS, CONCURRENCY = 1024, 960, 64, 16


def say(*a) -> None:
    print(*a, flush=True)


def token_prompts(vocab: int, seed: int) -> dict:
    """The workloads' token ids: shared by our run and vLLM's, so both see the same prompts."""
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731 - ordinary tokens
    base = rand(PROMPT_TOKENS)
    return {
        "cold": [rand(PROMPT_TOKENS) for _ in range(3)],  # never seen before
        "seed": base,  # served once, so its blocks are cached
        "warm": [base[:CACHED_TOKENS] + rand(PROMPT_TOKENS - CACHED_TOKENS) for _ in range(3)],
        "decode": [rand(rng.randrange(20, 40)) for _ in range(CONCURRENCY + 1)],
        "warmup": rand(256),
    }


# ---------------------------------------------------------------- halfmoon


def process_cluster(
    model: str,
    dtype: str,
    fingerprint: str,
    threads: int,
    device_cache: bool,
    cpus: tuple,
    stream_interval: int = 1,
    prefill_overrides: dict | None = None,
    kv_bytes: int = 0,
    overrides: tuple[str, ...] = (),
):
    """Store node, prefill worker, decode worker and conductor, each in its own process, as a
    deployment runs them (one interpreter each, no shared GIL), with an embedded Redis index:
    deploy.LocalCluster, wired as the Ray launcher wires a cluster. `prefill_overrides`: fields
    of the prefill worker's config set over this benchmark's; `kv_bytes`: the slab's and the
    pools' bytes together, split as `auto` splits them (0: a 512 MiB slab and 512-block pools,
    the sizes of the benchmarks' earlier runs); `overrides`: `--set` values over all of it."""
    from deploy import LocalCluster, cluster_config_from_dict
    from servekit import merge_config, parse_overrides

    workers = {"num_blocks": 512, "torch_threads": threads}
    prefill_cpus, decode_cpus = cpus
    data = {
        "model": model,
        "dtype": dtype,
        "store": {"dram_bytes": 512 << 20, "model_fingerprint": fingerprint},
        "prefill": {
            **workers,
            # vLLM's CPU build takes up to 4,096 tokens a step (max_num_batched_tokens, its
            # LLM class's default), so it prefills each 1,024-token prompt in one forward:
            # the same here (512 cost ~35 ms of a cold TTFT on a 2-core AMX Xeon)
            "chunk_size": 4096,
            "device_cache": device_cache,
            "cpus": prefill_cpus,
            **(prefill_overrides or {}),
        },
        "decode": {
            **workers,
            "max_batch": 32,
            "cpus": decode_cpus,
            "stream_interval": stream_interval,
        },
        "conductor": {"load_poll_s": 0.05},
    }
    if kv_bytes:
        data = merge_config(data, kv_sizes(cluster_config_from_dict(data), kv_bytes))
    cfg = cluster_config_from_dict(merge_config(data, parse_overrides(list(overrides))))
    cluster = LocalCluster(cfg, processes=True)
    cluster.start()
    return cluster


def run_halfmoon(
    lm,
    prompts: dict,
    dtype: str,
    threads: int,
    device_cache: bool,
    cpus: tuple,
    repeats: int,
    stream_interval: int,
    kv_bytes: int = 0,
    overrides: tuple[str, ...] = (),
) -> tuple[dict, dict]:
    """(figures, each figure's measurements) of one halfmoon run, for merge_runs."""
    import grpc

    from protos import halfmoon_pb2 as pb
    from protos import halfmoon_pb2_grpc as pb_grpc

    def one(stub, ids, max_tokens):
        """(client-side TTFT ms, tokens, wall s, usage) of one streamed request."""
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        req.token_ids.ids.extend(ids)
        t0 = time.perf_counter()
        first, n, last = None, 0, None
        for msg in stub.Generate(req, timeout=600):
            if msg.token_ids and first is None:
                first = (time.perf_counter() - t0) * 1000.0
            n += len(msg.token_ids)
            last = msg
        return first, n, time.perf_counter() - t0, last.usage

    out: dict = {}
    samples: dict[str, list[float]] = {}  # each figure's measurements, for merge_runs
    say("halfmoon: starting the store node, the workers and the conductor (one process each)")
    cluster = process_cluster(
        lm.name, dtype, lm.fingerprint, threads, device_cache, cpus, stream_interval,
        kv_bytes=kv_bytes, overrides=overrides,
    )  # fmt: skip
    out["dram_mb"] = round(cluster.cfg.store.dram_bytes / 2**20, 1)
    out["num_blocks"] = {r: getattr(cluster.cfg, r).num_blocks for r in ("prefill", "decode")}
    sampler = MemorySampler(cluster_pids(cluster))
    try:
        sampler.sample()
        channel = grpc.insecure_channel(cluster.address)
        stub = pb_grpc.ConductorStub(channel)
        say("halfmoon: warming up (first forward passes, timing models)")
        for ids in prompts["decode"][:2]:
            one(stub, ids, 4)
        one(stub, prompts["warmup"], 2)

        cold = []
        for ids in prompts["cold"]:
            ttft, *_, u = one(stub, ids, 1)
            cold.append(ttft)
            say(
                f"halfmoon: TTFT cold  {ttft:8.1f} ms  "
                f"(computed {u.computed_prompt_tokens}, cached {u.cached_tokens}; the prefill "
                f"answered at {u.prefill_answered_ms:.1f} ms: queue {u.queue_ms:.1f}, its round "
                f"{u.prefill_ms:.1f}; KV transfers {u.transfer_ms:.1f})"
            )
        sampler.sample()  # between workloads, never during one (see MemorySampler)
        one(stub, prompts["seed"], 1)
        warm = []
        for ids in prompts["warm"]:
            ttft, *_, u = one(stub, ids, 1)
            warm.append(ttft)
            say(
                f"halfmoon: TTFT warm  {ttft:8.1f} ms  "
                f"(computed {u.computed_prompt_tokens}, cached {u.cached_tokens}: "
                f"device {u.cached_device_tokens}, dram {u.cached_dram_tokens})"
            )
        out["ttft_cold_ms"] = statistics.median(cold)
        out["ttft_warm_ms"] = statistics.median(warm)
        samples["ttft_cold_ms"], samples["ttft_warm_ms"] = cold, warm
        out["warm_tier"] = "device" if u.cached_device_tokens else "dram"
        sampler.sample()

        rates = []
        for _ in range(repeats):
            _, n, wall, _ = one(stub, prompts["decode"][0], NEW_TOKENS)
            rates.append(n / wall)
        out["decode_1_tok_s"] = statistics.median(rates)
        samples["decode_1_tok_s"] = rates
        sampler.sample()
        say(f"halfmoon: 1 x {NEW_TOKENS} tokens: {out['decode_1_tok_s']:7.1f} tok/s (median)")

        rates, batches = [], []
        for _ in range(repeats):
            results: list = [None] * CONCURRENCY
            barrier = threading.Barrier(CONCURRENCY + 1)

            def worker_fn(i):
                barrier.wait()
                results[i] = one(stub, prompts["decode"][i + 1], NEW_TOKENS)

            ths = [threading.Thread(target=worker_fn, args=(i,)) for i in range(CONCURRENCY)]
            for t in ths:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            for t in ths:
                t.join()
            wall = time.perf_counter() - t0
            rates.append(sum(r[1] for r in results) / wall)
            sampler.sample()
            batches.append(max(r[3].max_decode_batch for r in results))
        out["decode_16_tok_s"] = statistics.median(rates)
        samples["decode_16_tok_s"] = rates
        out["decode_16_max_batch"] = max(batches)
        say(
            f"halfmoon: {CONCURRENCY} x {NEW_TOKENS} tokens: {out['decode_16_tok_s']:7.1f} tok/s "
            f"(median of {repeats}; largest decode batch {out['decode_16_max_batch']})"
        )
        sampler.sample()
        configured = configured_bytes(stub)
        # how much of the (resident) slab the workloads filled: the rest is room, not use
        out["dram_used_mb"] = round(dram_used_bytes(stub) / 2**20, 1)
        names = list(sampler.procs)
        for name in names:
            out[f"rss_peak_mb_{name}"] = round(sampler.rss[name] / 2**20, 1)
            out[f"pss_peak_mb_{name}"] = round(sampler.pss[name] / 2**20, 1)
            out[f"pte_peak_mb_{name}"] = round(sampler.pte[name] / 2**20, 1)
            out[f"configured_mb_{name}"] = round(configured.get(name, 0) / 2**20, 1)
        add_memory_totals(out)
        say(
            "halfmoon memory (peak RSS / peak PSS / configured, MiB): "
            + ", ".join(
                f"{n} {out[f'rss_peak_mb_{n}']:.0f}/{out[f'pss_peak_mb_{n}']:.0f}/"
                f"{out[f'configured_mb_{n}']:.0f}"
                for n in names
            )
            + f"; PSS over configured {out['rss_vs_configured']} "
            + f"({out['pss_beyond_configured_mb']:.0f} MiB beyond it)"
        )
        channel.close()
    finally:
        cluster.stop()
    return out, samples


def merge_runs(runs: list[tuple[dict, dict]]) -> dict:
    """One result of several halfmoon runs: each figure the median of every run's measurements,
    each server's memory its peak over the runs, and each run's own medians beside them."""
    out = dict(runs[-1][0])
    for key in runs[0][1]:
        out[key] = statistics.median(x for _, samples in runs for x in samples[key])
        out[f"{key}_runs"] = [round(r[key], 1) for r, _ in runs]
    for key in [k for k in out if k.startswith(("rss_peak_mb_", "pss_peak_mb_", "pte_peak_mb_"))]:
        out[key] = max(r[key] for r, _ in runs)
    add_memory_totals(out)
    return out


def add_memory_totals(out: dict) -> None:
    """`rss_vs_configured`: the processes' summed peak PSS (shared pages split among their
    mappers: the store's slab once) and page tables over what they are configured to hold
    (weights, pools, in-memory tiers); `pss_beyond_configured_mb`: the difference, in MiB. The
    ratio depends on the model's and the KV tiers' sizes (the runtime's memory is much the same
    for any), the difference does not. PSS counts a page only where some process maps it: an
    untouched page of a mapping counts nowhere, so a tier that was configured but never
    written would lower the ratio; the slab and the pools here are written whole at start."""
    pss = sum(v for k, v in out.items() if k.startswith(("pss_peak_mb_", "pte_peak_mb_")))
    configured = sum(v for k, v in out.items() if k.startswith("configured_mb_"))
    out["rss_vs_configured"] = round(pss / configured, 3) if configured else None
    out["pss_beyond_configured_mb"] = round(pss - configured, 1)


# ---------------------------------------------------------------- report


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    systems = [("halfmoon", "hm")] + ([("vLLM", "vllm")] if "vllm_ttft_cold_ms" in result else [])
    for i, (_label, key) in enumerate(systems):
        pre = "" if key == "hm" else "vllm_"
        a.bar(
            [i * 3, i * 3 + 1],
            [result[f"{pre}ttft_cold_ms"], result[f"{pre}ttft_warm_ms"]],
            color=["tab:gray", "tab:green"],
        )
        b.bar(
            [i * 3, i * 3 + 1],
            [result[f"{pre}decode_1_tok_s"], result[f"{pre}decode_16_tok_s"]],
            color=["tab:gray", "tab:blue"],
        )
    ticks = [t for i in range(len(systems)) for t in (i * 3, i * 3 + 1)]
    a.set_xticks(
        ticks,
        [
            f"{s}\ncold" if j == 0 else f"{s}\n{CACHED_TOKENS} cached"
            for s, _ in systems
            for j in (0, 1)
        ],
    )
    b.set_xticks(
        ticks,
        [
            f"{s}\n1 req" if j == 0 else f"{s}\n{CONCURRENCY} req"
            for s, _ in systems
            for j in (0, 1)
        ],
    )
    a.set_ylabel(f"TTFT of a {PROMPT_TOKENS}-token prompt (ms)")
    b.set_ylabel(f"generated tokens/s ({NEW_TOKENS} new tokens each)")
    fig.suptitle(f"halfmoon end to end, SmolLM2-135M, {result['dtype']}")
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
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="both systems' dtype (auto: bfloat16 where the CPU has avx512_bf16, else float32: "
        "bf16 is emulated, 5-7x slower, without it)",
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads per worker (0 = torch's default)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per decode figure (median)")
    ap.add_argument("--prefill-cpus", default="", help='the prefill worker\'s CPUs ("" = any)')
    ap.add_argument("--decode-cpus", default="", help='the decode worker\'s CPUs ("" = any)')
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON", DEFAULT_VLLM),
        help="python of a venv with vllm-cpu ('' = skip vLLM)",
    )
    ap.add_argument(
        "--no-device-cache",
        action="store_true",
        help="prefill worker keeps no blocks in its own pool: "
        "warm prefixes come from the store's DRAM tier",
    )
    ap.add_argument(
        "--stream-interval",
        type=int,
        default=8,
        help="tokens a decode stream sends at once (decode.stream_interval; vLLM's offline "
        "generate, the baseline, streams nothing back)",
    )
    ap.add_argument(
        "--kv-gib",
        type=float,
        default=VLLM_KV_GIB,
        help="halfmoon's KV memory, the store's DRAM slab and both pools together, split as the "
        "config's `auto` splits it (default: the KV space vLLM-CPU is given beside it, "
        "VLLM_CPU_KVCACHE_SPACE); 0 = a 512 MiB slab and 512-block pools, earlier runs' sizes",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a value of halfmoon's cluster config over this benchmark's (repeatable)",
    )
    ap.add_argument("--plot", default="runs/bench/e2e.png")
    args = ap.parse_args(argv)

    import torch

    from bench.machine import finish
    from model import load_model
    from servekit.machine import cpu_flags, native_dtype

    flags = cpu_flags()
    if args.dtype == "auto":
        args.dtype = native_dtype(flags)
    load_start = os.getloadavg()[0]
    say(
        f"loading {args.model} ({args.dtype}); {os.cpu_count()} CPUs, "
        f"load average {load_start:.1f}, flags {flags}"
    )
    lm = load_model(args.model, dtype=args.dtype)
    prompts = token_prompts(lm.config.vocab_size, seed=0)
    cpus = (args.prefill_cpus, args.decode_cpus)

    def halfmoon_run():
        return run_halfmoon(
            lm,
            prompts,
            args.dtype,
            args.threads,
            not args.no_device_cache,
            cpus,
            args.repeats,
            args.stream_interval,
            int(args.kv_gib * 2**30),
            tuple(args.set),
        )

    # halfmoon runs before vLLM and again after it, and each figure is the median over both:
    # this shared machine drifts by tens of percent over minutes, and so both systems' figures
    # are centred on the same moment
    runs = [halfmoon_run()]
    vllm, why = (
        run_vllm(args.vllm_python, lm, prompts, args.dtype, args.repeats, NEW_TOKENS)
        if args.vllm_python
        else (None, "skipped (--vllm-python '')")
    )
    if vllm is not None:
        say("halfmoon: the second run, after vLLM's")
        runs.append(halfmoon_run())
    ours = merge_runs(runs)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "torch_threads": args.threads or torch.get_num_threads(),
        "repeats": args.repeats,
        "halfmoon_runs": len(runs),
        "stream_interval": args.stream_interval,
        "kv_gib": args.kv_gib,
        "overrides": args.set,
        "pinning": {
            "halfmoon_prefill_cpus": args.prefill_cpus or "any",
            "halfmoon_decode_cpus": args.decode_cpus or "any",
            "vllm_omp_threads_bind": f"0-{os.cpu_count() - 1}",
        },
        "cpu_flags": flags,
        "load_average_start": round(load_start, 2),
        **ours,
    }
    result["ttft_warm_vs_cold"] = ours["ttft_warm_ms"] / ours["ttft_cold_ms"]
    result["decode_16_vs_1"] = ours["decode_16_tok_s"] / ours["decode_1_tok_s"]
    say(
        f"halfmoon: TTFT warm/cold = {result['ttft_warm_vs_cold']:.3f}   "
        f"decode 16/1 = {result['decode_16_vs_1']:.2f}"
    )

    if vllm is not None:
        result.update({f"vllm_{k}": v for k, v in vllm.items()})
        result["ttft_warm_vs_vllm"] = ours["ttft_warm_ms"] / vllm["ttft_warm_ms"]
        result["ttft_cold_vs_vllm"] = ours["ttft_cold_ms"] / vllm["ttft_cold_ms"]
        result["decode_16_vs_vllm"] = ours["decode_16_tok_s"] / vllm["decode_16_tok_s"]
        result["decode_1_vs_vllm"] = ours["decode_1_tok_s"] / vllm["decode_1_tok_s"]
        say(
            f"vllm: TTFT cold {vllm['ttft_cold_ms']:.1f} ms, warm {vllm['ttft_warm_ms']:.1f} ms; "
            f"decode 1: {vllm['decode_1_tok_s']:.1f} tok/s, 16: {vllm['decode_16_tok_s']:.1f} tok/s"
        )
        say(
            f"ratios: TTFT warm vs vLLM {result['ttft_warm_vs_vllm']:.2f}, "
            f"decode 16 vs vLLM {result['decode_16_vs_vllm']:.2f}"
        )
    else:
        result["vllm"] = why
        say(f"vllm: {why}")
    return finish(result, load_start, lambda: plot(result, ROOT / args.plot), args.plot)


if __name__ == "__main__":
    sys.exit(main())
