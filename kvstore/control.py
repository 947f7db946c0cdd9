"""A store node's control calls (Stats, Clear) over gRPC, and how its errors map to exceptions.

Torch-free: the conductor shows and clears the stores' tiers and never moves a block; the data
client (`kvstore.client.StoreClient`) is built on the same pieces."""

from __future__ import annotations

from typing import NoReturn

import grpc

from kvstore.types import StoreFull, StoreStats, TierStats, grpc_options
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc
from servekit.security import SecurityConfig, open_channel


class StoreUnavailable(ConnectionError):
    """The store node did not answer (UNAVAILABLE, deadline exceeded...)."""


def raise_rpc_error(e: grpc.RpcError) -> NoReturn:
    """A store RPC's failure as the exception it stands for (raise_status)."""
    raise_status(e.code().name, e.details())


def raise_status(code: str, details: str) -> NoReturn:
    """A store call's failure, by its gRPC status name (a bulk-port ERR carries one too), as the
    exception it stands for: StoreFull, ValueError (a bad argument), KeyError (not found), else
    StoreUnavailable."""
    if code == "RESOURCE_EXHAUSTED":
        raise StoreFull(details) from None
    if code == "INVALID_ARGUMENT":
        raise ValueError(details) from None
    if code == "NOT_FOUND":
        raise KeyError(details) from None
    raise StoreUnavailable(f"store {code}: {details}") from None


def store_stats(stub: pb_grpc.KVStoreStub, timeout_s: float) -> StoreStats:
    """One Stats call: the node's tiers, counters and memory."""
    try:
        s = stub.Stats(pb.KVStatsRequest(), timeout=timeout_s)
    except grpc.RpcError as e:
        raise_rpc_error(e)
    return StoreStats(
        s.node_id,
        [
            TierStats(t.tier, t.used_bytes, t.capacity_bytes, t.blocks, t.hits, t.evictions)
            for t in s.tiers
        ],
        s.hits,
        s.misses,
        s.promotions,
        s.demotions,
        s.leases,
        s.pending_blocks,
        (s.rss_bytes, s.uss_bytes, s.pss_bytes, s.configured_bytes),
    )


def clear_store(stub: pb_grpc.KVStoreStub, timeout_s: float) -> int:
    """One Clear call (see KVStore.Clear): how many blocks went now."""
    try:
        return stub.Clear(pb.KVClearRequest(), timeout=timeout_s).dropped
    except grpc.RpcError as e:
        raise_rpc_error(e)


class StoreControl:
    """A control connection to one store node: its stats, its bulk port, and clearing it."""

    def __init__(
        self, address: str, timeout_s: float = 30.0, security: SecurityConfig | None = None
    ):
        self.address, self.timeout = address, timeout_s
        # TLS and the cluster token when the cluster is configured with them
        self.channel = open_channel(address, security, grpc_options(16 << 20))
        self.stub = pb_grpc.KVStoreStub(self.channel)

    def stats(self) -> StoreStats:
        return store_stats(self.stub, self.timeout)

    def clear(self) -> int:
        return clear_store(self.stub, self.timeout)

    def bulk_port(self) -> int:
        """The node's bulk port (on its own host), 0 where it has none."""
        try:
            return self.stub.Info(pb.KVInfoRequest(), timeout=self.timeout).bulk_port
        except grpc.RpcError as e:
            raise_rpc_error(e)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> StoreControl:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
