"""The faults bench/soak.py makes in its cluster: a worker killed (SIGKILL) and restarted on its
port, the Redis index stopped and restarted, and the burst, on a plan spread over the run.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable

DOWN_S = 3.0  # how long a killed worker (or the index) stays away before it is restarted
RESTART_TIMEOUT_S = 300.0  # a killed worker loads its model again: long on a loaded machine


class Faults:
    """Kills and restarts in one deploy.LocalCluster. `pids` (server name -> pid) is the soak's
    own dict, updated here when a worker comes back, so that its memory sampler follows the new
    process; `note` records an event, `now` is the run's clock and `quit_event` ends the plan
    early."""

    def __init__(
        self,
        cluster,
        pids: dict[str, int],
        note: Callable[[str], None],
        now: Callable[[], float],
        quit_event: threading.Event,
    ) -> None:
        self.cluster = cluster
        self.servers = {s.name: s for s in cluster.servers}
        self.pids = pids
        self.note, self.now, self.quit = note, now, quit_event
        self.restarted: list = []  # deploy.ServerProcess: workers started again

    def stop(self) -> None:
        """Stop the workers started again (the cluster stops its own)."""
        for r in self.restarted:
            r.stop()

    def kill_and_restart(self, name: str) -> None:
        from deploy import ServerProcess, Wiring

        info = self.servers[name]
        os.kill(self.pids[name], signal.SIGKILL)
        self.note(f"killed {name} (pid {self.pids[name]})")
        if self.quit.wait(DOWN_S):
            return
        cluster = self.cluster
        store = next(s for s in cluster.servers if s.role == "store")
        cfg = Wiring(cluster.cfg, cluster.redis_url).worker(info.role, name, store, "127.0.0.1")
        cfg = dataclasses.replace(cfg, port=int(info.address.rsplit(":", 1)[1]))
        server = ServerProcess(info.role, cfg, RESTART_TIMEOUT_S)
        self.restarted.append(server)
        self.pids[name] = server.proc.pid
        self.note(f"restarted {name} at {server.address} (pid {server.proc.pid})")

    def restart_redis(self) -> None:
        redis = self.cluster.redis
        if redis is None:
            self.note("index restart skipped: REDIS_URL names a Redis this run does not own")
            return
        redis.kill()
        self.note("index (Redis) stopped")
        if not self.quit.wait(DOWN_S):
            redis.restart()
            self.note("index (Redis) restarted, empty: the stores republish what they hold")

    def chaos(self, total_s: float, kill_every_s: float, burst: Callable[[], None]) -> None:
        """Kills round the workers every kill_every_s; the index restart and the burst between."""
        every = max(10.0, min(kill_every_s, total_s / 4))
        victims = ["decode-0", "prefill-0", "decode-1", "prefill-1"]
        plan = [(every * (i + 1), "kill", victims[i % 4]) for i in range(int(total_s // every))]
        plan += [(0.4 * total_s, "redis", ""), (0.7 * total_s, "burst", "")]
        for at, what, name in sorted(p for p in plan if p[0] < total_s):
            if self.quit.wait(max(0.0, at - self.now())):
                return
            try:
                if what == "kill":
                    self.kill_and_restart(name)
                elif what == "redis":
                    self.restart_redis()
                else:
                    burst()
            except Exception as exc:  # noqa: BLE001 - a fault the bench failed to make: say so
                self.note(f"{what} {name} failed: {exc!r}")
