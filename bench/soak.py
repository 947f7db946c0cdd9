"""Soak: a trace replayed against a local cluster (store node, 2 prefill and 2 decode workers,
conductor, each in a process of its own) for --minutes, with a worker killed (SIGKILL) and
restarted on its port every --kill-every-s seconds, the Redis index stopped and restarted once,
and one burst of ten times the conductor's capacity. Every request must either complete, exactly
(greedy outputs are checked against model.Engine afterwards), or end with a clear error (a status
with a message); a worker lost under a request that still completes counts as resumed.

Through the run: health checks of every server and Load of every worker, several a second (their
latency, and its p99 during the burst), and each server process's resident memory against its
budget: what it is configured to hold (weights, KV pool, DRAM slab) plus RUNTIME_BYTES for the
interpreter, torch, gRPC and their threads. The store's slab counts in the store's RSS only: the
workers map it too (shared memory) and leave it out of theirs. Progress every --progress-s
seconds; a PNG of RSS over time; the last line is one JSON object (lost_streams, wrong_outputs,
max_rss_vs_budget, p99_health_ms_under_overload, counts, CPU flags and load).

    .venv/bin/python bench/soak.py [--minutes 30] [--trace client/data/...jsonl]
        [--model smollm2-135m] [--kill-every-s 120]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.server_memory import configured_bytes  # noqa: E402
from bench.soak_faults import Faults  # noqa: E402

# What a server process holds beyond its configured bytes: the interpreter, torch and its
# libraries, gRPC, the tokenizer, threads and in-flight messages (330-500 MiB measured idle here).
RUNTIME_BYTES = 768 << 20
CONDUCTOR_SLOTS = 32  # Generate streams at once: the burst is ten times this
REQUEST_TIMEOUT_S = 300.0  # a client deadline: reaching it means a stream hung (lost)
VERIFY_BATCH = 16  # prompts Engine generates at once when answers are checked


def say(*a) -> None:
    print(*a, flush=True)


class Soak:
    """The cluster, the traffic, the faults and the measurements of one run."""

    def __init__(self, args, lm, prompts):
        self.args, self.lm, self.prompts = args, lm, prompts
        self.t0 = 0.0
        self.lock = threading.Lock()
        self.outcomes: list[dict] = []  # one per request sent
        self.events: list[tuple[float, str]] = []  # (s since start, what happened)
        self.probes: list[tuple[float, float, bool]] = []  # (s, latency ms, answered)
        self.rss: dict[str, list[tuple[float, int]]] = {}  # server -> (s, bytes)
        self.pids: dict[str, int] = {}  # server -> pid: Faults puts a restarted worker's here
        self.burst_window = (0.0, 0.0)
        self.quit = threading.Event()

    # ---- the cluster ----

    def start(self) -> None:
        from deploy import LocalCluster, cluster_config_from_dict
        from model import kv_fingerprint
        from servekit import kv_cache_layout
        from servekit.worker import torch_dtype

        a = self.args
        workers = {"num_blocks": a.num_blocks, "torch_threads": 1}
        cfg = cluster_config_from_dict(
            {
                "model": a.model,
                "dtype": a.dtype,
                "prefill_workers": 2,
                "decode_workers": 2,
                "store": {"dram_bytes": 256 << 20, "heartbeat_s": 0.5},
                "prefill": dict(workers),
                "decode": {**workers, "max_batch": 16},
                "conductor": {"load_poll_s": 0.1, "grpc_workers": CONDUCTOR_SLOTS},
            }
        )
        layout = kv_cache_layout(self.lm.config, cfg.conductor, torch_dtype(cfg.dtype))
        fingerprint = kv_fingerprint(self.lm.weights_id, layout)
        cfg.store = dataclasses.replace(cfg.store, model_fingerprint=fingerprint)
        self.cluster = LocalCluster(cfg, processes=True)
        self.cluster.start()
        self.servers = {s.name: s for s in self.cluster.servers}
        self.pids = {name: s.pid for name, s in self.servers.items()}
        self.faults = Faults(self.cluster, self.pids, self.note, self.now, self.quit)
        self.budget = self._budgets()

    def _budgets(self) -> dict[str, int]:
        """Each server's budget: its configured bytes (as it reports them) + RUNTIME_BYTES."""
        with self._channel(self.cluster.address) as ch:
            configured = configured_bytes(self._conductor_stub(ch), timeout=30)
        return {name: configured.get(name, 0) + RUNTIME_BYTES for name in self.servers}

    def stop(self) -> None:
        self.faults.stop()
        self.cluster.stop()

    @staticmethod
    def _pb():
        from protos import halfmoon_pb2

        return halfmoon_pb2

    @staticmethod
    def _conductor_stub(channel):
        from protos import halfmoon_pb2_grpc

        return halfmoon_pb2_grpc.ConductorStub(channel)

    @staticmethod
    def _channel(address: str):
        import grpc

        return grpc.insecure_channel(address)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, what: str) -> None:
        with self.lock:
            self.events.append((self.now(), what))
        say(f"[{self.now():7.1f} s] {what}")

    # ---- traffic ----

    def one(self, prompt, kind: str, max_tokens: int) -> dict:
        """Send one request and classify how it ended."""
        import grpc

        pb = self._pb()
        req = pb.GenerateRequest(
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            request_id=f"soak-{kind}-{prompt.index}-{time.monotonic_ns()}",
        )
        req.token_ids.ids.extend(prompt.token_ids)
        out = {"kind": kind, "prompt": prompt.index, "max_tokens": max_tokens, "tokens": []}
        sent = time.monotonic()
        reason, usage = "", None
        try:
            for msg in self.stub.Generate(req, timeout=REQUEST_TIMEOUT_S):
                out["tokens"].extend(msg.token_ids)
                if msg.finished:
                    reason, usage = msg.finish_reason, msg.usage
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            out["error"] = f"{code.name}: {details}"
            unhandled = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
            hung = code == grpc.StatusCode.DEADLINE_EXCEEDED
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details:
                out["status"] = "rejected"
            elif code in unhandled or hung or not details:
                out["status"] = "lost"
            else:
                out["status"] = "failed"
        else:
            if reason in ("length", "stop"):
                out["status"] = "ok"
                out["resumed"] = bool(usage.worker_failures)
            elif reason:  # error / cancelled: said in the final message
                out["status"], out["error"] = "failed", f"finish_reason={reason}"
            else:
                out["status"], out["error"] = "lost", "stream ended without a final message"
        out["s"] = time.monotonic() - sent
        with self.lock:
            self.outcomes.append(out)
        return out

    def burst(self) -> None:
        """Ten times the conductor's capacity at once; short answers."""
        n = 10 * CONDUCTOR_SLOTS
        self.note(f"burst of {n} requests")
        start = self.now()
        with ThreadPoolExecutor(max_workers=n) as pool:
            futures = [
                pool.submit(self.one, self.prompts[i % len(self.prompts)], "burst", 8)
                for i in range(n)
            ]
            ends = [f.result() for f in futures]
        self.burst_window = (start, self.now())
        refused = sum(o["status"] == "rejected" for o in ends)
        self.note(f"burst over in {self.now() - start:.1f} s: {refused} of {n} refused early")

    # ---- measurements ----

    def probe(self) -> None:
        """Health of every server and Load of every worker, round after round."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from protos import halfmoon_pb2_grpc

        pb = self._pb()
        channels = {name: self._channel(s.address) for name, s in self.servers.items()}
        calls = []
        for name, ch in channels.items():
            health = health_pb2_grpc.HealthStub(ch)
            calls.append(lambda h=health: h.Check(health_pb2.HealthCheckRequest(), timeout=5))
            role = self.servers[name].role
            if role in ("prefill", "decode"):
                stub_cls = getattr(halfmoon_pb2_grpc, f"{role.capitalize()}WorkerStub")
                stub = stub_cls(ch)
                calls.append(lambda s=stub: s.Load(pb.LoadRequest(), timeout=5))
        while not self.quit.wait(0.1):
            for call in calls:
                t = time.perf_counter()
                try:
                    call()
                    ok = True
                except grpc.RpcError:
                    ok = False  # a killed worker: not a latency
                with self.lock:
                    self.probes.append((self.now(), (time.perf_counter() - t) * 1000.0, ok))
        for ch in channels.values():
            ch.close()

    def sample_memory(self) -> None:
        """Each server's resident bytes every second. A worker's leave out the store's slab it
        maps (the store's RSS holds those pages; counted in every mapper, one slab would count
        five times)."""
        import psutil

        from servekit import resident_without_shared_memory

        while not self.quit.wait(1.0):
            for name, pid in list(self.pids.items()):
                try:
                    proc = psutil.Process(pid)
                    gone = proc.status() == psutil.STATUS_ZOMBIE
                    if gone:
                        rss = math.nan
                    elif self.servers[name].role == "store":
                        rss = proc.memory_info().rss
                    else:
                        rss = resident_without_shared_memory(pid)
                except psutil.Error:
                    rss = math.nan  # killed, not restarted yet: a gap in its line
                with self.lock:
                    self.rss.setdefault(name, []).append((self.now(), rss))

    def peak_rss(self) -> dict[str, float]:
        """Each server's highest resident bytes so far (its restarts included)."""
        return {
            n: max(v for _, v in s if not math.isnan(v))
            for n, s in self.rss.items()
            if any(not math.isnan(v) for _, v in s)
        }

    def progress(self) -> None:
        while not self.quit.wait(self.args.progress_s):
            say(f"[{self.now():7.1f} s] {self.summary_line()}")

    def summary_line(self) -> str:
        with self.lock:
            counts = {k: 0 for k in ("ok", "rejected", "failed", "lost")}
            for o in self.outcomes:
                counts[o["status"]] += 1
            resumed = sum(o.get("resumed", False) for o in self.outcomes)
            peak = self.peak_rss()
        ratio = max((peak[n] / self.budget[n] for n in peak), default=0.0)
        return (
            f"served {counts['ok']} (resumed {resumed}), rejected {counts['rejected']}, "
            f"failed with a clear error {counts['failed']}, lost {counts['lost']}; "
            f"peak RSS / budget {ratio:.2f}"
        )

    # ---- the run ----

    def run(self) -> None:
        a = self.args
        total_s = a.minutes * 60.0
        self.stub = self._conductor_stub(self._channel(self.cluster.address))
        self.t0 = time.monotonic()
        threads = [
            threading.Thread(target=f, daemon=True)
            for f in (self.probe, self.sample_memory, self.progress)
        ]
        chaos = threading.Thread(
            target=self.faults.chaos, args=(total_s, a.kill_every_s, self.burst), daemon=True
        )
        for t in (*threads, chaos):
            t.start()
        span = max(p.arrival_s for p in self.prompts) + 1.0  # the trace loops past its end
        with ThreadPoolExecutor(max_workers=a.max_in_flight) as pool:
            lap, i = 0, 0
            while True:
                p = self.prompts[i]
                at = lap * span + p.arrival_s
                if at >= total_s:
                    break
                wait = at - self.now()
                if wait > 0:
                    time.sleep(wait)
                pool.submit(self.one, p, "trace", p.max_tokens)
                i += 1
                if i == len(self.prompts):
                    lap, i = lap + 1, 0
            self.note("traffic over; waiting for the requests in flight")
            chaos.join(timeout=REQUEST_TIMEOUT_S)
        self.quit.set()
        for t in threads:
            t.join(timeout=10)


def verify_answers(lm, prompts, outcomes: list[dict], verify_max: int) -> tuple[int, int]:
    """(outputs checked, wrong ones): completed answers against Engine, greedy, at most
    `verify_max` of them (0: all)."""
    from model import Engine, SamplingParams

    engine = Engine(lm, block_size=16)
    by_index = {p.index: p for p in prompts}
    done = [o for o in outcomes if o["status"] == "ok"]
    # every step-th answer: at most verify_max of them, spread over the run
    step = -(-len(done) // verify_max) if verify_max else 1
    chosen = done[::step]
    keys = sorted({(o["prompt"], o["max_tokens"]) for o in chosen})
    want: dict[tuple[int, int], list[int]] = {}
    t0 = time.perf_counter()
    for i in range(0, len(keys), VERIFY_BATCH):  # a batch at a time, progress between
        part = keys[i : i + VERIFY_BATCH]
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in part]
        outs = engine.generate_batch([by_index[p].token_ids for p, _ in part], params)
        want.update(zip(part, outs))
        say(f"  {len(want)}/{len(keys)} prompts generated ({time.perf_counter() - t0:.0f} s)")
    wrong = 0
    for o in chosen:
        if o["tokens"] != want[(o["prompt"], o["max_tokens"])]:
            wrong += 1
            say(f"wrong output: prompt {o['prompt']} ({len(o['tokens'])} tokens)")
    return len(chosen), wrong


def plot_rss(soak: Soak, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, series in sorted(soak.rss.items()):
        ax.plot([t for t, _ in series], [b / 2**20 for _, b in series], label=name)
    for t, what in soak.events:
        if what.startswith("killed"):
            ax.axvline(t, color="tab:red", ls="--", lw=0.8)
        elif what.startswith("index (Redis) stopped"):
            ax.axvline(t, color="tab:blue", ls=":", lw=1.2)
    if soak.burst_window[1] > soak.burst_window[0]:
        ax.axvspan(*soak.burst_window, color="tab:orange", alpha=0.2, label="burst (10x)")
    ax.set_xlabel("s (red dashes: a worker killed; blue dots: the index stopped)")
    ax.set_ylabel("resident MiB (workers: less the store's slab)")
    ax.set_title(f"halfmoon soak: RSS of each server over {soak.args.minutes:g} min")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))] if values else float("nan")


def main(argv=None) -> int:
    from client.traces import SHIPPED_TRACE

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--trace", default=str(SHIPPED_TRACE), help="Mooncake JSONL or Azure CSV")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-blocks", type=int, default=512, help="each worker's KV pool")
    ap.add_argument("--kill-every-s", type=float, default=120.0)
    ap.add_argument("--length-scale", type=float, default=1 / 32, help="one block per hash id")
    ap.add_argument("--time-scale", type=float, default=2.0, help="x the trace's gaps")
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--max-in-flight", type=int, default=256, help="client threads")
    ap.add_argument("--verify-max", type=int, default=200, help="answers checked (0 = all)")
    ap.add_argument("--progress-s", type=float, default=10.0)
    ap.add_argument("--plot", default="runs/bench/soak.png")
    args = ap.parse_args(argv)

    from bench.machine import cpu_flags, finish
    from client.synth import Scaling, make_prompts
    from client.traces import load_trace
    from model import load_model

    flags, load_start = cpu_flags(), os.getloadavg()[0]
    say(
        f"soak: {args.minutes:g} min of {args.trace} on {args.model} ({args.dtype}); "
        f"{os.cpu_count()} CPUs, load average {load_start:.1f}"
    )
    lm = load_model(args.model, dtype=args.dtype)
    scaling = Scaling(args.length_scale, args.time_scale, args.max_output, args.max_input)
    prompts = make_prompts(load_trace(args.trace), scaling, lm.config.vocab_size)
    soak = Soak(args, lm, prompts)
    say("starting the cluster: store, 2 prefill and 2 decode workers, conductor (a process each)")
    soak.start()
    try:
        soak.run()
    finally:
        soak.stop()
    say(f"[{soak.now():7.1f} s] {soak.summary_line()}")
    say("checking the completed answers against Engine (greedy)")
    checked, wrong = verify_answers(lm, prompts, soak.outcomes, args.verify_max)

    outcomes = soak.outcomes
    lo, hi = soak.burst_window
    answered = [(t, ms) for t, ms, ok in soak.probes if ok]
    peak = soak.peak_rss()
    result = {
        "minutes": args.minutes,
        "model": args.model,
        "dtype": args.dtype,
        "trace": Path(args.trace).name,
        "requests": len(outcomes),
        "served": sum(o["status"] == "ok" for o in outcomes),
        "resumed": sum(o.get("resumed", False) for o in outcomes),
        "rejected": sum(o["status"] == "rejected" for o in outcomes),
        "failed_clear": sum(o["status"] == "failed" for o in outcomes),
        "lost_streams": sum(o["status"] == "lost" for o in outcomes),
        "verified": checked,
        "wrong_outputs": wrong,
        "max_rss_vs_budget": round(max(peak[n] / soak.budget[n] for n in peak), 3),
        "peak_rss_mb": {n: round(v / 2**20) for n, v in sorted(peak.items())},
        "p99_health_ms_under_overload": round(p99([ms for t, ms in answered if lo <= t <= hi]), 2),
        "p99_health_ms": round(p99([ms for _, ms in answered]), 2),
        "kills": sum(w.startswith("killed") for _, w in soak.events),
        "index_restarts": sum(w.startswith("index (Redis) restarted") for _, w in soak.events),
        "cpu_flags": flags,
    }
    for o in outcomes:
        if o["status"] in ("failed", "lost"):
            say(f"{o['status']}: {o['kind']} prompt {o['prompt']}: {o.get('error', '')[:160]}")
    return finish(result, load_start, lambda: plot_rss(soak, ROOT / args.plot), args.plot)


if __name__ == "__main__":
    sys.exit(main())
