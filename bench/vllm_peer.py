"""vLLM's CPU build on bench/e2e.py's workloads, as the peer its figures are set beside: run in
its own venv (`--vllm-python`) and its own process, on a safetensors copy of the same weights and
the same token ids, each figure a median taken the way bench/e2e.py takes halfmoon's.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

DEFAULT_VLLM = "/tmp/vllm-venv/bin/python"  # --vllm-python when VLLM_PYTHON is not set
# the KV cache vLLM-CPU allocates (VLLM_CPU_KVCACHE_SPACE, GiB): what bench/e2e.py gives halfmoon
VLLM_KV_GIB = 4


def say(*a) -> None:
    print(*a, flush=True)


# Run by vLLM's own interpreter, which has neither halfmoon nor its dependencies: self-contained,
# and its figures come back as one "VLLM_RESULT {json}" line on stdout.
VLLM_SCRIPT = """
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    model_dir, prompts_path, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
    p = json.load(open(prompts_path))
    llm = LLM(model=model_dir, dtype=dtype, enable_prefix_caching=True, max_model_len=2048, seed=0)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = SamplingParams(max_tokens=p["new_tokens"], temperature=0.0, ignore_eos=True)
    tp = lambda ids: TokensPrompt(prompt_token_ids=ids)
    def timed(prompts, sp):
        t0 = time.perf_counter(); outs = llm.generate([tp(x) for x in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)
    for ids in p["decode"][:2]:
        timed([ids], first)
    timed([p["warmup"]], first)
    cold = [timed([ids], first)[0] * 1000 for ids in p["cold"]]
    timed([p["seed"]], first)
    warm = [timed([ids], first)[0] * 1000 for ids in p["warm"]]
    med = lambda xs: sorted(xs)[len(xs) // 2]
    r1 = [(lambda w, n: n / w)(*timed([p["decode"][0]], gen)) for _ in range(p["repeats"])]
    r16 = [(lambda w, n: n / w)(*timed(p["decode"][1:], gen)) for _ in range(p["repeats"])]
    print("VLLM_RESULT " + json.dumps({"ttft_cold_ms": med(cold), "ttft_warm_ms": med(warm),
                                      "decode_1_tok_s": med(r1), "decode_16_tok_s": med(r16)}),
          flush=True)
if __name__ == "__main__":
    main()
"""


def run_vllm(
    python: str, lm, prompts: dict, dtype: str, repeats: int, new_tokens: int
) -> tuple[dict | None, str]:
    """vLLM's figures on the same prompts (`new_tokens` generated in each decode figure), or
    (None, why not)."""
    if not python or not Path(python).exists():
        return (
            None,
            f"no vLLM venv at {python or '(none given)'}: install vLLM's CPU build in a venv "
            "and pass --vllm-python",
        )
    from model import save_hf_dir

    with tempfile.TemporaryDirectory(prefix="halfmoon-vllm-") as tmp:
        model_dir = save_hf_dir(lm, Path(tmp) / "model")  # a safetensors copy of the same weights
        prompts_path = Path(tmp) / "prompts.json"
        prompts_path.write_text(json.dumps(dict(prompts, new_tokens=new_tokens, repeats=repeats)))
        script = Path(tmp) / "run_vllm.py"
        script.write_text(VLLM_SCRIPT)
        env = dict(
            os.environ,
            VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
            VLLM_CPU_KVCACHE_SPACE=str(VLLM_KV_GIB),
            TOKENIZERS_PARALLELISM="false",
        )
        env.pop("TRITON_INTERPRET", None)
        say(f"vllm: starting (compiles for 1-2 minutes) with {python}")
        t0 = time.monotonic()
        proc = subprocess.run(
            [python, str(script), str(model_dir), str(prompts_path), dtype],
            env=env,
            capture_output=True,
            text=True,
            timeout=1500,
        )
        say(f"vllm: finished in {time.monotonic() - t0:.0f} s (exit {proc.returncode})")
        for line in proc.stdout.splitlines():
            if line.startswith("VLLM_RESULT "):
                return json.loads(line[len("VLLM_RESULT ") :]), ""
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, "vLLM failed: " + " | ".join(tail)
