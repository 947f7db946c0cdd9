"""`halfmoon demo` (`make demo`): a local cluster on SmolLM2, one streamed chat answer, a trace
replay per policy."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from client import SHIPPED_TRACE, Client, Scaling, block_tokens, parse_policies, replay_trace
from deploy.config import load_cluster_config
from deploy.launcher import Cluster

CHAT = (
    "In two sentences, why does reusing a cached prompt prefix make a language model answer sooner?"
)

# The shipped trace, fitted to 2 CPU cores: a 512-token trace block becomes 8 tokens (two make one
# KV block), answers are capped, and arrivals are stretched so that the slice loads the cluster
# without drowning it. The first 60 requests are the shortest slice from the start with some prefix
# reuse (62 of 1,533 trace blocks repeat; none do in the first 40).
DEMO_LIMIT = 60
DEMO_SCALING = Scaling(length_scale=8 / 512, time_scale=4.0, max_output=16, max_input=2048)
DEMO_TTFT_SLO_MS = 5000.0
DEMO_TBT_SLO_MS = 500.0
# Two runs per policy, in alternating order (mooncake then cache_off, then the other way round):
# each policy runs once on the cluster as the other left it. Two policies keep it within ~5 min.
DEMO_REPEATS = 2


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    cfg = load_cluster_config(args.config, getattr(args, "set", []))
    trace = Path(args.trace) if getattr(args, "trace", None) else SHIPPED_TRACE
    if not trace.is_file():
        raise FileNotFoundError(f"no trace at {trace}")
    scaling = DEMO_SCALING._replace(
        **{
            k: v
            for k, v in (
                ("length_scale", getattr(args, "length_scale", None)),
                ("time_scale", getattr(args, "time_scale", None)),
                ("max_output", getattr(args, "max_output", None)),
            )
            if v is not None
        }
    )
    policies = parse_policies(getattr(args, "policies", "mooncake,cache_off"), "")
    repeats = getattr(args, "repeats", DEMO_REPEATS) or DEMO_REPEATS
    limit = args.limit or DEMO_LIMIT

    say(
        f"== 1/3 starting a local cluster ({cfg.model}, {cfg.prefill_workers} prefill + "
        f"{cfg.decode_workers} decode)"
    )
    with Cluster(cfg, log=say) as cluster:
        say(f"\n== 2/3 one chat answer, streamed from {cluster.address}\n> {CHAT}")
        with Client(cluster.address) as c:
            last = None
            for chunk in c.generate_stream(
                messages=[{"role": "user", "content": CHAT}], max_tokens=64
            ):
                print(chunk.text, end="", flush=True)
                last = chunk
            print(flush=True)
            if last is not None and last.usage is not None:
                u = last.usage
                say(
                    f"[{u.completion_tokens} tokens; TTFT {u.ttft_ms:.0f} ms, "
                    f"mean TBT {u.tbt_mean_ms:.0f} ms; {u.prefill_worker} -> {u.decode_worker}]"
                )

        say(
            f"\n== 3/3 replaying the first {limit} requests of {trace.name} {repeats}x per policy "
            f"({', '.join(policies)}, alternating; each run from a cleared cache after the same "
            f"warm-up): a {scaling.trace_block_tokens}-token trace block becomes "
            f"{block_tokens(scaling)} tokens, inter-arrival times x{scaling.time_scale:g}, "
            f"answers <= {scaling.max_output} tokens"
        )
        result = replay_trace(
            cluster.address,
            trace,
            limit=limit,
            scaling=scaling,
            policies=policies,
            ttft_slo_ms=DEMO_TTFT_SLO_MS,
            tbt_slo_ms=DEMO_TBT_SLO_MS,
            output_dir=getattr(args, "output", "runs/demo"),
            repeats=repeats,
        )
        print()
        print(result.table)
        print(f"\nrecords and report: {result.output_dir}/   TTFT/TBT CDFs: {result.png}")
        say("\nstopping the cluster...")
    say(f"demo done in {time.monotonic() - t0:.0f} s")
    return 0
