"""Fetching a long cached prefix across a real link against recomputing it, on hosts made of
network namespaces (deploy.netns; needs root): TTFT when a prefill worker on host B pulls the
prefix from host A's store over a link `tc` shapes to each --gbps speed, against TTFT when it
computes the whole prompt; and the choice the conductor's Mooncake policy makes for that request
(given the same link speed as its transfer bandwidth), scored against whichever was faster.

The cluster is the real one: `ray start` on three hosts (head; prefill hosts A and B, each with
a store node and a prefill worker), `halfmoon serve --config deploy/configs/multinode.yaml` from
the head. Each measurement is one Prefill RPC (its wall time is the TTFT the worker gives) on a
prompt of --context cached tokens + --suffix new ones; each repeat uses its own cache salt, so
host B never holds the prefix before it fetches it. The final line is one JSON object.

    .venv/bin/python bench/multihost.py [--context 1024 --gbps 0.5,1,5 --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deploy.hosts import HostCluster, HostSpec  # noqa: E402
from deploy.netns import netns_problem  # noqa: E402

HOSTS = (HostSpec("head"), HostSpec("hosta", {"prefill": 1.0}), HostSpec("hostb", {"prefill": 1.0}))


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=1024, help="cached prompt tokens")
    ap.add_argument("--suffix", type=int, default=16, help="new prompt tokens after the prefix")
    ap.add_argument("--gbps", default="0.5,1,5", help="link speeds, Gbit/s")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    problem = netns_problem()
    if problem:
        say(f"bench/multihost.py: cannot make hosts here: {problem}")
        return 2
    rates = [float(x) for x in args.gbps.split(",") if x.strip()]
    if not rates or min(rates) <= 0:
        say(f"--gbps: expected positive speeds, got {args.gbps!r}")
        return 2

    import grpc

    from conductor import ClusterState, DecodeCandidate, PrefillCandidate, RequestInfo, make_policy
    from protos import halfmoon_pb2 as pb
    from protos import halfmoon_pb2_grpc as pb_grpc

    hc = HostCluster(HOSTS, log=say)
    try:
        hc.start()
        served = hc.serve(
            [
                f"model={args.model}",
                "dtype=float32",
                "prefill_workers=2",
                "decode_workers=1",
                "http_port=0",
                "placement.worker_num_cpus=0",
                "placement.gpus_per_worker=0",
                "store.dram_bytes=536870912",
                f"store.ssd_dir={hc.work_dir}/ssd/{{node_id}}",
                "store.ssd_bytes=1073741824",
                "prefill.num_blocks=512",
                "prefill.device_cache=false",
                "decode.num_blocks=256",
                "conductor.port=0",
            ]
        )
        with grpc.insecure_channel(served.address) as ch:
            status = pb_grpc.ConductorStub(ch).Status(pb.StatusRequest(), timeout=30)
        ip_host = {h.ip: h for h in hc.hosts.hosts.values()}

        def host_of(address: str):
            return ip_host[address.rsplit(":", 1)[0]]

        workers = {
            host_of(w.address).name: w.address for w in status.workers if w.kind == "prefill"
        }
        stores = {host_of(s.address).name: s.node_id for s in status.stores}
        say(f"prefill workers {workers}, stores {stores}")
        rng = random.Random(0)
        vocab = status.vocab_size or 32000
        prefix = [rng.randrange(100, vocab - 1) for _ in range(args.context)]
        prompt = prefix + [rng.randrange(100, vocab - 1) for _ in range(args.suffix)]
        block_size = status.block_size
        n_blocks = args.context // block_size

        def prefill(host: str, salt: str, **extra) -> tuple[float, pb.PrefillReply]:
            with grpc.insecure_channel(workers[host]) as ch:
                req = pb.PrefillRequest(
                    token_ids=prompt,
                    sampling=pb.SamplingParams(max_tokens=1),
                    cache_salt=salt,
                    **extra,
                )
                t0 = time.perf_counter()
                reply = pb_grpc.PrefillWorkerStub(ch).Prefill(req, timeout=600)
                return (time.perf_counter() - t0) * 1000.0, reply

        prefill("hosta", "warm")  # first forward of each worker: allocations, kernel builds
        prefill("hostb", "warm-b")
        rows = []
        for rate in rates:
            for host in ("hosta", "hostb"):
                hc.hosts.shape(hc.hosts[host], rate_gbit=rate, delay_ms=1.0)
            fetch_ms, recompute_ms, bytes_moved = [], [], 0
            for r in range(args.repeats):
                salt = f"{rate}-{r}"
                ms, reply = prefill("hosta", salt)  # host A computes it all: the recompute time
                assert reply.computed_tokens == len(prompt), reply
                recompute_ms.append(ms)
                ms, reply = prefill(
                    "hostb", salt, fetch_from=stores["hosta"], fetch_blocks=n_blocks
                )
                assert reply.cached_remote_tokens == n_blocks * block_size, reply
                fetch_ms.append(ms)
            block_bytes = _block_bytes(status)
            bytes_moved = n_blocks * block_bytes
            # what the policy decides for host B's request, with this link as its bandwidth
            policy = make_policy("mooncake", transfer_mb_per_ms=rate / 8.0, reject=False)
            recompute = statistics.median(recompute_ms)
            coef = (0.0, recompute / len(prompt), 0.0)  # the worker's measured cost per token
            state = ClusterState(
                prefill=[PrefillCandidate("prefill-b", (stores["hostb"],), 0.0, coef)],
                decode=[DecodeCandidate("decode-0", 0, 1024, 1024, 0, (1.0, 0.0, 0.0))],
                matches={stores["hosta"]: n_blocks},
                block_size=block_size,
                block_bytes=block_bytes,
            )
            decision = policy.choose(RequestInfo(len(prompt), 1, 0.0, 0.0), state)
            fetch = statistics.median(fetch_ms)
            row = {
                "gbps": rate,
                "fetch_ttft_ms": round(fetch, 1),
                "recompute_ttft_ms": round(recompute, 1),
                "prefix_mb": round(bytes_moved / 1e6, 2),
                "wire_ms": round(bytes_moved * 8 / (rate * 1e9) * 1000, 1),
                "policy_fetches": bool(decision.fetch_from),
                "policy_predicted_ttft_ms": round(decision.predicted_ttft_ms, 1),
                "faster": "fetch" if fetch < recompute else "recompute",
            }
            rows.append(row)
            say(json.dumps(row))
        for host in ("hosta", "hostb"):
            hc.hosts.shape(hc.hosts[host])
    finally:
        hc.stop()

    say(f"{'Gbit/s':>7} {'fetch ms':>9} {'recompute':>10} {'wire ms':>8} {'policy':>9} faster")
    for row in rows:
        choice = "fetch" if row["policy_fetches"] else "recompute"
        say(
            f"{row['gbps']:>7g} {row['fetch_ttft_ms']:>9.1f} {row['recompute_ttft_ms']:>10.1f} "
            f"{row['wire_ms']:>8.1f} {choice:>9} {row['faster']}"
        )
    correct = [
        (row["policy_fetches"] and row["faster"] == "fetch")
        or (not row["policy_fetches"] and row["faster"] == "recompute")
        for row in rows
    ]
    out = {
        "model": args.model,
        "context_tokens": args.context,
        "rows": rows,
        "policy_choice_correct": round(sum(correct) / len(correct), 3),
    }
    for row in rows:
        key = f"remote_fetch_vs_recompute_{row['gbps']:g}gbps".replace(".", "_")
        out[key] = round(row["fetch_ttft_ms"] / row["recompute_ttft_ms"], 3)
    print(json.dumps(out), flush=True)
    return 0


def _block_bytes(status) -> int:
    """Bytes of one full-precision fp32 block of the served model (from its config)."""
    from model import load_model_info

    info = load_model_info(status.model)
    c = info.config
    return c.num_layers * 2 * status.block_size * c.num_kv_heads * c.head_dim * 4


if __name__ == "__main__":
    sys.exit(main())
