"""`halfmoon serve`: start the cluster, print the conductor's address (and the HTTP API's), stop
everything on Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from deploy.config import load_cluster_config
from deploy.launcher import Cluster
from deploy.wiring import write_prometheus_targets

# `--metrics` with no metrics_base_port configured: Prometheus ports from here, one per server
DEFAULT_METRICS_BASE_PORT = 9100
# where `--metrics` writes the scrape targets: deploy/prometheus/prometheus.yml reads this folder
DEFAULT_TARGETS_FILE = Path(__file__).resolve().parent / "prometheus" / "targets" / "halfmoon.json"


def run(args: argparse.Namespace) -> int:
    overrides = list(args.set)
    http_port = getattr(args, "http_port", None)
    if http_port is not None:
        overrides.append(f"http_port={http_port}")
    cfg = load_cluster_config(args.config, overrides, args.ray_address)
    targets_file = getattr(args, "metrics", None)
    if targets_file is not None and not cfg.metrics_base_port:
        cfg.metrics_base_port = DEFAULT_METRICS_BASE_PORT
    stop = threading.Event()

    def on_signal(signum, frame):  # noqa: ARG001
        stop.set()
        raise KeyboardInterrupt  # also interrupts a start still in progress

    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, on_signal) for s in signals}

    def reclaim_signals() -> None:
        # ray.init installs a C-level handler that dies on SIGTERM; ours must stay in charge
        for s in signals:
            signal.signal(s, on_signal)

    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    cluster = Cluster(cfg, log=say, on_ray_ready=reclaim_signals)
    try:
        address = cluster.start()
        # stdout carries the addresses alone, for scripts: the conductor's first, then the HTTP
        # API's base URL when it runs
        print(address, flush=True)
        if cluster.http_address:
            print(f"http://{cluster.http_address}/v1", flush=True)
        say(
            f"halfmoon serving at {address} (export HALFMOON_ADDRESS={address}); "
            "Ctrl-C stops the cluster"
        )
        if cluster.http_address:
            say(f"OpenAI-compatible API at http://{cluster.http_address}/v1")
        if targets_file is not None:
            report_targets(cluster, targets_file, say)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        for s in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        say("stopping the cluster...")
        cluster.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        say("stopped")
    return 0


def report_targets(cluster: Cluster, targets_file: str, say) -> None:
    """Print every server's Prometheus endpoint and write them as a file_sd target list."""
    servers = cluster.servers + ([cluster.http_server] if cluster.http_server else [])
    say("Prometheus scrape targets (GET /metrics):")
    for s in servers:
        if s.metrics:
            say(f"  {s.role:<10} {s.name:<12} {s.metrics}")
    path = write_prometheus_targets(servers, targets_file or DEFAULT_TARGETS_FILE)
    say(f"targets written to {path} (prometheus --config.file=deploy/prometheus/prometheus.yml)")
