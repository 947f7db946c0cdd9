"""One decode step at the same batch and context: a 16-bit full-precision cache (`kv16`) against
kivi4 and kivi2 (16-bit windows), in one process, on the real model, in the dtype serving picks
(`--dtype auto`). Answers "is a KIVI decode step slower than full precision at the same batch?"
and shows where a step's time goes: the step with attention over no context (weights, MLP,
sampling-free logits) is measured too, so attention's share is the difference.

Two paths each: `native`, the step as serving runs it (where the pool's dtype is the model's, the
fused C step of kernels/decode_step.py, attention included; else the layer-by-layer path with the
fused CPU attention of kernels/native.py), and `torch`, the layer-by-layer path with the torch
attention (the reference).

Per (batch, setting, path): the median of --repeats steps, after one warm-up. Contexts are
--context tokens; KIVI sequences hold the last kivi_residual tokens (plus up to a block) in the
window and the rest packed. Values are random normal KV (packed through the real quantizer), so
the attention arithmetic is the same as served KV's. The last line printed is one JSON object.

    .venv/bin/python bench/kivi_step.py [--batches 1,8,24 --context 1088 --threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import finish, median_s  # noqa: E402
from servekit.machine import native_dtype  # noqa: E402


def say(*a) -> None:
    print(*a, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,8,24")
    ap.add_argument("--context", type=int, default=1088, help="tokens per sequence")
    ap.add_argument("--kivi-residual", type=int, default=32)
    ap.add_argument("--kivi-group-size", type=int, default=32)
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the model's compute dtype, as serving picks it (auto: bfloat16 with avx512_bf16, "
        "else float32)",
    )
    ap.add_argument(
        "--window-dtype",
        default="auto",
        choices=["auto", "float16", "bfloat16"],
        help="the 16-bit KV of the full-precision pool and of KIVI's window (auto: the compute "
        "dtype where it is 16-bit, as serving's kivi_window_dtype auto; else float16)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    import kernels
    import model.llama as llama
    from kernels import KiviKVLayout
    from model import KiviPool, KVPool, load_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load0 = os.getloadavg()[0]
    if args.dtype == "auto":
        args.dtype = native_dtype()
    if args.window_dtype == "auto":
        args.window_dtype = "bfloat16" if args.dtype == "bfloat16" else "float16"
    lm = load_model(args.model, getattr(torch, args.dtype))
    m, c = lm.model, lm.config
    bs = 16
    kv16 = getattr(torch, args.window_dtype)
    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.context
    native = kernels.native_status()
    say(
        f"{args.model} {args.dtype} compute, {args.window_dtype} KV, context {ctx}, "
        f"{args.threads} thread(s); fused kernels: {native.detail}"
    )

    def with_backend(op: str, backend: str, fn):
        """fn() with model.llama's kernels.<op> pinned to `backend`; the torch path also goes
        layer by layer (the fused C step would run its own attention whatever is pinned)."""
        orig = getattr(kernels, op)
        setattr(llama.kernels, op, lambda *a, **k: orig(*a, backend=backend, **k))
        m.fused_decode = backend != "torch"
        try:
            return fn()
        finally:
            setattr(llama.kernels, op, orig)
            m.fused_decode = True

    result: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "kv_dtype": args.window_dtype,
        "context": ctx,
        "threads": args.threads,
    }
    backends = ["native", "torch"] if native.available else ["torch"]
    for b in batches:
        nb = -(-ctx // bs)
        tok = torch.randint(100, 1000, (b,))
        pos = torch.full((b,), ctx - 1)
        pool = KVPool(c, b * nb, bs, kv16)
        pool.kv.normal_()
        tables = torch.arange(b * nb, dtype=torch.int32).view(b, nb)
        row = {}
        # attention over one token: what the step costs without context
        one = torch.zeros(b, dtype=torch.long)
        row["no_context"] = 1e3 * median_s(lambda: m.decode(tok, pool, tables, one), args.repeats)
        for be in backends:
            row[f"kv16_{be}"] = with_backend(
                "paged_decode_attention",
                be,
                lambda: 1e3 * median_s(lambda: m.decode(tok, pool, tables, pos), args.repeats),
            )
        for bits in (4, 2):
            layout = KiviKVLayout(
                c.num_layers,
                c.num_kv_heads,
                c.head_dim,
                bs,
                bits,
                args.kivi_group_size,
                args.kivi_residual,
                kv16,
            )
            per_seq = args.kivi_residual // bs + 1
            kp = KiviPool(c, layout, b * nb, b * per_seq)
            src = layout.pack(torch.randn(8, c.num_layers, 2, bs, c.num_kv_heads, c.head_dim))
            kp.packed.kv[:] = src[torch.arange(b * nb) % 8]
            kp.window.kv.normal_()
            n_packed = (ctx - 1 - args.kivi_residual) // bs
            ptab = torch.arange(b * nb, dtype=torch.int32).view(b, nb)[:, :n_packed]
            plens = torch.full((b,), n_packed * bs, dtype=torch.int32)
            wtab = torch.arange(b * per_seq, dtype=torch.int32).view(b, per_seq)
            for be in backends:
                row[f"kivi{bits}_{be}"] = with_backend(
                    "paged_decode_attention_kivi_window",
                    be,
                    lambda: (
                        1e3
                        * median_s(
                            lambda: m.decode_kivi(tok, kp, ptab, plens, wtab, pos), args.repeats
                        )
                    ),
                )
        say(f"batch {b:3d}: " + "  ".join(f"{k} {v:7.1f} ms" for k, v in row.items()))
        for k, v in row.items():
            result[f"b{b}_{k}_ms"] = round(v, 2)
        best = "native" if native.available else "torch"
        for bits in (4, 2):
            result[f"b{b}_kivi{bits}_step_vs_kv16"] = round(
                row[f"kivi{bits}_{best}"] / row[f"kv16_{best}"], 3
            )
    result["fused_kernels"] = native.available
    for b in batches:
        say(
            f"batch {b}: kivi4 step / 16-bit step {result[f'b{b}_kivi4_step_vs_kv16']:.3f}, "
            f"kivi2 {result[f'b{b}_kivi2_step_vs_kv16']:.3f} (below 1: KIVI is faster)"
        )
    return finish(result, load0)


if __name__ == "__main__":
    sys.exit(main())
