r"""The decode step on a CUDA GPU: eager against replayed CUDA graphs (model/cuda_graphs.py), and
both against the card's floor for the step.

The model has SmolLM2-135M's shape (or --shape llama-1b: Llama-3.2-1B's) with seeded random
weights: the step's time does not depend on the weights' values, and the GGUF does not travel
to a lent GPU. For each batch size, that many sequences of --context prompt tokens are
prefilled into a paged pool; then the decode step runs as the decode worker runs it (inputs
built on the host; the greedy argmax on the GPU and the token ids copied back), eagerly and
from the graph captured for the batch, in turns, --steps steps a round, medians of --repeats
rounds.

The floor: a step reads every weight once and each sequence's KV, and writes one token's KV per
layer; those bytes over the bandwidth of one large device copy (read plus write), measured in
the same run. `graph_vs_floor` is that floor over the graph's step time (1.0 = at the floor).
Last line: one JSON object.

    python3 bench/decode_cuda.py [--shape smollm2] [--dtype bfloat16] [--batches 1,16,64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import DTYPES, copy_bandwidth, timer  # noqa: E402
from bench.machine import finish  # noqa: E402
from bench.random_model import SHAPES  # noqa: E402
from model import KVPool, ModelConfig  # noqa: E402
from model.cuda_graphs import GraphedStep, StaticInput  # noqa: E402
from model.loader import _build, tiny_random_weights  # noqa: E402
from servekit.memory import tensor_bytes  # noqa: E402

BS = 16


def build(shape: str, dtype: torch.dtype):
    config = ModelConfig.from_hf(SHAPES[shape])
    return config, _build(config, tiny_random_weights(config), dtype, "cuda")


def case(config, model, batch: int, context: int, dtype):
    """A pool with `batch` prefilled sequences; (pool, tokens, tables, positions) on the host,
    as the decode worker passes them."""
    per_seq = -(-(context + 1) // BS)
    pool = KVPool(config, batch * per_seq + 1, BS, dtype, "cuda")
    g = torch.Generator().manual_seed(batch)
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    for i in range(batch):
        prompt = torch.randint(3, config.vocab_size, (context,), generator=g)
        model.prefill(prompt, pool, tables[i].tolist(), 0, last_only=True)
    tokens = torch.randint(3, config.vocab_size, (batch,), generator=g)
    return pool, tokens, tables, torch.full((batch,), context, dtype=torch.long)


def floor_bytes(model, config, batch: int, context: int, dtype) -> int:
    """Weights read once, each sequence's KV read, the new token's KV written."""
    kv_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize
    weights = sum(tensor_bytes(t) for t in model.state_dict().values())
    return weights + batch * (context + 1) * kv_token + batch * kv_token


def run_batch(args, config, model, batch: int, dtype, copy_bw: float, timed) -> dict:
    """One batch size's eager and graph step times (ms), floor and agreement."""
    pool, tokens, tables, positions = case(config, model, batch, args.context, dtype)
    pad = pool.num_blocks - 1

    def eager(t, tab, pos):
        return model.decode(t, pool, tab, pos)

    graphed = GraphedStep(
        eager,
        [StaticInput(torch.long, 0, 0), StaticInput(torch.int32, tables.shape[1], pad),
         StaticInput(torch.long, 0, 0)],
        [batch],
        "cuda",
    )  # fmt: skip
    t0 = time.perf_counter()
    with torch.inference_mode():
        assert graphed.capture(), "capture failed"
    capture_s = time.perf_counter() - t0
    want = eager(tokens, tables, positions).float().cpu()
    got = graphed(tokens, tables, positions).float().cpu()
    err = (want - got).abs().max().item()
    same = bool(torch.equal(want.argmax(-1), got.argmax(-1)))

    def steps(fn):
        def run():
            for _ in range(args.steps):
                fn(tokens, tables, positions).argmax(-1).cpu()  # greedy, as the worker samples

        return run

    ms = {"eager": [], "graph": []}
    for _ in range(args.repeats):  # in turns: drifts fall on both alike
        ms["eager"].append(timed(steps(eager)))
        ms["graph"].append(timed(steps(graphed)))
    eager_ms = statistics.median(ms["eager"]) * 1e3 / args.steps
    graph_ms = statistics.median(ms["graph"]) * 1e3 / args.steps
    floor_ms = floor_bytes(model, config, batch, args.context, dtype) / copy_bw * 1e3
    print(f"batch {batch:3d}: eager {eager_ms:.3f} ms, graph {graph_ms:.3f} ms "
          f"({eager_ms / graph_ms:.2f}x), floor {floor_ms:.3f} ms, "
          f"{batch / graph_ms * 1e3:.0f} tok/s, logits max diff {err:.2e}, "
          f"argmax same {same}, captured in {capture_s:.1f} s", flush=True)  # fmt: skip
    return {
        f"b{batch}_eager_ms": round(eager_ms, 4), f"b{batch}_graph_ms": round(graph_ms, 4),
        f"b{batch}_graph_vs_eager": round(eager_ms / graph_ms, 2),
        f"b{batch}_floor_ms": round(floor_ms, 4),
        f"b{batch}_graph_vs_floor": round(floor_ms / graph_ms, 3),
        f"b{batch}_graph_tok_s": round(batch / graph_ms * 1e3, 1),
        f"b{batch}_logits_max_diff": err, f"b{batch}_argmax_same": same,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=50, help="decode steps a round")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/decode_cuda.py needs a CUDA GPU", file=sys.stderr)
        return 2
    load_start = os.getloadavg()[0]
    dtype = DTYPES[args.dtype]
    device = torch.device("cuda")
    timed = timer(device)
    config, model = build(args.shape, dtype)
    copy_bw = copy_bandwidth(device, timed, args.repeats)
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e9:.0f} GB/s (read + write)")
    result = {"bench": "decode_cuda", "gpu": torch.cuda.get_device_name(), "shape": args.shape,
              "dtype": args.dtype, "context": args.context, "steps": args.steps,
              "repeats": args.repeats, "copy_gbps": round(copy_bw / 1e9, 1)}  # fmt: skip
    for batch in [int(b) for b in args.batches.split(",")]:
        result.update(run_batch(args, config, model, batch, dtype, copy_bw, timed))
        torch.cuda.empty_cache()
    return finish(result, load_start)


if __name__ == "__main__":
    sys.exit(main())
