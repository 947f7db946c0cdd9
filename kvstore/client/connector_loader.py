"""Loading stored blocks into the pool: a prompt's longest cached prefix walking the device tier,
this host's store node (DRAM, then SSD) and one remote node (prefill), and the blocks a prefill
worker stored, pulled by a decode worker. What a remote fetch measured of its link is kept per
node, for the policy."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvstore.client.connector_clients import StoreClients
from kvstore.client.connector_device import ResidentBlocks
from kvstore.client.connector_metrics import ConnectorMetrics
from kvstore.client.connector_pool import PoolIO
from kvstore.client.store_client import StoreClient
from kvstore.links import LinkModel, LinkSpeed

TIERS = ("device", "dram", "ssd", "remote")


class PrefixLoad(NamedTuple):
    """What `load_prefix` put in the pool."""

    table: list[int]  # pool block ids holding the prefix, in order (device-tier ones first)
    pinned: list[bytes]  # device-tier keys pinned for the request: give them to `keep`/`drop`
    counts: dict[str, int]  # blocks by tier they came from: device, dram, ssd, remote
    transfer_ms: float  # time spent moving blocks into the pool
    fetched_bytes: int = 0  # bytes the remote fetch moved over the link
    fetch_ms: float = 0.0  # time the remote fetch took (its lookup and transfer)


class PrefixLoader:
    """Loads into `pool` from the nodes `clients` reach, after what `resident` holds."""

    def __init__(
        self,
        pool: PoolIO,
        clients: StoreClients,
        resident: ResidentBlocks,
        metrics: ConnectorMetrics,
    ) -> None:
        self._pool, self._clients, self._resident = pool, clients, resident
        self._metrics = metrics
        # node id -> what raw fetches from it measured (the Load report, for the policy)
        self._fetch_links: dict[str, LinkModel] = {}
        self._fetch_links_lock = threading.Lock()

    def load_prefix(
        self,
        keys: Sequence[bytes],
        cap: int,
        fetch_from: str,
        fetch_blocks: int,
        allocate: Callable[[int], list[int]],
        free: Callable[[list[int]], None],
    ) -> PrefixLoad:
        """See KVConnector.load_prefix."""
        table: list[int] = []
        pinned: list[bytes] = []
        counts = dict.fromkeys(TIERS, 0)
        fetched, fetch_ms = 0, 0.0
        local, m = self._clients.local, self._metrics
        t0 = time.perf_counter()
        try:
            if self._resident.tier is not None and cap:
                table.extend(self._resident.match(keys[:cap]))
                pinned = list(keys[: len(table)])
                counts["device"] = len(table)
                m.loaded("device", len(table))
            if len(table) < cap:
                for tier in self._load_run(
                    local, keys[len(table) : cap], table, allocate, free, "load_local"
                ):
                    counts["ssd" if tier == "ssd" else "dram"] += 1
            want = min(cap, fetch_blocks)
            if (
                fetch_from
                and fetch_from not in (self._clients.store_node, self._resident.device_node)
                and len(table) < want
            ):
                remote = self._clients.for_node(fetch_from)
                if remote is None:
                    m.miss("load_remote", want - len(table))
                else:
                    link: list[float] = []
                    got = self._load_run(
                        remote, keys[len(table) : want], table, allocate, free, "load_remote", link
                    )
                    counts["remote"] += len(got)
                    if got:
                        fetched = len(got) * self._pool.wire_block_bytes
                        fetch_ms = sum(link)
                        self._measured(fetch_from, link[0], fetched, link[1])
        except BaseException:
            self._resident.drop(table, pinned, free)
            raise
        for tier in ("dram", "ssd", "remote"):
            if counts[tier]:
                m.loaded(tier, counts[tier])
        took = (time.perf_counter() - t0) * 1000.0
        return PrefixLoad(table, pinned, counts, took, fetched, fetch_ms)

    def _load_run(
        self,
        client: StoreClient,
        keys: Sequence[bytes],
        table: list[int],
        allocate: Callable[[int], list[int]],
        free: Callable[[list[int]], None],
        op: str,
        times: list[float] | None = None,
    ) -> list[str]:
        """Append to `table` pool blocks holding the longest held run of `keys` at `client`;
        the tiers they came from. `times`, when given, gets the lookup's and the transfer's ms."""
        if not keys:
            return []
        t0 = time.perf_counter()
        try:
            found = client.lookup(list(keys))
        except Exception as exc:  # noqa: BLE001 - a lookup that fails is a miss
            self._metrics.error(op, exc)
            return []
        n = found.num_blocks
        if n == 0:
            return []
        ids = allocate(n)
        t1 = time.perf_counter()
        got = self._pool.get_into(client, list(keys[:n]), ids, op)
        if times is not None:
            times[:] = [(t1 - t0) * 1000.0, (time.perf_counter() - t1) * 1000.0]
        free(ids[got:])
        table.extend(ids[:got])
        return list(found.tiers[:got])

    def _measured(self, node: str, lookup_ms: float, nbytes: int, transfer_ms: float) -> None:
        with self._fetch_links_lock:
            self._fetch_links.setdefault(node, LinkModel()).add(lookup_ms, nbytes, transfer_ms)

    def links(self) -> dict[str, LinkSpeed]:
        """Store node id -> the link to it as this worker's fetches measured it."""
        with self._fetch_links_lock:
            return {node: m.speed() for node, m in self._fetch_links.items()}

    def pull(self, address: str, keys: Sequence[bytes], ids: Sequence[int]) -> int:
        """See KVConnector.pull."""
        if not keys:
            return 0
        try:
            client = self._clients.get(address or self._clients.store_address)
        except Exception as exc:  # noqa: BLE001 - unreachable store: everything is a miss
            self._metrics.error("pull", exc)
            self._metrics.miss("pull", len(keys))
            return 0
        got = self._pool.get_into(client, list(keys), list(ids), "pull")
        self._metrics.loaded("pull", got)
        return got
