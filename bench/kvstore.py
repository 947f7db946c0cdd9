"""Store throughput between two processes: put and get of 256 KiB, 1 MiB and 16 MiB values over
the shared-memory path, the bulk port (TCP: what other hosts use) and the gRPC path, beside a plain
memcpy and Mooncake's store (TCP), all measured in this run. Ends with one JSON line.

    .venv/bin/python bench/kvstore.py [--total-mib 64] [--repeats 7] [--mooncake-python PATH]

Every figure is the median of --repeats timed calls after one untimed warm-up, and every system is
timed the same way: one call moves --total-mib MiB as a batch of values of one size (Mooncake's
batch API), and whatever a put needs to start from an empty store (halfmoon's Clear, Mooncake's
remove_all) and fresh keys happens outside the timed call. Store rates count value bytes once
(`put_gbps`, `get_gbps`). A copy reads and writes its bytes, so copy bandwidth is counted both ways
(`memcpy_rw_gbps`), and the shared-memory path, one copy per value, is put beside it on the same
convention (`put_rw_gbps`, `get_rw_gbps`, twice its value rate). Mooncake's put is the better of
its put_batch and its zero-copy batch_put_from, its get the better of get_batch and
batch_get_into. The JSON records the load average at start and end, the CPU pressure and the CPU
flags: on a shared machine the figures compare only at like load.

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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.kernels import cpu_pressure  # noqa: E402
from bench.machine import cpu_flags  # noqa: E402
from kvstore import block_keys  # noqa: E402
from kvstore.client import StoreClient  # noqa: E402

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


def call_times(fn, repeats: int, setup=None) -> list[float]:
    """Seconds of `repeats` calls of fn() after one untimed warm-up; setup() runs untimed before
    each call. Every subject and baseline here is timed through this (Mooncake's driver has its
    twin)."""
    if setup is not None:
        setup()
    fn()
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def timed(fn, repeats: int, setup=None) -> float:
    """Median seconds of fn() (see call_times): the machine is shared, so medians, not bests."""
    return statistics.median(call_times(fn, repeats, setup))


def memcpy_times(total: int, repeats: int) -> list[float]:
    """Seconds of plain single-threaded memcpys (numpy.copyto) of the bytes one call moves."""
    src = np.random.randint(0, 255, total, dtype=np.uint8)
    dst = np.empty_like(src)
    return call_times(lambda: np.copyto(dst, src), repeats)


def bench_store(address: str, transport: str, total: int, repeats: int, tag: int) -> dict:
    out = {}
    with StoreClient(address, transport=transport) as c:
        for name, size in SIZES.items():
            shape = block_shape(size)
            n = max(1, total // size)
            x = torch.randn((n, *shape)).to(torch.bfloat16)
            dst = torch.empty_like(x)
            rounds = iter(range(10**6))

            def empty_store():  # untimed: fresh keys (a put of held keys writes nothing), no
                r = next(rounds)  # eviction inside the timed put (Mooncake's run does the same)
                c.clear()
                put.keys = block_keys(
                    list(range(r * 10**6 + tag, r * 10**6 + tag + n)), 1, f"{FP}-{name}"
                )

            def put():
                assert c.put(put.keys, x, FP) == n

            t_put = timed(put, repeats, setup=empty_store)

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
            if transport == "shm":  # one copy per value: read and write, as memcpy_rw_gbps
                out[name]["put_rw_gbps"] = 2 * out[name]["put_gbps"]
                out[name]["get_rw_gbps"] = 2 * out[name]["get_gbps"]
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
def timed(fn, setup=None):  # bench/kvstore.py's timed: median after one warm-up, setup untimed
    setup() if setup else None
    fn(); ts = []
    for _ in range(repeats):
        setup() if setup else None
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)
out = {}
buf = np.zeros(total + (1 << 20), dtype=np.uint8)
assert s.register_buffer(buf.ctypes.data, buf.nbytes) == 0
for name, size in sizes.items():
    n = max(1, total // size)
    vals = [np.random.randint(0, 255, size, dtype=np.uint8).tobytes() for _ in range(n)]
    ptrs = [buf.ctypes.data + i * size for i in range(n)]
    r = [0]
    def empty_store():
        r[0] += 1
        s.remove_all(True)
        put.keys = [f"{name}-{r[0]}-{i}" for i in range(n)]
    def put():
        assert s.put_batch(put.keys, vals) == 0
    t_put = timed(put, empty_store)
    def stage():  # batch_put_from sends from the registered buffer: the values go there first
        empty_store()
        for i, v in enumerate(vals):
            buf[i * size : (i + 1) * size] = np.frombuffer(v, dtype=np.uint8)
    def put_from():
        res = s.batch_put_from(put.keys, ptrs, [size] * n)
        assert all(x == 0 for x in res), res
    t_put_from = timed(put_from, stage)
    def get():
        got = s.get_batch(put.keys)
        assert all(len(g) == size for g in got)
    t_get = timed(get)
    buf[:] = 0
    def get_into():
        res = s.batch_get_into(put.keys, ptrs, [size] * n)
        assert all(x == size for x in res), res
    t_into = timed(get_into)
    assert buf[:size].tobytes() == vals[0]
    nbytes = n * size
    out[name] = {"put_gbps": nbytes / t_put / 1e9, "put_from_gbps": nbytes / t_put_from / 1e9,
                 "get_gbps": nbytes / t_get / 1e9, "get_into_gbps": nbytes / t_into / 1e9,
                 "values": n}
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
        holder_err = open(os.path.join(tmp, "holder.err"), "w+")
        try:
            time.sleep(1.0)
            if master.poll() is not None:
                return {"skipped": "mooncake_master exited at start"}
            args = [f"127.0.0.1:{port}", str(total), str(repeats), json.dumps(SIZES)]
            holder = subprocess.Popen(
                [python, driver, "holder", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=holder_err,
                text=True,
            )
            line = holder.stdout.readline()
            if '"ready"' not in line:
                holder.wait(timeout=10)
                holder_err.seek(0)  # its last words (a missing module, a refused setup)
                err = (holder_err.read().strip().splitlines() or ["no output"])[-1]
                return {"skipped": f"Mooncake holder failed to start: {line.strip() or err}"}
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
                                f"put_from {r['put_from_gbps']:.2f} GB/s, "
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
            holder_err.close()


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
    series = [("shm", results["shm"]), ("tcp", results["tcp"]), ("grpc", results["grpc"])]
    if "skipped" not in results["mooncake"]:
        series.append(("mooncake tcp", results["mooncake"]))
    width = 0.8 / len(series)
    for ax, op in zip(axes, ("put", "get")):
        for i, (label, r) in enumerate(series):
            # Mooncake's best path (get_into, put_from where faster), as in the ratios
            ys = [
                max(
                    r[s][f"{op}_gbps"],
                    r[s].get(f"{op}_into_gbps", 0.0),
                    r[s].get(f"{op}_from_gbps", 0.0),
                )
                for s in SIZES
            ]
            ax.bar([j + i * width for j in range(len(SIZES))], ys, width, label=label)
        # the copy as a value rate (bytes once), the scale of the bars
        ax.axhline(results["memcpy_rw_gbps"] / 2, color="k", ls="--", lw=1, label="memcpy")
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
    if args.repeats < 3:
        print("--repeats must be at least 3 (figures are medians)", file=sys.stderr)
        return 2
    total = args.total_mib << 20
    load_start = os.getloadavg()
    print(
        f"kvstore bench: {args.total_mib} MiB per call, median of {args.repeats}; "
        f"load average {load_start[0]:.2f} on {os.cpu_count()} cores",
        flush=True,
    )
    # memcpy beside each store run; the baseline is the median of all its calls
    copies = memcpy_times(total, args.repeats)
    print(f"  memcpy: {2 * total / statistics.median(copies) / 1e9:.2f} GB/s (read+write)")
    proc, address = start_node(total, args.chunk_kib << 10)
    try:
        shm = bench_store(address, "shm", total, args.repeats, tag=0)
        copies += memcpy_times(total, args.repeats)
        print(f"  memcpy: {2 * total / statistics.median(copies) / 1e9:.2f} GB/s (read+write)")
        tcp = bench_store(address, "tcp", total, args.repeats, tag=250_000)
        grpc_ = bench_store(address, "grpc", total, args.repeats, tag=500_000)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    memcpy_rw = 2 * total / statistics.median(copies) / 1e9
    ceiling = bench_grpc_ceiling(total, args.chunk_kib << 10, args.repeats)
    print(f"  bare gRPC stream of {args.chunk_kib} KiB messages: {ceiling:.2f} GB/s", flush=True)
    mooncake = (
        {"skipped": "--skip-mooncake"}
        if args.skip_mooncake
        else bench_mooncake(args.mooncake_python, total, args.repeats)
    )
    results = {
        "memcpy_rw_gbps": memcpy_rw, "shm": shm, "tcp": tcp, "grpc": grpc_, "mooncake": mooncake
    }
    summary = {
        "bench": "kvstore",
        "total_mib_per_call": args.total_mib,
        "repeats": args.repeats,
        "statistic": "median",
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "cpu_pressure_avg60": cpu_pressure(),
        "cpus": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "memcpy_rw_gbps": round(memcpy_rw, 3),
        # shm against memcpy, both counted read+write: the least favourable size, then each size
        "shm_get_vs_memcpy": round(min(shm[s]["get_rw_gbps"] for s in SIZES) / memcpy_rw, 3),
        "shm_put_vs_memcpy": round(min(shm[s]["put_rw_gbps"] for s in SIZES) / memcpy_rw, 3),
    }
    for s in SIZES:
        summary[f"shm_get_vs_memcpy_{s}"] = round(shm[s]["get_rw_gbps"] / memcpy_rw, 3)
        summary[f"shm_put_vs_memcpy_{s}"] = round(shm[s]["put_rw_gbps"] / memcpy_rw, 3)
    # what gRPC in Python can carry here at all: the gRPC path's ceiling
    summary["grpc_bare_stream_gbps"] = round(ceiling, 3)
    for s in SIZES:
        summary[f"grpc_get_vs_bare_stream_{s}"] = round(grpc_[s]["get_gbps"] / ceiling, 3)
        summary[f"tcp_get_vs_grpc_{s}"] = round(tcp[s]["get_gbps"] / grpc_[s]["get_gbps"], 3)
        summary[f"tcp_put_vs_grpc_{s}"] = round(tcp[s]["put_gbps"] / grpc_[s]["put_gbps"], 3)
    if "skipped" in mooncake:
        summary["mooncake"] = "skipped: " + mooncake["skipped"]
        for s in ("1m", "16m"):
            for path in ("tcp", "grpc"):
                summary[f"{path}_get_vs_mooncake_{s}"] = None
                summary[f"{path}_put_vs_mooncake_{s}"] = None
    else:
        for s in SIZES:
            m = mooncake[s]
            # against Mooncake's better path each way (zero-copy get_into / put_from, mostly) ...
            best_get = max(m["get_gbps"], m["get_into_gbps"])
            best_put = max(m["put_gbps"], m["put_from_gbps"])
            # the bulk port is what a worker on another host uses; gRPC is the fallback
            summary[f"tcp_get_vs_mooncake_{s}"] = round(tcp[s]["get_gbps"] / best_get, 3)
            summary[f"tcp_put_vs_mooncake_{s}"] = round(tcp[s]["put_gbps"] / best_put, 3)
            summary[f"grpc_get_vs_mooncake_{s}"] = round(grpc_[s]["get_gbps"] / best_get, 3)
            summary[f"grpc_put_vs_mooncake_{s}"] = round(grpc_[s]["put_gbps"] / best_put, 3)
            # ... and against its plain get/put, which take and return Python bytes
            summary[f"grpc_get_vs_mooncake_get_{s}"] = round(
                grpc_[s]["get_gbps"] / m["get_gbps"], 3
            )
            summary[f"grpc_put_vs_mooncake_put_{s}"] = round(
                grpc_[s]["put_gbps"] / m["put_gbps"], 3
            )
            summary[f"shm_get_vs_mooncake_{s}"] = round(shm[s]["get_gbps"] / best_get, 3)
    summary["gbps"] = {k: v for k, v in results.items() if k != "memcpy_rw_gbps"}
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
