"""The memory of a local cluster's server processes: each process's peak RSS, PSS and page tables
(MemorySampler, over the processes cluster_pids names), as bench/e2e.py reports them, and what each
server is configured to hold (weights, pools, in-memory tiers) from the conductor's Status, which
bench/e2e.py sets those peaks beside and bench/soak.py budgets each server's RSS by; and the KV
tiers' sizes for a given KV memory (kv_sizes: bench/e2e.py gives halfmoon its peer's).
"""

from __future__ import annotations


class MemorySampler:
    """Peak RSS, PSS and page tables of each server process. RSS's peak is the kernel's own
    high-water mark (VmHWM: exact, and free to read); PSS has none, so it is sampled at the ends
    of workloads, not from a thread during them: reading a process's smaps walks its page tables
    under its mmap lock, which stalled the servers' own allocations and added up to 0.5 s to a
    cold TTFT. Page tables (VmPTE) are memory PSS leaves out: each process that maps the store's
    slab in 4 KiB pages holds 2 MiB of them per GiB mapped, a cost that grows with the slab."""

    def __init__(self, pids: dict[str, int]):
        import psutil

        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.rss = dict.fromkeys(self.procs, 0)
        self.pss = dict.fromkeys(self.procs, 0)
        self.pte = dict.fromkeys(self.procs, 0)

    def sample(self) -> None:
        for name, proc in self.procs.items():
            try:
                m = proc.memory_full_info()
                hwm = _status_kib(proc.pid, "VmHWM") * 1024
                pte = _status_kib(proc.pid, "VmPTE") * 1024
            except Exception:  # noqa: BLE001 - a server that ended is no longer sampled
                continue
            self.rss[name] = max(self.rss[name], m.rss, hwm)
            self.pss[name] = max(self.pss[name], getattr(m, "pss", m.uss))
            self.pte[name] = max(self.pte[name], pte)


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


def dram_used_bytes(stub, timeout: float | None = None) -> int:
    """Bytes of blocks the store nodes' DRAM slabs hold now (of their configured capacity, all
    of it resident: the slab is populated when it is made), from the conductor's Status."""
    from protos import halfmoon_pb2 as pb

    status = stub.Status(pb.StatusRequest(), timeout=timeout)
    return sum(t.used_bytes for s in status.stores for t in s.tiers if t.tier == "dram")


def kv_sizes(cfg, kv_bytes: int) -> dict:
    """Config sections giving `cfg`'s slab and pools `kv_bytes` in all, split by the rule the
    config's `auto` follows (servekit.split_kv_bytes: 2/3 to the slab, the rest to the pools)."""
    from model import read_model_config
    from servekit import PoolSpec, kv_block_bytes, split_kv_bytes

    pools = []
    for role in ("prefill", "decode"):
        w = getattr(cfg, role)
        block = kv_block_bytes(read_model_config(w.model), w, w.dtype)
        pools.append(PoolSpec(role, getattr(cfg, f"{role}_workers"), block, 0, None))
    dram, blocks = split_kv_bytes(kv_bytes, pools)
    return {
        "store": {"dram_bytes": dram},
        **{role: {"num_blocks": n} for role, n in blocks.items()},
    }
