"""StoreClient: batch reads into and writes from a caller's tensors, over shared memory when the
node is on this host, over its bulk port (kvstore/bulk.py) from other hosts, and over gRPC where
neither is open (the tiers above it: kvstore.KVConnector). The transport is chosen once, when
the client is made; each is a BlockTransport in its own module (kvstore/client/transport_*.py)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import torch

from kvstore.client.block_format import make_header
from kvstore.client.transport import BlockTransport, StoreLink, rpc_failed
from kvstore.client.transport_grpc import GrpcTransport, read_record, receive_layers
from kvstore.client.transport_shm import ShmTransport
from kvstore.client.transport_tcp import TcpTransport
from kvstore.client.writers import BlockWriter, NoWriter, PutResult
from kvstore.control import StoreUnavailable, clear_store, store_stats
from kvstore.slab import ShmSlab
from kvstore.types import LookupResult, StoreStats
from protos import kvstore_pb2 as pb
from servekit.security import SecurityConfig

# the package and the connector's modules import these from here: the writer and its result
# (defined beside the transports' writers) and the error a call raises when the node is gone
__all__ = ["BlockWriter", "PutResult", "StoreClient", "StoreUnavailable"]

TRANSPORTS = ("auto", "shm", "tcp", "grpc")


def _choose(link: StoreLink, transport: str, security: SecurityConfig | None) -> BlockTransport:
    """The transport a client of `link`'s node uses for every call: "auto" takes shared memory
    where this host maps the node's slab, else the bulk port where it opens (counted as a
    fallback through the link when an advertised one does not), else gRPC; "shm" and "tcp"
    insist on theirs (ValueError, StoreUnavailable)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be auto, shm, tcp or grpc, got {transport!r}")
    if transport in ("auto", "shm"):
        shm = ShmTransport.open(link)
        if shm is not None:
            return shm
        if transport == "shm":
            raise ValueError(f"store {link.address} has no shared memory reachable from this host")
    if transport in ("auto", "tcp"):
        tcp = TcpTransport.open(link, security, required=transport == "tcp")
        if tcp is not None:
            return tcp
    return GrpcTransport(link)


class StoreClient:
    """A client of one store node. transport: "auto" (shm on the same host, else the node's bulk
    port, else gRPC), "shm", "tcp" (the bulk port) or "grpc". Under "auto", a bulk port that
    cannot be opened leaves the client on gRPC: logged, and counted through on_fallback(why)."""

    # the gRPC reader of a Get stream's layers, kept here for the tests that feed it streams
    _receive_layers = staticmethod(receive_layers)

    def __init__(
        self,
        address: str,
        transport: str = "auto",
        timeout_s: float = 30.0,
        security: SecurityConfig | None = None,
        on_fallback: Callable[[str], None] | None = None,
    ):
        self.address, self.timeout = address, timeout_s
        self._link = StoreLink(address, timeout_s, security, on_fallback)
        self.channel, self.stub = self._link.channel, self._link.stub
        try:
            self._transport = _choose(self._link, transport, security)
        except BaseException:
            self._link.channel.close()
            raise
        self.transport = self._transport.name  # "shm", "tcp" or "grpc"

    @property
    def info(self) -> pb.KVInfoReply:
        """The node's Info (asked again when a restarted node's slab had to be mapped)."""
        return self._link.info

    @property
    def chunk_bytes(self) -> int:
        """The most bytes of blocks in one message of a gRPC stream."""
        return self._link.chunk_bytes

    @property
    def slab(self) -> ShmSlab | None:
        """The node's shared memory as this client maps it (transport "shm"), else None."""
        return self._transport.slab

    # ------------------------------------------------------------------ lookups

    def lookup(self, keys: list[bytes]) -> LookupResult:
        """Leading keys the node holds, and the tier of each."""
        try:
            reply = (
                self.stub.Lookup(pb.KVLookupRequest(keys=keys), timeout=self.timeout)
                if keys
                else None
            )
        except grpc.RpcError as e:
            rpc_failed(e)
        tiers = list(reply.tiers) if reply else []
        return LookupResult(len(tiers), tiers, tuple(reply.sizes) if reply else ())

    # ------------------------------------------------------------------ reads

    def get_into(self, keys: list[bytes], out: torch.Tensor, rows: list[int] | None = None) -> int:
        """Fill out[:k] with the longest held prefix of keys; k. A block that fails its checks
        ends the prefix (a miss), never bad data. out[k:] is scratch (over gRPC, layers arrive
        before a later layer of the same block may fail its checksum). With `rows`, key i's
        block goes to out[rows[i]] instead (a worker's pool and the blocks it allocated), and
        the rows past the k-th are scratch: over shared memory each block is copied straight to
        its row (a CPU `out`), elsewhere through a staging tensor."""
        if rows is not None:
            rows = [int(r) for r in rows]
            if len(rows) != len(keys):
                raise ValueError(f"{len(rows)} rows for {len(keys)} keys")
            if rows and not (0 <= min(rows) and max(rows) < out.shape[0]):
                raise ValueError(f"a row lies outside out's {out.shape[0]} blocks")
            if len(set(rows)) != len(rows):
                raise ValueError("rows repeat: two blocks would land in one")
        elif out.shape[0] < len(keys):
            raise ValueError(f"out holds {out.shape[0]} blocks, {len(keys)} keys asked")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        if not keys:
            return 0
        return self._transport.get_into(keys, out, rows)

    def get_record(self, key: bytes, fingerprint: str = "") -> bytes | None:
        """One encoded block of any shape, whole, over gRPC (what crosses a link, even on one
        host): checked (header, length, every checksum, the fingerprint when given); None when
        the node does not hold it or it fails a check (a miss, released as corrupt)."""
        return read_record(self._link, key, fingerprint)

    # ------------------------------------------------------------------ writes

    def put(
        self,
        keys: list[bytes],
        blocks: torch.Tensor,
        model_fingerprint: str,
        codec: str = "raw",
        parent: bytes | None = None,
    ) -> int:
        """Store blocks [n, L, ...] under keys; how many of them the store holds afterwards
        (blocks it held already are not rewritten). StoreFull when it cannot take them."""
        if blocks.shape[0] != len(keys):
            raise ValueError(f"{len(keys)} keys for {blocks.shape[0]} blocks")
        w = self.open_put(
            keys, tuple(blocks.shape[1:]), blocks.dtype, model_fingerprint, codec, parent
        )
        try:
            if w.can_write_whole(blocks):
                w.write_whole(blocks)
            else:
                for layer in range(blocks.shape[1]):
                    w.write_layer(layer, blocks[:, layer])
        except BaseException:
            w.abort()
            raise
        return w.commit().held

    def open_put(
        self,
        keys: list[bytes],
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        model_fingerprint: str,
        codec: str = "raw",
        parent: bytes | None = None,
    ) -> BlockWriter:
        """A layer-wise writer: write_layer(l, [n, ...]) for every layer, then commit() or
        abort()."""
        header = make_header(codec, dtype, tuple(block_shape), model_fingerprint)
        if not keys:
            return NoWriter([], header, parent)
        return self._transport.open_put(list(keys), header, parent)

    # ------------------------------------------------------------------ the rest

    def stats(self) -> StoreStats:
        self._link.background.drain()
        return store_stats(self.stub, self.timeout)

    def clear(self) -> int:
        """Drop every block the node holds (see KVStore.Clear); how many went now."""
        self._link.background.drain()
        return clear_store(self.stub, self.timeout)

    def close(self) -> None:
        self._link.background.close()  # the queued releases go first, on the open channel
        self._transport.close()
        self.channel.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
