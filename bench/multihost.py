"""Fetching a cached prefix across a real link against recomputing it, on hosts made of network
namespaces (deploy.netns; needs root), and whether the conductor's Mooncake policy picks the
faster of the two from what it can know: the link as the prefill worker's own fetches measured it.

The cluster is the real one: `ray start` on three hosts (head; hosts A and B, each with a store
node and a prefill worker), `halfmoon serve --config deploy/configs/multinode.yaml` from the head.
The link out of host A is shaped to each --gbps speed (a tbf rate; no netem delay where the
kernel lacks netem, which the JSON says). At each speed, host B's worker first fetches two warm-up
prefixes from A, so that it has measured the link; then for each prefix length (--context) and
repeat, with a cache salt of its own (B never holds the prefix before it fetches it):
- recompute: A prefills the whole prompt (its TTFT, one Prefill RPC's wall time);
- the policy's choice for B: MooncakePolicy on B's Load report as the conductor reads it (its
  fitted prefill model, its queue, the bytes a block moves at the store's codec, and its measured
  link to A's store), the index saying A's store holds the prefix;
- fetch: B prefills the prompt, fetching the prefix from A's store (its TTFT).
A case is correct when the policy fetches exactly when fetching measured faster. Speeds go from
the fastest down, so that each is measured by fetches over it, never by ones over a faster link.

    .venv/bin/python bench/multihost.py [--context 256,512,1024 --gbps 0.02,0.5,1,5 --repeats 1]
        [--transports tcp,grpc]

The final line is one JSON object: `remote_fetch_vs_recompute_5gbps` (fetch TTFT / recompute TTFT
at 5 Gbit/s, longest prefix; aim < 1) and `policy_choice_correct` (aim >= 0.9), with every case.
--gbps 0 adds the link unshaped (`..._unshaped`). With --transports tcp,grpc the cases run on two
clusters, one moving blocks across hosts over the stores' bulk port and one over gRPC, and
`bulk_vs_grpc_fetch_ms_<speed>` is the ratio of their median fetch times (the worker's own
measure) at the longest prefix.
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
WARM_TOKENS = (256, 128)  # the warm-up prefixes B fetches at each speed before its cases


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) <= 0:
        raise SystemExit(f"{what}: expected positive integers, got {text!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", default="256,512,1024", help="cached prefix lengths, tokens")
    ap.add_argument("--suffix", type=int, default=16, help="new prompt tokens after the prefix")
    # 0.02: a link where recomputing wins clearly, so the score weighs both choices (at 0.05
    # the two are within a few percent of each other for SmolLM2 on this CPU: a coin toss)
    ap.add_argument(
        "--gbps", default="0.02,0.5,1,5", help="link speeds, Gbit/s (0: the link unshaped)"
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--transports",
        default="tcp",
        help="how blocks cross hosts, one cluster each: tcp (the stores' bulk port, as a "
        "cluster runs) and/or grpc (the bulk port off); with both, the JSON compares them",
    )
    args = ap.parse_args(argv)
    problem = netns_problem()
    if problem:
        say(f"bench/multihost.py: cannot make hosts here: {problem}")
        return 2
    try:
        rates = sorted({float(x) for x in args.gbps.split(",") if x.strip()}, reverse=True)
    except ValueError:
        rates = []
    if not rates or min(rates) < 0:
        say(f"--gbps: expected speeds >= 0, got {args.gbps!r}")
        return 2
    rates = [r for r in rates if r == 0] + [r for r in rates if r > 0]  # unshaped is fastest
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not transports or set(transports) - {"tcp", "grpc"}:
        say(f"--transports: expected tcp and/or grpc, got {args.transports!r}")
        return 2
    contexts = _ints(args.context, "--context")

    import grpc

    from conductor import (
        ClusterState,
        DecodeCandidate,
        Link,
        PrefillCandidate,
        RequestInfo,
        make_policy,
    )
    from protos import halfmoon_pb2 as pb
    from protos import halfmoon_pb2_grpc as pb_grpc

    def run(transport: str) -> tuple[list[dict], bool]:
        """The cases on a fresh cluster whose store nodes move blocks across hosts over
        `transport` ("tcp": the bulk port, what a cluster uses; "grpc": the bulk port off)."""
        hc = HostCluster(HOSTS, log=say)
        rows, netem = [], True
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
                    "store.dram_bytes=536870912",  # within each host's 1 GiB /dev/shm
                    f"store.ssd_dir={hc.work_dir}/ssd/{{node_id}}",
                    "store.ssd_bytes=1073741824",
                    "prefill.num_blocks=512",
                    "prefill.device_cache=false",
                    "decode.num_blocks=256",
                    "conductor.port=0",
                    *(["store.bulk_port=-1"] if transport == "grpc" else []),
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
            bs = status.block_size

            def tokens(n: int) -> list[int]:
                return [rng.randrange(100, vocab - 1) for _ in range(n)]

            def prefill(host: str, prompt: list[int], salt: str, **extra):
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

            def load(host: str) -> pb.WorkerLoad:
                with grpc.insecure_channel(workers[host]) as ch:
                    return pb_grpc.PrefillWorkerStub(ch).Load(pb.LoadRequest(), timeout=30)

            def choice(ld: pb.WorkerLoad, prompt_tokens: int, prefix_blocks: int):
                """What the conductor's policy decides for this request, given B's report (as the
                conductor builds its candidate, without its measured/predicted correction)."""
                b = PrefillCandidate(
                    ld.worker_id,
                    tuple(ld.nodes),
                    ld.predicted_queue_ms,
                    tuple(ld.prefill_coef),
                    True,
                    ld.fetch_block_bytes,
                    ld.queued_tokens,
                    tuple(Link(x.node, x.fixed_ms, x.bytes_per_ms) for x in ld.links),
                )
                state = ClusterState(
                    prefill=[b],
                    decode=[DecodeCandidate("decode-0", 0, 4096, 4096, 0, (1.0, 0.0, 0.0))],
                    matches={stores["hosta"]: prefix_blocks},
                    block_size=bs,
                    block_bytes=ld.block_bytes,
                )
                policy = make_policy("mooncake", reject=False)
                return policy.choose(RequestInfo(prompt_tokens, 1, 0.0, 0.0), state)

            prefill("hosta", tokens(64), "warm")  # first forward of each worker: allocations
            prefill("hostb", tokens(64), "warm-b")
            for rate in rates:
                shape = hc.hosts.shape(
                    hc.hosts["hosta"], rate_gbit=rate, delay_ms=1.0 if rate else 0.0,
                    direction="out",
                )  # fmt: skip
                netem = netem and (shape.delay_ms > 0 or not rate)
                for i, n in enumerate(WARM_TOKENS):  # B measures the link it now is
                    warm = tokens(n + args.suffix)
                    prefill("hosta", warm, f"warm-{rate}-{i}")
                    _, r = prefill(
                        "hostb",
                        warm,
                        f"warm-{rate}-{i}",
                        fetch_from=stores["hosta"],
                        fetch_blocks=n // bs,
                    )
                    say(
                        f"{rate:g} Gbit/s warm-up: {r.fetched_bytes / 1e6:.1f} MB in "
                        f"{r.fetch_ms:.0f} ms ({r.fetched_bytes * 8 / r.fetch_ms / 1e6:.2f} Gbit/s)"
                    )
                for context in contexts:
                    n_blocks = context // bs
                    for rep in range(args.repeats):
                        salt = f"{rate}-{context}-{rep}"
                        prompt = tokens(n_blocks * bs + args.suffix)
                        recompute_ms, r = prefill("hosta", prompt, salt)
                        assert r.computed_tokens == len(prompt), r
                        ld = load("hostb")
                        d = choice(ld, len(prompt), n_blocks)
                        link = next((x for x in ld.links if x.node == stores["hosta"]), None)
                        fetch_ms, r = prefill(
                            "hostb", prompt, salt, fetch_from=stores["hosta"], fetch_blocks=n_blocks
                        )
                        assert r.cached_remote_tokens == n_blocks * bs, r
                        row = {
                            "transport": transport,
                            "gbps": rate,
                            "prefix_tokens": n_blocks * bs,
                            "fetch_ttft_ms": round(fetch_ms, 1),
                            "recompute_ttft_ms": round(recompute_ms, 1),
                            "prefix_mb": round(r.fetched_bytes / 1e6, 2),
                            "fetch_ms": round(r.fetch_ms, 1),
                            "wire_ms": round(r.fetched_bytes * 8 / (rate * 1e9) * 1000, 1)
                            if rate
                            else 0.0,
                            "link_gbps_measured": round(link.bytes_per_ms * 8 / 1e6, 3)
                            if link
                            else 0,
                            "policy_fetches": bool(d.fetch_from),
                            "policy_predicted_ttft_ms": round(d.predicted_ttft_ms, 1),
                            "policy_assumed_link": bool(d.assumed_link),
                            "faster": "fetch" if fetch_ms < recompute_ms else "recompute",
                        }
                        rows.append(row)
                        say(json.dumps(row))
            hc.hosts.shape(hc.hosts["hosta"])
        finally:
            hc.stop()

        return rows, netem

    rows, netem = [], True
    for transport in transports:
        got, shaped = run(transport)
        rows += got
        netem = netem and shaped

    say(
        f"{'path':>5} {'Gbit/s':>7} {'prefix':>6} {'fetch ms':>9} {'recompute':>10} "
        f"{'wire ms':>8} {'measured':>9} {'policy':>9} faster"
    )
    for row in rows:
        pick = "fetch" if row["policy_fetches"] else "recompute"
        say(
            f"{row['transport']:>5} {row['gbps']:>7g} {row['prefix_tokens']:>6} "
            f"{row['fetch_ttft_ms']:>9.1f} {row['recompute_ttft_ms']:>10.1f} "
            f"{row['wire_ms']:>8.1f} {row['link_gbps_measured']:>9.3f} {pick:>9} {row['faster']}"
        )
    correct = [row["policy_fetches"] == (row["faster"] == "fetch") for row in rows]
    out = {
        "model": args.model,
        "prefix_tokens": contexts,
        "transports": transports,
        "netem_delay": netem,  # False: this kernel has no netem, the links are rate-shaped only
        "policy_choice_correct": round(sum(correct) / len(correct), 3),
        "policy_assumed_links": sum(row["policy_assumed_link"] for row in rows),
    }
    longest = max(row["prefix_tokens"] for row in rows)

    def at(transport: str, rate: float) -> list[dict]:
        return [
            row for row in rows
            if row["transport"] == transport and row["gbps"] == rate
            and row["prefix_tokens"] == longest
        ]  # fmt: skip

    for rate in rates:
        speed = f"{rate:g}gbps".replace(".", "_") if rate else "unshaped"
        for transport in transports:
            tag = "" if transport == "tcp" else f"{transport}_"
            ratio = statistics.median(
                r["fetch_ttft_ms"] / r["recompute_ttft_ms"] for r in at(transport, rate)
            )
            out[f"{tag}remote_fetch_vs_recompute_{speed}"] = round(ratio, 3)
        if len(transports) == 2:  # the same fetches over the bulk port and over gRPC
            tcp, rpc = at("tcp", rate), at("grpc", rate)
            out[f"bulk_vs_grpc_fetch_ms_{speed}"] = round(
                statistics.median(r["fetch_ms"] for r in tcp)
                / statistics.median(r["fetch_ms"] for r in rpc),
                3,
            )
    out["rows"] = rows
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
