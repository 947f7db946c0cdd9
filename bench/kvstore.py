"""Store throughput between two processes: put and get of 256 KiB, 1 MiB and 16 MiB values over
the shared-memory path and the gRPC path, beside a plain memcpy and Mooncake's store (TCP), all
measured in this run. Ends with one JSON line.

    .venv/bin/python bench/kvstore.py [--total-mib 64] [--repeats 5] [--mooncake-python PATH]

Mooncake runs from its own venv (default /tmp/mooncake-venv, or $MOONCAKE_PYTHON):
python3 -m venv /tmp/mooncake-venv &&
    /tmp/mooncake-venv/bin/pip install mooncake-transfer-engine-non-cuda numpy
(needs Debian's libibverbs1 and libnuma1). Without it the JSON says why Mooncake was skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore import StoreClient, block_keys  # noqa: E402

FP = "bench-model"
SIZES = {"256k": 256 << 10, "1m": 1 << 20, "16m": 16 << 20}
LAYERS, TOKENS, HEAD_DIM = 8, 16, 128


def block_shape(nbytes: int) -> tuple[int, ...]:
    """A bf16 [L, 2, T, H, D] block of exactly nbytes of payload."""
    heads = nbytes // (LAYERS * 2 * TOKENS * HEAD_DIM * 2)
    return (LAYERS, 2, TOKENS, heads, HEAD_DIM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, repeats: int) -> float:
    """Best seconds of fn() over repeats, after one warm-up: on a machine shared with other work,
    the least disturbed run is the stable estimate (every subject and baseline uses it)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_memcpy(total: int, repeats: int) -> float:
    """One plain single-threaded memcpy of the bytes one call moves (numpy.copyto)."""
    src = np.random.randint(0, 255, total, dtype=np.uint8)
    dst = np.empty_like(src)
    return total / timed(lambda: np.copyto(dst, src), repeats) / 1e9


def bench_store(address: str, transport: str, total: int, repeats: int, tag: int) -> dict:
    out = {}
    with StoreClient(address, transport=transport) as c:
        for name, size in SIZES.items():
            shape = block_shape(size)
            n = max(1, total // size)
            x = torch.randn((n, *shape)).to(torch.bfloat16)
            dst = torch.empty_like(x)
            rounds = iter(range(10**6))

            def put():  # fresh keys each time: a put of held keys writes nothing
                r = next(rounds)
                keys = block_keys(
                    list(range(r * 10**6 + tag, r * 10**6 + tag + n)), 1, f"{FP}-{name}"
                )
                assert c.put(keys, x, FP) == n
                put.keys = keys

            t_put = timed(put, repeats)

            def get():
                assert c.get_into(put.keys, dst) == n

            t_get = timed(get, repeats)
            assert torch.equal(dst, x)
            nbytes = n * x[0].numel() * 2
            out[name] = {
                "put_gbps": nbytes / t_put / 1e9,
                "get_gbps": nbytes / t_get / 1e9,
                "values": n,
            }
            print(
                f"  {transport:4s} {name:>4s}: put {out[name]['put_gbps']:.2f} GB/s, "
                f"get {out[name]['get_gbps']:.2f} GB/s ({n} values per call)",
                flush=True,
            )
    return out


MOONCAKE_DRIVER = r"""
import json, statistics, sys, time
import numpy as np
from mooncake.store import MooncakeDistributedStore
role, master, total, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sizes = json.loads(sys.argv[5])
s = MooncakeDistributedStore()
seg = 3 * total + (256 << 20) if role == "holder" else 0
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", seg, total + (64 << 20), "tcp", "", master)
if rc != 0:
    print(json.dumps({"error": f"setup returned {rc}"}), flush=True); sys.exit(1)
if role == "holder":
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.read()
    sys.exit(0)
def timed(fn):
    fn(); ts = []
    for _ in range(repeats):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return min(ts)
out = {}
buf = np.zeros(total + (1 << 20), dtype=np.uint8)
assert s.register_buffer(buf.ctypes.data, buf.nbytes) == 0
for name, size in sizes.items():
    n = max(1, total // size)
    vals = [np.random.randint(0, 255, size, dtype=np.uint8).tobytes() for _ in range(n)]
    r = [0]
    def put():
        r[0] += 1
        keys = [f"{name}-{r[0]}-{i}" for i in range(n)]
        s.remove_all() if r[0] > 2 else None
        assert s.put_batch(keys, vals) == 0
        put.keys = keys
    t_put = timed(put)
    def get():
        got = s.get_batch(put.keys)
        assert all(len(g) == size for g in got)
    t_get = timed(get)
    ptrs = [buf.ctypes.data + i * size for i in range(n)]
    def get_into():
        res = s.batch_get_into(put.keys, ptrs, [size] * n)
        assert all(x == size for x in res), res
    t_into = timed(get_into)
    assert buf[:size].tobytes() == vals[0]
    nbytes = n * size
    out[name] = {"put_gbps": nbytes / t_put / 1e9, "get_gbps": nbytes / t_get / 1e9,
                 "get_into_gbps": nbytes / t_into / 1e9, "values": n}
print(json.dumps({"results": out}), flush=True)
s.close()
"""


def bench_mooncake(python: str, total: int, repeats: int) -> dict:
    """Mooncake's store over TCP: a master, a holder process with the memory, a client process."""
    if not os.path.exists(python):
        return {"skipped": f"no Mooncake venv at {python} (see this file's docstring)"}
    master_bin = os.path.join(os.path.dirname(python), "mooncake_master")
    if not os.path.exists(master_bin):
        return {"skipped": f"mooncake_master not found beside {python}"}
    with tempfile.TemporaryDirectory() as tmp:
        driver = os.path.join(tmp, "driver.py")
        Path(driver).write_text(MOONCAKE_DRIVER)
        port = free_port()
        log = open(os.path.join(tmp, "master.log"), "w")
        master = subprocess.Popen(
            [master_bin, f"--rpc_port={port}", "--enable_http_metadata_server=false"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        holder = None
        try:
            time.sleep(1.0)
            if master.poll() is not None:
                return {"skipped": "mooncake_master exited at start"}
            args = [f"127.0.0.1:{port}", str(total), str(repeats), json.dumps(SIZES)]
            holder = subprocess.Popen(
                [python, driver, "holder", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            line = holder.stdout.readline()
            if '"ready"' not in line:
                return {
                    "skipped": f"Mooncake holder failed to start: {line.strip() or 'no output'}"
                }
            client = subprocess.run(
                [python, driver, "client", *args], capture_output=True, text=True, timeout=600
            )
            for line in client.stdout.splitlines():
                if line.startswith("{"):
                    rec = json.loads(line)
                    if "results" in rec:
                        for name, r in rec["results"].items():
                            print(
                                f"  mooncake {name:>4s}: put {r['put_gbps']:.2f} GB/s, "
                                f"get {r['get_gbps']:.2f} GB/s, "
                                f"get_into {r['get_into_gbps']:.2f} GB/s",
                                flush=True,
                            )
                        return rec["results"]
                    return {"skipped": rec.get("error", line)}
            return {
                "skipped": f"Mooncake client failed (rc {client.returncode}): "
                f"{client.stderr.strip()[-300:]}"
            }
        except Exception as e:  # any failure of the peer is reported, not fatal
            return {"skipped": f"Mooncake failed: {e}"}
        finally:
            if holder is not None:
                holder.stdin.close()
                holder.wait(timeout=10)
            master.terminate()
            master.wait(timeout=10)
            log.close()


CEILING_SERVER = r"""
import sys
from concurrent import futures
import grpc
payload = b"x" * int(sys.argv[1])
def stream(req, ctx):
    for _ in range(int(req)):
        yield payload
h = grpc.method_handlers_generic_handler("bench.Ceiling", {
    "Stream": grpc.unary_stream_rpc_method_handler(stream, lambda b: b, lambda b: b)})
s = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_send_message_length", 64 << 20)])
s.add_generic_rpc_handlers((h,))
print(s.add_insecure_port("127.0.0.1:0"), flush=True)
s.start()
sys.stdin.read()
"""


def bench_grpc_ceiling(total: int, chunk: int, repeats: int) -> float:
    """GB/s of a bare gRPC stream of `chunk`-byte messages between two processes (no store at
    all)."""
    import grpc

    proc = subprocess.Popen(
        [sys.executable, "-c", CEILING_SERVER, str(chunk)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())
        with grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)]
        ) as ch:
            call = ch.unary_stream(
                "/bench.Ceiling/Stream",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            n = max(1, total // chunk)
            t = timed(
                lambda: sum(len(m) for m in call(str(n).encode(), wait_for_ready=True)), repeats
            )
            return n * chunk / t / 1e9
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


def start_node(total: int, chunk_bytes: int) -> tuple[subprocess.Popen, str]:
    """A store node in its own process; its address."""
    dram = 3 * total + (256 << 20)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "--set",
            "node_id=bench",
            "--set",
            f"dram_bytes={dram}",
            "--set",
            f"model_fingerprint={FP}",
            "--set",
            f"chunk_bytes={chunk_bytes}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    address = proc.stdout.readline().strip()
    if not address:
        raise RuntimeError("store node failed to start")
    return proc, address


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    series = [("shm", results["shm"]), ("grpc", results["grpc"])]
    if "skipped" not in results["mooncake"]:
        series.append(("mooncake tcp", results["mooncake"]))
    width = 0.8 / len(series)
    for ax, op in zip(axes, ("put", "get")):
        for i, (label, r) in enumerate(series):
            # Mooncake's get is the better of its get and its zero-copy get_into, as in the ratios
            ys = [max(r[s][f"{op}_gbps"], r[s].get(f"{op}_into_gbps", 0.0)) for s in SIZES]
            ax.bar([j + i * width for j in range(len(SIZES))], ys, width, label=label)
        ax.axhline(results["memcpy_gbps"], color="k", ls="--", lw=1, label="memcpy")
        ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(SIZES))], list(SIZES))
        ax.set_title(f"{op} between two processes")
        ax.set_xlabel("value size")
    axes[0].set_ylabel("GB/s")
    axes[1].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--total-mib", type=int, default=64, help="bytes moved per call (values of a size per call)"
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--chunk-kib", type=int, default=1024, help="the node's gRPC chunk size")
    p.add_argument("--skip-mooncake", action="store_true")
    p.add_argument(
        "--mooncake-python",
        default=os.environ.get("MOONCAKE_PYTHON", "/tmp/mooncake-venv/bin/python"),
    )
    p.add_argument("--plot", default=str(ROOT / "runs" / "bench_kvstore.png"))
    args = p.parse_args()
    total = args.total_mib << 20
    load = os.getloadavg()[0]
    print(
        f"kvstore bench: {args.total_mib} MiB per call, best of {args.repeats}; "
        f"load average {load:.2f} on {os.cpu_count()} cores",
        flush=True,
    )
    copies = [bench_memcpy(total, args.repeats)]
    print(f"  memcpy: {copies[-1]:.2f} GB/s", flush=True)
    proc, address = start_node(total, args.chunk_kib << 10)
    try:
        shm = bench_store(address, "shm", total, args.repeats, tag=0)
        copies.append(bench_memcpy(total, args.repeats))
        print(f"  memcpy: {copies[-1]:.2f} GB/s", flush=True)
        grpc_ = bench_store(address, "grpc", total, args.repeats, tag=500_000)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    memcpy = max(copies)
    ceiling = bench_grpc_ceiling(total, args.chunk_kib << 10, args.repeats)
    print(f"  bare gRPC stream of {args.chunk_kib} KiB messages: {ceiling:.2f} GB/s", flush=True)
    mooncake = (
        {"skipped": "--skip-mooncake"}
        if args.skip_mooncake
        else bench_mooncake(args.mooncake_python, total, args.repeats)
    )
    results = {"memcpy_gbps": memcpy, "shm": shm, "grpc": grpc_, "mooncake": mooncake}
    summary = {
        "bench": "kvstore",
        "total_mib_per_call": args.total_mib,
        "load_average": round(load, 2),
        "memcpy_gbps": round(memcpy, 3),
        # the headline ratios: the least favourable size for shm, the named size for gRPC
        "shm_get_vs_memcpy": round(min(shm[s]["get_gbps"] for s in SIZES) / memcpy, 3),
        "shm_put_vs_memcpy": round(min(shm[s]["put_gbps"] for s in SIZES) / memcpy, 3),
    }
    for s in SIZES:
        summary[f"shm_get_vs_memcpy_{s}"] = round(shm[s]["get_gbps"] / memcpy, 3)
    # what gRPC in Python can carry here at all: the gRPC path's ceiling
    summary["grpc_bare_stream_gbps"] = round(ceiling, 3)
    for s in SIZES:
        summary[f"grpc_get_vs_bare_stream_{s}"] = round(grpc_[s]["get_gbps"] / ceiling, 3)
    if "skipped" in mooncake:
        summary["mooncake"] = "skipped: " + mooncake["skipped"]
        for s in ("1m", "16m"):
            summary[f"grpc_get_vs_mooncake_{s}"] = None
    else:
        for s in SIZES:
            # against Mooncake's better get path (its zero-copy get_into, mostly) ...
            best = max(mooncake[s]["get_gbps"], mooncake[s]["get_into_gbps"])
            summary[f"grpc_get_vs_mooncake_{s}"] = round(grpc_[s]["get_gbps"] / best, 3)
            # ... and against its plain get, which returns a new bytes object as ours fills a tensor
            summary[f"grpc_get_vs_mooncake_get_{s}"] = round(
                grpc_[s]["get_gbps"] / mooncake[s]["get_gbps"], 3
            )
            summary[f"grpc_put_vs_mooncake_{s}"] = round(
                grpc_[s]["put_gbps"] / mooncake[s]["put_gbps"], 3
            )
            summary[f"shm_get_vs_mooncake_{s}"] = round(shm[s]["get_gbps"] / best, 3)
    summary["gbps"] = {k: v for k, v in results.items() if k != "memcpy_gbps"}
    try:
        plot(results, Path(args.plot))
        summary["plot"] = args.plot
        print(f"  plot: {args.plot}", flush=True)
    except Exception as e:
        print(f"  (no plot: {e})", flush=True)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
