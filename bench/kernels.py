r"""Paged decode attention speed against this machine's copy bandwidth, and KIVI's bytes per token.

Workload: one decode step of 8 sequences x 4096 tokens at SmolLM2-135M's shape (9 query heads,
3 KV heads, head_dim 64, block 16) over a layer-major pool of 30 layers: 30 calls, one per layer,
each reading that layer's blocks in a random order (as a block allocator leaves them). Reported:
bytes of KV read per second, and the ratio to the memory bandwidth a copy reaches in the same run
(one large `dst.copy_(src)`, counted as read plus write: a copy moves its bytes twice; on a GPU, a
device-to-device copy). The dispatch's path runs (the fused C kernel on CPU, Triton on CUDA) beside
two baselines: the gather-then-einsum reference, and torch's `scaled_dot_product_attention` over
KV already gathered into contiguous per-sequence tensors (gather not timed: the cache layout of an
engine without paging). KIVI-4 packed attention (the fused kernel over 4-bit blocks) runs too.
So does causal prefill attention in bf16 (--prefill-tokens fresh tokens, SmolLM2's heads, one call
per layer): the dispatch's path (the vdpbf16ps kernel on CPUs with AVX-512 BF16) beside torch's
SDPA on the same tensors, with the arithmetic rate of each (QK^T and PV, causal half).
On CUDA the decode steps (the dispatch's, SDPA's, KIVI's) are timed replayed from a CUDA graph,
as the decode worker runs them: launched one by one from Python, 30 small kernels take longer to
launch than to run (the eager time is kept, `<dtype>_eager_step_ms`, and the reference's ratio
is eager against eager).
The last line printed is one JSON object, with the CPU's flags and the load.

    .venv/bin/python bench/kernels.py [--repeats 5] [--threads N] [--dtypes float32,bfloat16] \
        [--kivi] [--prefill-tokens 1024] [--plot PATH]
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from bench.machine import cpu_flags  # noqa: E402

BATCH, TOKENS, Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 8, 4096, 9, 3, 64, 30, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def timer(device: torch.device):
    """A function returning seconds taken by fn(), synchronised on CUDA."""

    def run(fn) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    return run


def replayed(step, device):
    """On CUDA, `step` (warmed up already) captured as a CUDA graph, and a function that replays
    it: the kernels' time without Python's launches, which on a GPU outlast small kernels (the
    decode worker replays its steps so: model/cuda_graphs.py). Elsewhere, step itself."""
    if device.type != "cuda":
        return step
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def copy_bandwidth(device, timed, repeats: int) -> float:
    """Bytes moved per second by one large tensor copy, read plus write (the median of
    `repeats`): a copy of n bytes reads n and writes n."""
    nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / statistics.median(timed(lambda: dst.copy_(src)) for _ in range(repeats))


def sdpa_step_seconds(pool, table, q, timed, repeats: int) -> float:
    """Median seconds of one decode step by torch's scaled_dot_product_attention over each
    layer's KV gathered beforehand into contiguous [batch, kv_heads, tokens, head_dim] tensors."""
    import torch.nn.functional as F

    layers = []
    for layer in range(LAYERS):
        kv = pool[table.long(), layer]  # [B, blocks, 2, BLOCK, H, D]
        k = kv[:, :, 0].reshape(BATCH, -1, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        v = kv[:, :, 1].reshape(BATCH, -1, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        layers.append((k, v))
    qs = q[:, :, None, :]  # [B, Hq, 1, D]

    def step():
        for k, v in layers:
            F.scaled_dot_product_attention(qs, k, v, enable_gqa=True)

    step()
    step = replayed(step, q.device)
    return statistics.median(timed(step) for _ in range(repeats))


def make_workload(device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    num_blocks = BATCH * TOKENS // BLOCK
    # allocated as the workers' pools are (kernels.KVLayout.empty_blocks: on huge pages on the CPU)
    pool = kernels.zeros_on_huge_pages(
        (num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM), dtype, device
    )
    pool.copy_(torch.randn(num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g))
    table = (
        torch.randperm(num_blocks, generator=g).view(BATCH, -1).to(device=device, dtype=torch.int32)
    )
    q = torch.randn(BATCH, Q_HEADS, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    lens = torch.full((BATCH,), TOKENS, dtype=torch.int32, device=device)
    kv_bytes = LAYERS * BATCH * TOKENS * 2 * KV_HEADS * HEAD_DIM * pool.element_size()
    return pool, table, q, lens, kv_bytes


def step_seconds(attend, pool, table, q, lens, timed, repeats: int, graph=False) -> float:
    """Median seconds of one decode step: one call per layer (with `graph`, replayed)."""

    def step():
        for layer in range(LAYERS):
            attend(q, pool[:, layer, 0], pool[:, layer, 1], table, lens)

    step()  # warm-up (Triton compiles here)
    if graph:
        step = replayed(step, q.device)
    return statistics.median(timed(step) for _ in range(repeats))


def kivi_sizes() -> dict:
    """Bytes per token (all 30 layers) for SmolLM2's shape, block of 16 tokens, group 32."""
    fp16 = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    out = {"fp16_bytes_per_token": fp16}
    for bits in (4, 2):
        per_token = LAYERS * kernels.kivi_packed_nbytes(BLOCK, KV_HEADS, HEAD_DIM, bits) / BLOCK
        out[f"kivi{bits}_bytes_per_token"] = per_token
        out[f"kivi{bits}_vs_fp16"] = round(fp16 / per_token, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    ap.add_argument(
        "--dtypes",
        default=None,
        help="comma list, the first the headline; default bfloat16,float32 on a CPU with "
        "avx512_bf16 (else float32,bfloat16), bfloat16,float16,float32 on CUDA",
    )
    ap.add_argument(
        "--kivi",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the KIVI-4 attention path too (default: on)",
    )
    ap.add_argument("--prefill-tokens", type=int, default=1024, help="0: skip prefill attention")
    ap.add_argument("--plot", default=str(ROOT / "runs" / "bench" / "kernels.png"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timed = timer(device)
    # The headline is the first dtype: the one the model runs in here by default (`auto`, as in
    # bench/model_speed.py: bf16 on a CPU with avx512_bf16, else fp32).
    cpu_first = "bfloat16,float32" if cpu_flags().get("avx512_bf16") else "float32,bfloat16"
    names = (
        args.dtypes or ("bfloat16,float16,float32" if device.type == "cuda" else cpu_first)
    ).split(",")
    path = (
        "triton"
        if device.type == "cuda"
        else ("native" if kernels.native_status().available else "torch")
    )
    where = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"{torch.get_num_threads()} threads"
    )
    print(
        f"device {device} ({where}), dispatch path: {path}",
        flush=True,
    )

    result = {
        "device": device.type,
        "path": path,
        "workload": f"{BATCH}x{TOKENS} tokens, {Q_HEADS}/{KV_HEADS} heads, "
        f"head_dim {HEAD_DIM}, {LAYERS} layers",
    }
    result["cpu_flags"] = cpu_flags()
    result["load_average_start"] = round(os.getloadavg()[0], 2)
    result["threads"] = torch.get_num_threads()
    copy_bw = copy_bandwidth(device, timed, args.repeats)
    print(f"copy bandwidth: {copy_bw / 1e9:.2f} GB/s (read + write)", flush=True)
    result["copy_rw_gbps"] = round(copy_bw / 1e9, 3)
    bars = {"copy (r+w)": copy_bw / 1e9}

    for i, name in enumerate(names):
        pool, table, q, lens, kv_bytes = make_workload(device, DTYPES[name])
        fast = step_seconds(
            kernels.paged_decode_attention, pool, table, q, lens, timed, args.repeats
        )
        ref = step_seconds(
            kernels.paged_decode_attention_ref,
            pool,
            table,
            q,
            lens,
            timed,
            max(2, args.repeats // 2),
        )
        sdpa = sdpa_step_seconds(pool, table, q, timed, max(2, args.repeats // 2))
        # On CUDA the step as the decode worker runs it, replayed from a graph (as SDPA is);
        # the reference's ratio stays eager against eager.
        kernel = fast
        if device.type == "cuda":
            kernel = step_seconds(
                kernels.paged_decode_attention, pool, table, q, lens, timed, args.repeats, True
            )
            result[f"{name}_eager_step_ms"] = round(fast * 1e3, 2)
        gbps, ratio = kv_bytes / kernel / 1e9, kv_bytes / kernel / copy_bw
        print(
            f"{name}: {kv_bytes / 2**20:.0f} MiB of KV per step; "
            f"{path} {kernel * 1e3:.2f} ms = {gbps:.2f} GB/s read ({ratio:.2f}x the copy's r+w "
            f"bandwidth){' replayed, eager %.2f ms' % (fast * 1e3) if kernel != fast else ''}; "
            f"reference {ref * 1e3:.1f} ms ({ref / fast:.2f}x slower); "
            f"SDPA over gathered KV {sdpa * 1e3:.2f} ms ({sdpa / kernel:.2f}x slower)",
            flush=True,
        )
        result[f"{name}_step_ms"] = round(kernel * 1e3, 3)
        result[f"{name}_kv_read_gbps"] = round(gbps, 3)
        result[f"{name}_vs_rw_bw"] = round(ratio, 3)
        result[f"{name}_vs_reference"] = round(ref / fast, 3)
        result[f"{name}_vs_sdpa"] = round(sdpa / kernel, 3)
        result[f"{name}_sdpa_step_ms"] = round(sdpa * 1e3, 3)
        bars[f"{name} {path}"] = gbps
        bars[f"{name} reference"] = kv_bytes / ref / 1e9
        bars[f"{name} SDPA"] = kv_bytes / sdpa / 1e9
        if i == 0:  # the headline: the first dtype (the model's default on this device)
            result["decode_attn_vs_rw_bw"] = round(ratio, 3)
            result["headline_dtype"] = name
        del pool

    result.update(kivi_sizes())
    print(
        f"KIVI bytes/token (30 layers, block 16, group 32): fp16 {result['fp16_bytes_per_token']}, "
        f"kivi4 {result['kivi4_bytes_per_token']:.0f} ({result['kivi4_vs_fp16']}x smaller), "
        f"kivi2 {result['kivi2_bytes_per_token']:.0f} ({result['kivi2_vs_fp16']}x smaller)",
        flush=True,
    )
    if args.kivi or args.kivi is None:
        pool, table, q, lens, _ = make_workload(device, torch.float16)
        layers = [
            kernels.kivi_quantize(torch.stack([pool[:, layer, 0], pool[:, layer, 1]], dim=1), 4)
            for layer in range(LAYERS)
        ]
        del pool

        def step():
            for layer in range(LAYERS):
                kernels.paged_decode_attention_kivi(q, layers[layer], table, lens)

        step()
        step = replayed(step, device)  # on CUDA, as the decode worker runs it
        secs = statistics.median(timed(step) for _ in range(max(2, args.repeats // 2)))
        kivi_bytes = (
            LAYERS
            * BATCH
            * TOKENS
            // BLOCK
            * kernels.kivi_packed_nbytes(BLOCK, KV_HEADS, HEAD_DIM, 4)
        )
        print(
            f"kivi4 attention: {secs * 1e3:.1f} ms per step, "
            f"{kivi_bytes / secs / 1e9:.2f} GB/s of packed KV "
            f"({kivi_bytes / secs / copy_bw:.2f}x the copy's r+w bandwidth)",
            flush=True,
        )
        result["kivi4_step_ms"] = round(secs * 1e3, 3)
        result["kivi4_kv_read_gbps"] = round(kivi_bytes / secs / 1e9, 3)
        result["kivi4_vs_rw_bw"] = round(kivi_bytes / secs / copy_bw, 3)
        # the same step over 16-bit blocks: whether reading a third of the bytes pays on this
        # device, or unpacking the codes costs more than the bytes saved
        head = result["headline_dtype"]
        result[f"kivi4_step_vs_{head}"] = round(secs * 1e3 / result[f"{head}_step_ms"], 3)
        bars["kivi4 packed"] = kivi_bytes / secs / 1e9
    if args.prefill_tokens > 0:
        # in the headline dtype (the model's here): bf16's kernel or fp32's
        dtype = getattr(torch, names[0])
        result.update(prefill_attention(device, dtype, args.prefill_tokens, timed, args.repeats))
    pressure = cpu_pressure()
    if pressure is not None:  # other processes' share of the CPUs while this ran (shared machines)
        result["cpu_pressure_avg60"] = pressure
        print(
            f"CPU pressure (some, avg60): {pressure}% - "
            "figures are only comparable at low pressure",
            flush=True,
        )
    result["load_average"] = round(os.getloadavg()[0], 2)
    plot(bars, args.plot, result["workload"], device)
    print(json.dumps(result))


def prefill_attention(device, dtype, tokens: int, timed, repeats: int) -> dict:
    """Causal prefill attention in `dtype` over `tokens` fresh tokens, LAYERS calls: the dispatch's
    path and torch's SDPA on the same q/k/v (views of one fused projection, as the model makes
    them), each the median of `repeats`; GFLOP/s counts QK^T and PV over the causal half."""
    g = torch.Generator().manual_seed(0)
    width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(LAYERS, tokens, width, generator=g).to(device=device, dtype=dtype)
    one = torch.zeros(1, dtype=torch.long, device=device)
    split = [Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    layers = [
        (q.view(tokens, Q_HEADS, HEAD_DIM), k.view(1, tokens, KV_HEADS, HEAD_DIM),
         v.view(1, tokens, KV_HEADS, HEAD_DIM))
        for q, k, v in (x.split(split, dim=-1) for x in qkv)
    ]  # fmt: skip

    def step(backend):
        for q, k, v in layers:
            kernels.prefill_attention(q, k, v, one, 0, HEAD_DIM**-0.5, backend=backend)

    out = {}
    flops = LAYERS * Q_HEADS * tokens * (tokens + 1) / 2 * HEAD_DIM * 2 * 2
    for name, backend in (("dispatch", None), ("sdpa", "torch")):
        step(backend)
        secs = statistics.median(timed(lambda: step(backend)) for _ in range(repeats))
        out[name] = secs
    fast, sdpa = out["dispatch"], out["sdpa"]
    print(
        f"prefill attention, {tokens} tokens {kernels.dtype_name(dtype)} x {LAYERS} layers: "
        f"dispatch {fast * 1e3:.1f} ms "
        f"({flops / fast / 1e9:.0f} GFLOP/s), SDPA {sdpa * 1e3:.1f} ms "
        f"({flops / sdpa / 1e9:.0f} GFLOP/s): {sdpa / fast:.2f}x",
        flush=True,
    )
    return {
        "prefill_attn_tokens": tokens,
        "prefill_attn_dtype": kernels.dtype_name(dtype),
        "prefill_attn_step_ms": round(fast * 1e3, 2),
        "prefill_attn_sdpa_step_ms": round(sdpa * 1e3, 2),
        "prefill_attn_gflops": round(flops / fast / 1e9, 1),
        "prefill_attn_sdpa_gflops": round(flops / sdpa / 1e9, 1),
        "prefill_attn_vs_sdpa": round(sdpa / fast, 3),
    }


def cpu_pressure() -> float | None:
    """Linux PSI: % of the last 60 s in which some runnable task waited for a CPU."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(f.split("=") for f in line.split()[1:])
    return float(fields.get("avg60", "nan"))


def plot(bars: dict[str, float], path: str, title: str, device) -> None:
    """Bar chart of GB/s: copy bandwidth, the dispatch path and the baselines per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    colors = ["grey"] + ["tab:blue", "tab:orange", "tab:green"] * len(bars)
    ax.bar(list(bars), list(bars.values()), color=colors[: len(bars)])
    ax.set_ylabel("GB/s (KV bytes read; copy: read + write)")
    ax.set_title(f"paged decode attention on {device.type}: {title}", fontsize=9)
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", flush=True)


if __name__ == "__main__":
    main()
