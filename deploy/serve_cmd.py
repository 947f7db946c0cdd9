"""`halfmoon serve`: start the cluster, print the conductor's address, stop everything on
Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from deploy.config import load_cluster_config
from deploy.launcher import Cluster


def run(args: argparse.Namespace) -> int:
    cfg = load_cluster_config(args.config, args.set, args.ray_address)
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

    cluster = Cluster(
        cfg, log=lambda m: print(m, file=sys.stderr, flush=True), on_ray_ready=reclaim_signals
    )
    try:
        address = cluster.start()
        print(address, flush=True)  # stdout carries the address alone, for scripts
        print(
            f"halfmoon serving at {address} (export HALFMOON_ADDRESS={address}); "
            "Ctrl-C stops the cluster",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        for s in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        print("stopping the cluster...", file=sys.stderr, flush=True)
        cluster.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        print("stopped", file=sys.stderr, flush=True)
    return 0
