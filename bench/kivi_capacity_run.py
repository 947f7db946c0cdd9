"""One setting of bench/kivi_capacity.py on a local cluster of its own (store node, prefill
worker, decode worker, conductor: one process each): the cluster started at the setting's KV cache
dtype and decode pool, the warm-up, the burst of requests through the conductor, and the decode
worker's Prometheus metrics sampled through it; the setting's figures as one dict.
"""

from __future__ import annotations

import random
import socket
import statistics
import threading
import time
import urllib.request

SETTINGS = ("fp", "kivi4", "kivi2")  # fp: full precision, kv_cache_dtype --fp-kv-cache-dtype
PREFIX = {"fp": "fp", "kivi4": "kivi4", "kivi2": "kivi2"}


def kv_cache_dtype(setting: str, args) -> str:
    """The servers' kv_cache_dtype in this setting."""
    return args.fp_kv_cache_dtype if setting == "fp" else setting


def say(*a) -> None:
    print(*a, flush=True)


def free_port() -> int:
    """A local TCP port nothing listens on now (for the decode worker's metrics)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(args, setting: str, budget: int, max_batch: int, metrics_port: int, dram: int):
    from deploy import LocalCluster, cluster_config_from_dict

    t = args.threads
    cfg = cluster_config_from_dict(
        {
            "model": args.model,
            "dtype": args.dtype,
            "block_size": args.block_size,
            "kv_cache_dtype": kv_cache_dtype(setting, args),
            "kivi_group_size": args.kivi_group_size,
            "kivi_residual": args.kivi_residual,
            "kivi_window_dtype": args.kivi_window_dtype,
            "store": {"dram_bytes": dram},
            # no device tier: every prompt's blocks go to the store, the decode worker pulls them
            "prefill": {
                "num_blocks": 1024,
                "chunk_size": 512,
                "device_cache": False,
                "torch_threads": t,
            },
            "decode": {
                "kv_cache_bytes": budget,
                "max_batch": max_batch,
                "torch_threads": t,
                "metrics_port": metrics_port,
                "publish": False,  # answers are not reused here: keep the store out of the run
            },
            # no early rejection: the decode worker's memory, not the SLOs, limits the batch
            # prompts queue behind each other's prefill for minutes: long deadlines
            "conductor": {
                "load_poll_s": 0.05,
                "ttft_slo_ms": 0,
                "tbt_slo_ms": 0,
                "load_timeout_s": 30.0,
                "prefill_timeout_s": 3600.0,
                "decode_timeout_s": 3600.0,
            },
        }
    )
    cluster = LocalCluster(cfg, processes=True)
    cluster.start()
    return cluster


def scrape(port: int) -> dict[str, float]:
    """The decode worker's counters this benchmark reads, from its Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {
        "halfmoon_decode_step_seconds_sum": "step_s",
        "halfmoon_decode_step_seconds_count": "steps",
        "halfmoon_decode_batch_size_sum": "batch_sum",
        "halfmoon_decode_batch_size_count": "batch_n",
        "halfmoon_decode_tokens_total": "tokens",
        "halfmoon_decode_recomputed_tokens_total": "recomputed",
    }
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = dict.fromkeys(want.values(), 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in want:
                out[want[s.name]] = s.value
    return out


def step_at_batch(samples: list[dict], batch: int) -> tuple[float | None, int]:
    """(mean step ms over the scrape intervals whose every step carried `batch` sequences,
    steps counted)."""
    step_s, steps = 0.0, 0
    for a, b in zip(samples, samples[1:]):
        n = b["batch_n"] - a["batch_n"]
        if n <= 0 or b["steps"] - a["steps"] != n:
            continue
        if (b["batch_sum"] - a["batch_sum"]) / n >= batch - 1e-6:
            step_s += b["step_s"] - a["step_s"]
            steps += int(n)
    return (step_s / steps * 1000.0 if steps else None), steps


def run_setting(args, setting: str, prompts: list, budget: int, max_batch: int, dram: int):
    import grpc

    from protos import halfmoon_pb2 as pb
    from protos import halfmoon_pb2_grpc as pb_grpc

    name = PREFIX[setting]
    port = free_port()
    say(f"{name}: starting the store node, the workers and the conductor (one process each)")
    t_start = time.perf_counter()
    cluster = start_cluster(args, setting, budget, max_batch, port, dram)
    say(f"{name}: cluster up in {time.perf_counter() - t_start:.0f} s at {cluster.address}")
    channel = grpc.insecure_channel(cluster.address)
    decode_addr = next(s.address for s in cluster.servers if s.role == "decode")
    dchannel = grpc.insecure_channel(decode_addr)
    try:
        stub = pb_grpc.ConductorStub(channel)
        dstub = pb_grpc.DecodeWorkerStub(dchannel)
        salt = f"kivi-capacity-{setting}-{time.time_ns()}"
        got: list[dict | None] = [None] * len(prompts)
        counts = [0] * len(prompts)

        def one(i: int, ids: list[int], max_tokens: int, t0: float) -> dict:
            req = pb.GenerateRequest(
                sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                cache_salt=salt,
            )
            req.token_ids.ids.extend(ids)
            first = last = None
            n, usage = 0, None
            for msg in stub.Generate(req, timeout=3600):
                if msg.token_ids:
                    last = time.perf_counter() - t0
                    first = last if first is None else first
                    n += len(msg.token_ids)
                    if i >= 0:
                        counts[i] = n
                if msg.HasField("usage"):
                    usage = msg.usage
            return {"first": first, "last": last, "n": n, "usage": usage}

        say(f"{name}: warming up (first forward passes)")
        rng = random.Random(1)
        for _ in range(2):
            warm = [rng.randrange(100, args.vocab - 100) for _ in range(2 * args.block_size + 3)]
            one(-1, warm, 4, time.perf_counter())
        if args.shared_prefix:  # the shared prefix's blocks in the store before the burst
            say(f"{name}: caching the {len(args.shared_prefix)}-token shared prefix")
            one(-1, args.shared_prefix + warm[:3], 2, time.perf_counter())

        samples: list[dict] = []
        done = threading.Event()
        load = dstub.Load(pb.LoadRequest(), timeout=10)

        def monitor(t0: float) -> None:
            last_say = 0.0
            while not done.is_set():
                try:
                    s = scrape(port)
                    ld = dstub.Load(pb.LoadRequest(), timeout=5)
                except Exception:  # noqa: BLE001 - a missed sample is only a gap
                    done.wait(0.25)
                    continue
                now = time.perf_counter() - t0
                s.update(t=now, running=ld.running, waiting=ld.waiting)
                samples.append(s)
                if now - last_say >= args.progress_s:
                    last_say = now
                    finished = sum(1 for g in got if g is not None)
                    say(
                        f"{name}: {now:6.1f} s  {sum(counts):5d}/{len(prompts) * args.new_tokens}"
                        f" tokens  running {ld.running:3d}  waiting {ld.waiting:3d}  "
                        f"done {finished}/{len(prompts)}"
                    )
                done.wait(0.25)

        before = scrape(port)
        barrier = threading.Barrier(len(prompts) + 1)
        errors: list[str] = []

        def worker(i: int) -> None:
            barrier.wait()
            try:
                got[i] = one(i, prompts[i], args.new_tokens, t0_box[0])
            except grpc.RpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}")
                got[i] = {"first": None, "last": None, "n": 0, "usage": None}

        t0_box = [0.0]
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        t0_box[0] = time.perf_counter()
        barrier.wait()
        mon = threading.Thread(target=monitor, args=(t0_box[0],), daemon=True)
        mon.start()
        for t in threads:
            t.join()
        done.set()
        mon.join()
        after = scrape(port)
        samples.append({**after, "t": time.perf_counter() - t0_box[0], "running": 0, "waiting": 0})
        load = dstub.Load(pb.LoadRequest(), timeout=10)
    finally:
        channel.close()
        dchannel.close()
        cluster.stop()
    if errors:
        say(f"{name}: {len(errors)} request(s) failed, first: {errors[0]}")

    ok = [g for g in got if g["usage"] is not None]
    tokens = sum(g["n"] for g in got)
    wall = max((g["last"] for g in got if g["last"] is not None), default=float("nan"))
    reached = max((g["usage"].max_decode_batch for g in ok), default=0)
    batch = max(reached, load.max_batch_seen)
    step_ms, step_n = step_at_batch(samples, batch)
    step_s = after["step_s"] - before["step_s"]
    dec_tokens = after["tokens"] - before["tokens"]
    out = {
        "max_batch_config": max_batch,
        "capacity_tokens": load.capacity_tokens,
        "pool_blocks": load.total_blocks,
        "block_bytes": load.block_bytes,
        "max_batch": batch,
        "max_decode_batch_usage": reached,
        "max_batch_seen_load": load.max_batch_seen,
        "tokens": tokens,
        "requests_ok": len(ok),
        "wall_s": round(wall, 2),
        "decode_tok_s": tokens / wall if wall == wall and wall > 0 else 0.0,
        "step_ms_at_max_batch": round(step_ms, 2) if step_ms is not None else None,
        "steps_at_max_batch": step_n,
        # tokens per second of decode step time (the decode worker's own rate, prefill aside)
        "step_tok_s": dec_tokens / step_s if step_s > 0 else 0.0,
        "decode_steps": int(after["steps"] - before["steps"]),
        "decode_coef": [round(c, 5) for c in load.decode_coef],
        "recomputed_tokens": int(after["recomputed"] - before["recomputed"]),
        "ttft_p50_ms": round(statistics.median(g["first"] for g in ok) * 1000.0, 1) if ok else None,
        "tbt_mean_ms": round(statistics.fmean(g["usage"].tbt_mean_ms for g in ok), 2)
        if ok
        else None,
    }
    say(
        f"{name}: {tokens} tokens in {wall:.1f} s = {out['decode_tok_s']:.1f} tok/s; "
        f"largest decode batch {batch} (capacity {load.capacity_tokens} tokens, "
        f"step {out['step_ms_at_max_batch']} ms at batch {batch}, "
        f"recomputed {out['recomputed_tokens']})"
    )
    return out
