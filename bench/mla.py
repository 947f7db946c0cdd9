"""MLA's latent KV cache: its bytes against MHA and GQA, and absorbed decode attention on the CPU.

1. KV bytes per token per layer (16-bit) for DeepSeek-V2 and DeepSeek-V2-Lite configs: the latent
   row (kv_lora_rank + qk_rope_head_dim) against the same model with multi-head attention (per
   head keys of nope + rope dims, values of v_head_dim) and with grouped-query attention (the same
   per-head dims, --gqa-heads KV heads). Checked against the bytes a real `KVPool` allocates for
   the MLA layout.
2. One decode step's attention over a paged latent cache, absorbed (`kernels.
   paged_mla_decode_attention`: every head attends over the shared latent rows, the key
   up-projection folded into the query, the value up-projection after) against the non-absorbed
   path (the latent rows up-projected by kv_b_proj to per-head keys and values, then ordinary
   attention) at --contexts tokens, at the V2-Lite shape (16 heads), batch --batch, in fp32
   and, where the CPU has avx512_bf16, again in bf16 (rows, query and weights: a bf16 model's
   own step; --dtypes picks). Bytes read per second by the absorbed step against this run's copy
   bandwidth (a copy of a buffer the cache's size; a copy reads and writes its bytes, so
   bandwidth = 2 x bytes / time), and its arithmetic against this run's matmul rate in the same
   dtype (torch.mm of 2048 x 2048, same threads): every head attends over the same latent row,
   so the step does 16 x (576 + 512) x 2 FLOPs per 2,304 bytes read (15 a byte, fp32): it is
   bound by arithmetic, not by memory, and `mla_decode_vs_sgemm` (fp32) is the bound that means
   something. bf16's step scores on bf16 dot products and sums values in fp32; its time against
   fp32's is `mla_decode_bfloat16_vs_float32_4k`.

The last line printed is one JSON object.

    .venv/bin/python bench/mla.py [--contexts 1024,4096,16384 --batch 2 --dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import finish, median_s  # noqa: E402
from servekit.machine import cpu_flags, native_dtype  # noqa: E402

# The published configs' attention fields (config.json of deepseek-ai/DeepSeek-V2, -V2-Lite)
CONFIGS = {
    "deepseek-v2": dict(
        num_layers=60, num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128,
    ),
    "deepseek-v2-lite": dict(
        num_layers=27, num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128,
    ),
}  # fmt: skip


def say(*a) -> None:
    print(*a, flush=True)


def kv_bytes(cfg: dict, gqa_heads: int, elem: int = 2) -> dict[str, int]:
    """KV bytes per token per layer: MLA's latent row, MHA's and GQA's per-head K and V."""
    k_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    return {
        "mla": (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elem,
        "mha": cfg["num_heads"] * (k_dim + cfg["v_head_dim"]) * elem,
        "gqa": gqa_heads * (k_dim + cfg["v_head_dim"]) * elem,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--gqa-heads", type=int, default=8, help="KV heads of the GQA equivalent")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--dtypes",
        default="",
        help="the latent rows' and query's dtypes, comma-separated (default: float32, and "
        "bfloat16 where the CPU has avx512_bf16)",
    )
    args = ap.parse_args(argv)

    import torch

    from model import KVPool, ModelConfig, absorbed_decode_attention

    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    result: dict = {"batch": args.batch, "threads": torch.get_num_threads()}

    # ---- 1. bytes per token per layer ----
    for name, cfg in CONFIGS.items():
        b = kv_bytes(cfg, args.gqa_heads)
        mc = ModelConfig(
            vocab_size=256, hidden_size=64, intermediate_size=64, num_layers=cfg["num_layers"],
            num_heads=cfg["num_heads"], num_kv_heads=cfg["num_heads"],
            kv_lora_rank=cfg["kv_lora_rank"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"], v_head_dim=cfg["v_head_dim"],
            architecture="deepseek_v2",
        )  # fmt: skip
        pool = KVPool(mc, 4, 16, torch.bfloat16)
        real = pool.bytes() / (4 * 16 * cfg["num_layers"])
        if real != b["mla"]:
            raise SystemExit(f"{name}: the pool allocates {real} B a token-layer, not {b['mla']}")
        tag = name.replace("-", "_")
        result[f"{tag}_bytes_per_token_layer"] = b
        result[f"{tag}_mla_vs_mha"] = round(b["mla"] / b["mha"], 5)
        result[f"{tag}_mla_vs_gqa{args.gqa_heads}"] = round(b["mla"] / b["gqa"], 4)
        say(
            f"{name}: {b['mla']} B/token/layer latent vs {b['mha']} MHA "
            f"({b['mla'] / b['mha']:.4f}x) and {b['gqa']} GQA-{args.gqa_heads} "
            f"({b['mla'] / b['gqa']:.3f}x); the pool allocates {real:.0f}"
        )
    result["mla_kv_bytes_vs_mha"] = result["deepseek_v2_mla_vs_mha"]

    # ---- 2. absorbed vs non-absorbed decode attention, in each dtype ----
    cfg = CONFIGS["deepseek-v2-lite"]
    heads, rank, rope = cfg["num_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, vdim = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    scale = (nope + rope) ** -0.5
    g = torch.Generator().manual_seed(0)
    w_kv_b32 = torch.randn(heads * (nope + vdim), rank, generator=g) * rank**-0.5
    bs, batch = 16, args.batch
    result["cpu_flags"] = cpu_flags()
    dtypes = args.dtypes.split(",") if args.dtypes else ["float32"]
    if not args.dtypes and native_dtype(result["cpu_flags"]) == "bfloat16":
        dtypes.append("bfloat16")  # a bf16 model's own decode step, where bf16 is native
    for name in dtypes:
        dtype = getattr(torch, name)
        a, b_ = (torch.randn(2048, 2048, generator=g).to(dtype) for _ in range(2))
        mm_flops = 2 * 2048**3 / median_s(lambda: a @ b_, args.repeats)
        result[f"{name}_matmul_gflops"] = round(mm_flops / 1e9, 1)
        say(f"{name} matmul (2048^3) here: {mm_flops / 1e9:.1f} GFLOP/s")
        w_kv_b = w_kv_b32.to(dtype)
        rows: list[dict] = []
        for ctx in [int(x) for x in args.contexts.split(",")]:
            nb = ctx // bs
            cache = torch.randn(batch * nb, bs, rank + rope, generator=g).to(dtype)
            tables = torch.arange(batch * nb, dtype=torch.int32).view(batch, nb)
            lens = torch.full((batch,), nb * bs, dtype=torch.int32)
            q_nope = torch.randn(batch, heads, nope, generator=g).to(dtype)
            q_rope = torch.randn(batch, heads, rope, generator=g).to(dtype)

            def absorbed():  # the model's own decode step (W_uk into the query, W_uv after)
                return absorbed_decode_attention(
                    q_nope, q_rope, w_kv_b, vdim, cache, tables, lens, scale
                )

            def naive():
                outs = []
                for b in range(batch):
                    rows_ = cache[tables[b].long()].reshape(-1, rank + rope)[: int(lens[b])]
                    kv = torch.nn.functional.linear(rows_[:, :rank], w_kv_b)
                    kv = kv.view(-1, heads, nope + vdim)
                    k = torch.cat(
                        [kv[..., :nope], rows_[:, None, rank:].expand(-1, heads, rope)], -1
                    )
                    q = torch.cat([q_nope[b], q_rope[b]], -1)  # [H, nope + rope]
                    s_ = torch.einsum("hd,thd->ht", q.float(), k.float()) * scale
                    v_ = kv[..., nope:].float()
                    outs.append(torch.einsum("ht,thv->hv", torch.softmax(s_, -1), v_))
                return torch.stack(outs)

            err = (absorbed().float() - naive()).abs().max().item()
            t_abs = median_s(absorbed, args.repeats)
            t_naive = median_s(naive, max(1, args.repeats // 2))
            nbytes = cache[: batch * nb].numel() * cache.element_size()
            dst = torch.empty_like(cache)
            t_copy = median_s(lambda: dst.copy_(cache), args.repeats)
            copy_bw = 2 * nbytes / t_copy
            read_bw = nbytes / t_abs
            # the kernel's arithmetic: scores over rank + rope, values over rank, for every head
            flops = batch * nb * bs * heads * (2 * rank + rope) * 2 / t_abs
            row = {
                "context": ctx,
                "absorbed_ms": round(t_abs * 1000, 3),
                "naive_ms": round(t_naive * 1000, 3),
                "absorbed_speedup": round(t_naive / t_abs, 2),
                "read_gb_s": round(read_bw / 1e9, 2),
                "copy_gb_s": round(copy_bw / 1e9, 2),
                "vs_copy_bw": round(read_bw / copy_bw, 3),
                "gflops": round(flops / 1e9, 1),
                "vs_matmul": round(flops / mm_flops, 3),
                "max_abs_err": err,
            }
            rows.append(row)
            say(
                f"{name} context {ctx:6d} x batch {batch}: absorbed {row['absorbed_ms']:8.2f} ms, "
                f"non-absorbed {row['naive_ms']:9.2f} ms ({row['absorbed_speedup']}x); reads "
                f"{row['read_gb_s']} GB/s = {row['vs_copy_bw']} of copy bandwidth "
                f"({row['copy_gb_s']} GB/s), {row['gflops']} GFLOP/s = {row['vs_matmul']} of "
                f"the {name} matmul's; max |diff| {err:.2e}"
            )
        by = {r["context"]: r for r in rows}
        if name == "float32":
            result["decode"] = rows
            if 4096 in by:
                result["mla_absorbed_vs_naive_4k"] = by[4096]["absorbed_speedup"]
                result["mla_decode_vs_copy_bw"] = by[4096]["vs_copy_bw"]
                result["mla_decode_vs_sgemm"] = by[4096]["vs_matmul"]
        else:
            result[f"decode_{name}"] = rows
            if 4096 in by:
                result[f"mla_decode_{name}_ms_4k"] = by[4096]["absorbed_ms"]
                result[f"mla_decode_{name}_vs_{name}_matmul"] = by[4096]["vs_matmul"]
    fp32, other = result.get("decode"), [d for d in dtypes if d != "float32"]
    if fp32 and other and f"mla_decode_{other[0]}_ms_4k" in result:
        at = {r["context"]: r["absorbed_ms"] for r in fp32}
        if 4096 in at:  # the same step's time in the 16-bit dtype over fp32's
            result[f"mla_decode_{other[0]}_vs_float32_4k"] = round(
                result[f"mla_decode_{other[0]}_ms_4k"] / at[4096], 3
            )
    return finish(result, load0)


if __name__ == "__main__":
    sys.exit(main())
