"""The memory of a local cluster's server processes: each process's peak RSS and PSS
(MemorySampler, over the processes cluster_pids names), as bench/e2e.py reports them, and what each
server is configured to hold (weights, pools, in-memory tiers) from the conductor's Status, which
bench/e2e.py sets those peaks beside and bench/soak.py budgets each server's RSS by.
"""

from __future__ import annotations


class MemorySampler:
    """Peak RSS and PSS of each server process. RSS's peak is the kernel's own high-water mark
    (VmHWM: exact, and free to read); PSS has none, so it is sampled at the ends of workloads,
    not from a thread during them: reading a process's smaps walks its page tables under its
    mmap lock, which stalled the servers' own allocations and added up to 0.5 s to a cold TTFT.
    """

    def __init__(self, pids: dict[str, int]):
        import psutil

        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.rss = dict.fromkeys(self.procs, 0)
        self.pss = dict.fromkeys(self.procs, 0)

    def sample(self) -> None:
        for name, proc in self.procs.items():
            try:
                m = proc.memory_full_info()
                hwm = _status_kib(proc.pid, "VmHWM") * 1024
            except Exception:  # noqa: BLE001 - a server that ended is no longer sampled
                continue
            self.rss[name] = max(self.rss[name], m.rss, hwm)
            self.pss[name] = max(self.pss[name], getattr(m, "pss", m.uss))


def cluster_pids(cluster) -> dict[str, int]:
    """The cluster's processes by name: its servers, and the forkserver they were forked from
    (deploy.local), whose share of the pages they inherited from it is the cluster's too."""
    import psutil

    pids = {s.name: s.pid for s in cluster.servers}
    for child in psutil.Process().children():
        if "multiprocessing.forkserver" in " ".join(child.cmdline()):
            pids["forkserver"] = child.pid
    return pids


def _status_kib(pid: int, field: str) -> int:
    """A kB field of /proc/PID/status (0 where the system has none)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def configured_bytes(stub, timeout: float | None = None) -> dict[str, int]:
    """What each server is configured to hold, from the conductor's Status (`stub`: a
    ConductorStub; `timeout`: the call's deadline in seconds, None for none)."""
    from client.status_cmd import memory_rows
    from protos import halfmoon_pb2 as pb

    status = stub.Status(pb.StatusRequest(), timeout=timeout)
    return {name: m.configured_bytes for name, m in memory_rows(status)}
