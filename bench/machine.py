"""What every benchmark records about the machine it ran on, and how it times a call."""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from collections.abc import Callable

from servekit.machine import cpu_flags


def free_port() -> int:
    """A port nothing listens on now: fixed ports would clash with another cluster on the host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_s(fn, repeats: int, warmup: bool = True) -> float:
    """Median wall seconds of `repeats` calls of fn (after one untimed call when `warmup`): this
    machine is shared and noisy, so medians, not means."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def finish(result: dict, load_start: float, draw: Callable[[], None] | None = None, png="") -> int:
    """The tail every benchmark ends with: the machine (its CPU flags, the load when the run began
    and now) into `result`, the PNG drawn by `draw` (a failure to draw is said, not raised: the
    figures matter more than the picture), then `result` as the last line, one JSON object.
    Returns 0, the exit status of a run that got this far."""
    result.setdefault("cpu_flags", cpu_flags())
    result["load_average_start"] = round(load_start, 2)
    result["load_average"] = round(os.getloadavg()[0], 2)
    if draw is not None:
        try:
            draw()
            print(f"plot: {png}", flush=True)
        except Exception as exc:  # noqa: BLE001 - see above
            print(f"plot failed: {exc}", flush=True)
    print(json.dumps(result), flush=True)
    return 0
