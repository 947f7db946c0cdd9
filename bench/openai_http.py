"""What the OpenAI-compatible HTTP API costs over gRPC: the same workload through both, on one
local cluster (store node, prefill and decode workers, conductor and HTTP server, one process
each, as a deployment runs them).

- TTFT: `--requests` streamed requests one at a time, each with a fresh prompt of
  `--prompt-tokens` random tokens, alternating gRPC (client.AsyncClient) and HTTP (the `openai`
  client), so that both see the same machine; p50 of each and the extra p50 of HTTP.
- Streaming throughput: `--concurrency` streams of `--max-tokens` tokens at once, through gRPC
  and then through HTTP, `--rounds` times alternately; generated tokens per second (medians).

The last line printed is one JSON object; `http_ttft_overhead_ms` (aim <= 5 ms) and
`http_stream_tok_s_vs_grpc` (aim >= 0.95) are the figures.

    .venv/bin/python bench/openai_http.py [--model tiny-random] [--requests 40] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder leads sys.path, where this file would shadow the standard
# library's `http` package (urllib, httpx and the openai client import http.client).
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))

from bench.machine import finish  # noqa: E402


def say(*a) -> None:
    print(*a, flush=True)


def start_cluster(model: str, dtype: str, threads: int):
    from deploy import LocalCluster, cluster_config_from_dict

    workers = {"num_blocks": 512, "torch_threads": threads}
    cfg = cluster_config_from_dict(
        {
            "model": model,
            "dtype": dtype,
            "store": {"dram_bytes": 256 << 20},
            "prefill": {**workers, "chunk_size": 512},
            "decode": {**workers, "max_batch": 32},
            "conductor": {"load_poll_s": 0.05},
        }
    )
    cluster = LocalCluster(cfg, processes=True, http=True)
    cluster.start()
    return cluster


class RawHttp:
    """A lean HTTP/1.1 client for server-sent events over keep-alive connections: what the HTTP
    server adds, without a client library's own cost (the `openai` client spends ~10-20 ms of
    Python per request on this machine, and its CPU competes with the servers')."""

    def __init__(self, address: str):
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def events(self, path: str, body: dict):
        """The JSON events of one streamed answer, [DONE] left out."""
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        while True:
            reused = bool(self._idle)
            reader, writer = (
                self._idle.pop() if reused else await asyncio.open_connection(self.host, self.port)
            )
            try:
                writer.write(head + data)
                line = await reader.readline()
            except ConnectionError:
                if not reused:
                    raise
                line = b""
            if line or not reused:
                break
            writer.close()  # the server closed it while idle (its keep-alive timeout): again
        status = int(line.split()[1])
        headers = {}
        while (line := await reader.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 200:
            raise RuntimeError(
                f"HTTP {status}: {await reader.read(int(headers['content-length']))}"
            )
        pending = b""
        while size := int((await reader.readline()).strip(), 16):  # chunked transfer coding
            pending += (await reader.readexactly(size + 2))[:-2]
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                if event.startswith(b"data: {"):
                    yield json.loads(event[6:])
        await reader.readline()  # the CRLF after the last chunk
        self._idle.append((reader, writer))

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()


class Paths:
    """One request through each path: (client-side TTFT ms, tokens) of a streamed answer."""

    def __init__(self, grpc_client, http_address: str, http_client: str, model: str):
        self.grpc, self.model = grpc_client, model
        self.raw = RawHttp(http_address) if http_client == "raw" else None
        self.sdk = None
        if http_client == "openai":
            import openai

            self.sdk = openai.AsyncOpenAI(
                base_url=f"http://{http_address}/v1", api_key="-", max_retries=0, timeout=600
            )

    async def via_grpc(self, ids: list[int], max_tokens: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        first, tokens = None, 0
        async for c in self.grpc.generate_stream(
            token_ids=ids, max_tokens=max_tokens, ignore_eos=True
        ):
            if c.token_ids and first is None:
                first = time.perf_counter() - t0
            tokens += len(c.token_ids)
        return first * 1000.0, tokens

    async def via_http(self, ids: list[int], max_tokens: int) -> tuple[float, int]:
        body = dict(
            model=self.model,
            prompt=ids,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            ignore_eos=True,
        )
        t0 = time.perf_counter()
        first, tokens = None, 0
        if self.raw is not None:
            async for event in self.raw.events("/v1/completions", body):
                if event["choices"] and first is None:
                    first = time.perf_counter() - t0
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        else:
            body["extra_body"] = {"ignore_eos": body.pop("ignore_eos")}
            async for chunk in await self.sdk.completions.create(**body):
                if chunk.choices and first is None:
                    first = time.perf_counter() - t0
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        return first * 1000.0, tokens

    async def close(self) -> None:
        if self.raw is not None:
            self.raw.close()
        if self.sdk is not None:
            await self.sdk.close()


async def run(args, address: str, http_address: str, vocab: int) -> dict:
    from client import AsyncClient

    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(args.prompt_tokens)]

    async with AsyncClient(address) as grpc_client:
        paths = Paths(grpc_client, http_address, args.http_client, args.model_name)
        try:
            return await measure(args, paths, prompt)
        finally:
            await paths.close()


async def measure(args, paths: Paths, prompt) -> dict:
    say("warming up both paths (first forward passes, timing models, connections)")
    for _ in range(3):
        await paths.via_grpc(prompt(), 4)
        await paths.via_http(prompt(), 4)

    grpc_ttft, http_ttft = [], []
    for i in range(args.requests):
        order = (paths.via_grpc, paths.via_http) if i % 2 == 0 else (paths.via_http, paths.via_grpc)
        for path in order:
            ttft, _ = await path(prompt(), 1)
            (grpc_ttft if path == paths.via_grpc else http_ttft).append(ttft)
    say(
        f"TTFT p50: gRPC {statistics.median(grpc_ttft):7.2f} ms   "
        f"HTTP {statistics.median(http_ttft):7.2f} ms   ({args.requests} requests each, "
        f"{args.prompt_tokens}-token prompts)"
    )

    async def streams(path) -> float:
        prompts = [prompt() for _ in range(args.concurrency)]
        t0 = time.perf_counter()
        done = await asyncio.gather(*(path(p, args.max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
        tokens = sum(n for _, n in done)
        assert tokens == args.concurrency * args.max_tokens, tokens
        return tokens / wall

    grpc_tok_s, http_tok_s = [], []
    for r in range(args.rounds):
        order = (paths.via_grpc, paths.via_http) if r % 2 == 0 else (paths.via_http, paths.via_grpc)
        for path in order:
            (grpc_tok_s if path == paths.via_grpc else http_tok_s).append(await streams(path))
        say(
            f"round {r + 1}: {args.concurrency} streams x {args.max_tokens} tokens: "
            f"gRPC {grpc_tok_s[-1]:7.1f} tok/s   HTTP {http_tok_s[-1]:7.1f} tok/s"
        )
    return {
        "grpc_ttft_ms": grpc_ttft,
        "http_ttft_ms": http_ttft,
        "grpc_tok_s": grpc_tok_s,
        "http_tok_s": http_tok_s,
    }


def plot(result: dict, runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("grpc", "http"):
        xs = sorted(runs[f"{name}_ttft_ms"])
        a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    a.set_xlabel("TTFT (ms, client side)")
    a.set_ylabel("CDF")
    a.legend()
    a.set_title(f"TTFT: HTTP p50 +{result['http_ttft_overhead_ms']:.2f} ms")
    b.bar(["gRPC", "HTTP"], [result["grpc_stream_tok_s"], result["http_stream_tok_s"]])
    b.set_ylabel("tokens/s")
    b.set_title(
        f"{result['concurrency']} streams: HTTP/gRPC {result['http_stream_tok_s_vs_grpc']:.3f}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--requests", type=int, default=40, help="TTFT requests per path")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="streams at once")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds per path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--http-client",
        default="raw",
        choices=["raw", "openai"],
        help="HTTP side: a lean SSE client (what the server adds) or the openai client (what a "
        "user of it sees)",
    )
    ap.add_argument("--plot", default="runs/bench/http.png")
    args = ap.parse_args(argv)
    for name in ("requests", "prompt_tokens", "concurrency", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")

    from model import load_model_info

    load_start = os.getloadavg()[0]
    info = load_model_info(args.model)
    args.model_name = info.name
    say(
        f"{args.model} ({args.dtype}); {os.cpu_count()} CPUs, load average {load_start:.1f}; "
        "starting the cluster (one process per server, the HTTP server included)"
    )
    cluster = start_cluster(args.model, args.dtype, args.threads)
    try:
        say(f"conductor {cluster.address}, HTTP API http://{cluster.http_address}/v1")
        runs = asyncio.run(run(args, cluster.address, cluster.http_address, info.config.vocab_size))
    finally:
        cluster.stop()

    grpc_p50 = statistics.median(runs["grpc_ttft_ms"])
    http_p50 = statistics.median(runs["http_ttft_ms"])
    grpc_tok_s = statistics.median(runs["grpc_tok_s"])
    http_tok_s = statistics.median(runs["http_tok_s"])
    # each round runs both paths back to back: the median of the rounds' own ratios follows the
    # machine's load drift less than the ratio of the two medians
    ratio = statistics.median(h / g for g, h in zip(runs["grpc_tok_s"], runs["http_tok_s"]))
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "http_client": args.http_client,
        "grpc_ttft_p50_ms": round(grpc_p50, 3),
        "http_ttft_p50_ms": round(http_p50, 3),
        "http_ttft_overhead_ms": round(http_p50 - grpc_p50, 3),
        "grpc_stream_tok_s": round(grpc_tok_s, 2),
        "http_stream_tok_s": round(http_tok_s, 2),
        "http_stream_tok_s_vs_grpc": round(ratio, 4),
        "http_stream_tok_s_vs_grpc_of_medians": round(http_tok_s / grpc_tok_s, 4),
        "cpu_count": os.cpu_count(),
    }
    say(
        f"HTTP over gRPC: TTFT p50 {result['http_ttft_overhead_ms']:+.2f} ms (aim <= 5), "
        f"streaming tok/s ratio {result['http_stream_tok_s_vs_grpc']:.3f} (aim >= 0.95)"
    )
    return finish(result, load_start, lambda: plot(result, runs, ROOT / args.plot), args.plot)


if __name__ == "__main__":
    sys.exit(main())
