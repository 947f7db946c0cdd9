r"""The Triton decode attention's launch tuning on a CUDA GPU: the split kernel's form (products as
broadcast reductions, or as tensor-core tl.dot), split programs a multiprocessor, keys a tile and
warps a program, each setting's step against the default's.

Workload: bench/kernels.py's (8 sequences x 4,096 tokens at SmolLM2's shape, 30 layers, blocks in
a random order), bf16 unless --dtype, each setting's 30 calls replayed from a CUDA graph (as the
decode worker runs them), medians of --repeats. Each setting's output is checked against the
default's. Reported: each setting's step and its KV bytes read per second over the card's copy
bandwidth (read plus write), then the best. Last line: one JSON object.

    python3 bench/decode_attn_sweep.py [--dtype bfloat16] [--forms reduce,dot] [--per-sm 4,16,64]
        [--tiles 16,32,64] [--warps 2,4,8]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import (  # noqa: E402
    DTYPES,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    copy_bandwidth,
    make_workload,
    replayed,
    timer,
)
from bench.machine import finish  # noqa: E402
from kernels.paged_attention_triton import _full_source, _launch  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--forms", default="reduce,dot", help="the split kernel's forms (_launch)")
    ap.add_argument("--per-sm", default="4,16,64", help="split programs a multiprocessor")
    ap.add_argument("--tiles", default="16,32,64", help="keys a tile")
    ap.add_argument("--warps", default="2,4,8", help="warps a split program")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/decode_attn_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    load_start = os.getloadavg()[0]
    device = torch.device("cuda")
    timed = timer(device)
    copy_bw = copy_bandwidth(device, timed, args.repeats)
    pool, table, q, lens, kv_bytes = make_workload(device, DTYPES[args.dtype])

    def step_for(form, tile, per_sm, warps):
        def step():
            for layer in range(LAYERS):
                source = _full_source(pool[:, layer, 0], pool[:, layer, 1], table, lens)
                out = _launch(
                    q, [source], None, KV_HEADS, HEAD_DIM, False, tile, per_sm, warps, form
                )
            return out

        return step

    want = step_for("reduce", None, 4, None)().float()  # the default setting's output
    default = statistics.median(
        timed(replayed(step_for("reduce", None, 4, None), device)) for _ in range(args.repeats)
    )
    print(f"default: {default * 1e3:.3f} ms, {kv_bytes / default / copy_bw:.3f} of the copy's "
          f"bandwidth ({copy_bw / 1e9:.0f} GB/s r+w)", flush=True)  # fmt: skip
    rows = []
    forms = [f for f in args.forms.split(",") if f]
    settings = itertools.product(forms, _ints(args.per_sm), _ints(args.tiles), _ints(args.warps))
    for form, per_sm, tile, warps in settings:
        try:
            step = step_for(form, tile, per_sm, warps)
            err = (step().float() - want).abs().max().item()
            graph = replayed(step, device)
            secs = statistics.median(timed(graph) for _ in range(args.repeats))
        except Exception as exc:  # noqa: BLE001 - a setting the compiler refuses is reported
            print(f"{form} per_sm {per_sm} tile {tile} warps {warps}: failed ({exc})", flush=True)
            continue
        rows.append((secs, form, per_sm, tile, warps, err))
        print(f"{form:6s} per_sm {per_sm:3d} tile {tile:3d} warps {warps}: {secs * 1e3:.3f} ms, "
              f"{kv_bytes / secs / copy_bw:.3f} of the copy's bandwidth, max diff {err:.1e}",
              flush=True)  # fmt: skip
    result = {"bench": "decode_attn_sweep", "gpu": torch.cuda.get_device_name(),
              "dtype": args.dtype, "copy_rw_gbps": round(copy_bw / 1e9, 1),
              "default_step_ms": round(default * 1e3, 4),
              "default_vs_rw_bw": round(kv_bytes / default / copy_bw, 4)}  # fmt: skip
    if rows:
        secs, form, per_sm, tile, warps, err = min(rows)
        result.update({"best_step_ms": round(secs * 1e3, 4), "best_form": form,
                       "best_per_sm": per_sm,
                       "best_tile": tile, "best_warps": warps, "best_max_diff": err,
                       "best_vs_default": round(default / secs, 3),
                       "best_vs_rw_bw": round(kv_bytes / secs / copy_bw, 4)})  # fmt: skip
    return finish(result, load_start)


if __name__ == "__main__":
    sys.exit(main())
