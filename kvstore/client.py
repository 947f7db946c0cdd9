"""StoreClient: batch reads into and writes from a caller's tensors, over shared memory when the
node is on this host and over gRPC otherwise (the tiers above it: kvstore.KVConnector)."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import NamedTuple

import grpc
import numpy as np
import torch

from kvstore.block_format import (
    BlockCorrupt,
    BlockHeader,
    check_block,
    checksum,
    decode_layers,
    dtype_name,
    make_header,
    pack_header,
    parse_header,
    u8view,
)
from kvstore.codecs import copy_bytes, get_codec
from kvstore.server import boot_id, grpc_options
from kvstore.slab import ShmSlab
from kvstore.store import StoreFull, StoreStats, TierStats
from kvstore.types import LookupResult
from kvstore.wire import Part, parse_parts, put_data_chunk, raw_get, raw_put
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
PUT_STREAM_DEADLINE_S = 600.0
_FUSED_COPY_BYTES = 2 << 20  # blocks up to this are copied whole before their layers are checked


class StoreUnavailable(ConnectionError):
    """The store node did not answer (UNAVAILABLE, deadline exceeded...)."""


def _raise(e: grpc.RpcError):
    code, details = e.code(), e.details()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        raise StoreFull(details) from None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        raise ValueError(details) from None
    if code == grpc.StatusCode.NOT_FOUND:
        raise KeyError(details) from None
    raise StoreUnavailable(f"store {code.name}: {details}") from None


class PutResult(NamedTuple):
    stored: int  # blocks newly written
    held: int  # blocks of the put the store holds now


class StoreClient:
    """A client of one store node. transport: "auto" (shm on the same host), "shm" or "grpc"."""

    def __init__(self, address: str, transport: str = "auto", timeout_s: float = 30.0):
        self.address, self.timeout = address, timeout_s
        self.channel = grpc.insecure_channel(address, options=grpc_options(256 << 20))
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self._get, self._put = raw_get(self.channel), raw_put(self.channel)
        try:
            # waits for the channel to connect, but not as long as a transfer may take
            self.info = self.stub.Info(
                pb.KVInfoRequest(), timeout=min(timeout_s, 5.0), wait_for_ready=True
            )
        except grpc.RpcError as e:
            self.channel.close()
            _raise(e)
        self.slab: ShmSlab | None = None
        self._releases: list[grpc.Future] = []
        self._releases_lock = threading.Lock()
        if transport not in ("auto", "shm", "grpc"):
            raise ValueError(f"transport must be auto, shm or grpc, got {transport!r}")
        if transport != "grpc":
            same_host = (
                self.info.hostname == socket.gethostname()
                and self.info.boot_id == boot_id()
                and self.info.shm_path
                and os.path.exists(self.info.shm_path)
            )
            if same_host:
                try:
                    self.slab = ShmSlab(self.info.shm_path, self.info.shm_size, create=False)
                except OSError as e:
                    log.warning("cannot map %s (%s): using gRPC", self.info.shm_path, e)
            if transport == "shm" and self.slab is None:
                self.channel.close()
                raise ValueError(f"store {address} has no shared memory reachable from this host")
        self.transport = "shm" if self.slab is not None else "grpc"
        self.chunk_bytes = self.info.chunk_bytes or (1 << 20)

    def _check_slab(self, shm_path: str) -> None:
        """Map the slab a lease's offsets refer to, if the node was restarted since we mapped
        one."""
        if shm_path == self.slab.path:
            return
        try:
            self.info = self.stub.Info(pb.KVInfoRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            _raise(e)
        if self.info.shm_path != shm_path:
            raise StoreUnavailable(
                f"store {self.address} changed its shared memory during the call"
            )
        self.slab.close()
        self.slab = ShmSlab(shm_path, self.info.shm_size, create=False)

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
            _raise(e)
        tiers = list(reply.tiers) if reply else []
        return LookupResult(len(tiers), tiers, tuple(reply.sizes) if reply else ())

    # ------------------------------------------------------------------ reads

    def get_into(self, keys: list[bytes], out: torch.Tensor) -> int:
        """Fill out[:k] with the longest held prefix of keys; k. A block that fails its checks
        ends the prefix (a miss), never bad data. out[k:] is scratch (over gRPC, layers arrive
        before a later layer of the same block may fail its checksum)."""
        if out.shape[0] < len(keys):
            raise ValueError(f"out holds {out.shape[0]} blocks, {len(keys)} keys asked")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        if not keys:
            return 0
        if self.slab is not None:
            return self._get_shm(keys, out)
        return self._get_grpc(keys, out)

    def _block_ok(self, h: BlockHeader, out_block: torch.Tensor) -> bool:
        if h.shape != tuple(out_block.shape) or h.dtype != out_block.dtype:
            log.warning(
                "stored block is %s %s, out is %s %s: treated as a miss",
                list(h.shape),
                h.dtype,
                list(out_block.shape),
                out_block.dtype,
            )
            return False
        return True

    def _get_shm(self, keys: list[bytes], out: torch.Tensor) -> int:
        try:
            reply = self.stub.Lease(
                pb.KVLeaseRequest(mode=pb.KVLeaseRequest.READ, keys=keys), timeout=self.timeout
            )
        except grpc.RpcError as e:
            _raise(e)
        if reply.slots:
            self._check_slab(reply.shm_path)
        got, corrupt = 0, []
        block_bytes = out[0].numel() * out.element_size() if len(out) else 0
        out_bytes = (
            out.view(-1).view(torch.uint8).numpy()
            if out.device.type == "cpu" and block_bytes
            else None
        )
        slab_bytes = self.slab.array
        for slot in reply.slots:
            if slot.offset >= 0:
                view = self.slab.view[slot.offset : slot.offset + slot.length]
            else:
                view = memoryview(slot.data)
            try:
                h = parse_header(view)
                if h.total_len != slot.length:
                    raise BlockCorrupt("length mismatch")
            except BlockCorrupt:
                corrupt.append(keys[slot.index])
                break
            if not self._block_ok(h, out[got]):
                break
            sums, lb = h.checksums, h.layer_bytes
            if (
                out_bytes is not None
                and h.codec == "raw"
                and h.payload_len == block_bytes
                and slot.offset >= 0
            ):
                # Unpadded raw: the payload is the block tensor's bytes. Copy, then check the copy
                # while it is still in cache (one pass over memory instead of two).
                src = slot.offset + h.header_len
                dst = out_bytes[got * block_bytes : (got + 1) * block_bytes]
                step = block_bytes if block_bytes <= _FUSED_COPY_BYTES else lb
                ok = True
                for o in range(0, block_bytes, step):
                    np.copyto(dst[o : o + step], slab_bytes[src + o : src + o + step])
                    part = memoryview(dst[o : o + step])
                    ok = ok and all(
                        checksum(part[a : a + lb]) == sums[(o + a) // lb]
                        for a in range(0, step, lb)
                    )
                    if not ok:
                        break
            else:
                ok = all(
                    checksum(view[o : o + lb]) == sums[layer]
                    for layer, o in enumerate(range(h.header_len, h.total_len, lb))
                )
                if ok:
                    decode_layers(u8view(view), h, out[got], range(h.num_layers))
            if not ok:
                corrupt.append(keys[slot.index])
                break
            got += 1
        if reply.lease_id or corrupt:
            self._release_later(reply.lease_id, corrupt)
        return got

    def _release_later(self, lease_id: int, corrupt: list[bytes]) -> None:
        # Released in the background: the copies are done, nothing waits on the answer.
        f = self.stub.Release.future(
            pb.KVReleaseRequest(lease_id=lease_id, corrupt=corrupt), timeout=self.timeout
        )
        with self._releases_lock:
            self._releases.append(f)
        self._reap_releases()

    def _reap_releases(self, wait: bool = False) -> None:
        with self._releases_lock:
            pending, self._releases = self._releases, []
        keep = []
        for f in pending:
            if wait or f.done():
                try:
                    f.result()
                except grpc.RpcError as e:
                    log.warning("lease release failed: %s", e.details())
            else:
                keep.append(f)
        with self._releases_lock:
            self._releases.extend(keep)

    def _get_grpc(self, keys: list[bytes], out: torch.Tensor) -> int:
        try:
            stream = self._get(pb.KVGetRequest(keys=keys), timeout=self.timeout)
            raw = next(stream, None)
            if raw is None:
                return 0
            first = pb.KVGetChunk.FromString(raw)
            headers: list[BlockHeader] = []
            for raw in first.headers:
                try:
                    h = parse_header(raw)
                except BlockCorrupt:
                    break
                if not self._block_ok(h, out[len(headers)]):
                    break
                headers.append(h)
            k = len(headers)
            corrupt = []
            stage: dict[
                tuple[int, int], torch.Tensor
            ] = {}  # (block, layer) -> bytes of a split layer
            filled: dict[tuple[int, int], int] = {}
            for raw in stream:
                for p in parse_parts(raw, 3):
                    b, layer = p.block, p.layer
                    if b >= k:
                        continue
                    h = headers[b]
                    start = h.layer_offset(layer)
                    if (
                        p.offset == start and len(p.data) == h.layer_bytes
                    ):  # a whole layer: no staging
                        data = p.data
                    else:
                        buf = stage.get((b, layer))
                        if buf is None:
                            buf = stage[(b, layer)] = torch.empty(h.layer_bytes, dtype=torch.uint8)
                        rel = p.offset - start
                        copy_bytes(buf[rel : rel + len(p.data)], u8view(p.data))
                        filled[(b, layer)] = filled.get((b, layer), 0) + len(p.data)
                        if filled[(b, layer)] < h.layer_bytes:
                            continue
                        data = stage.pop((b, layer)).numpy()
                        del filled[(b, layer)]
                    if checksum(data) != h.checksums[layer]:
                        corrupt.append(keys[b])
                        k = b
                        continue
                    decode_layers(u8view(data), h, out[b], [layer], base=-start)
        except grpc.RpcError as e:
            _raise(e)
        if corrupt:
            self._release_later(0, corrupt)
        return k

    def get_record(self, key: bytes, fingerprint: str = "") -> bytes | None:
        """One encoded block of any shape, whole, over gRPC (what crosses a link, even on one
        host): checked (header, length, every checksum, the fingerprint when given); None when
        the node does not hold it or it fails a check (a miss, released as corrupt)."""
        try:
            stream = self._get(pb.KVGetRequest(keys=[key]), timeout=self.timeout)
            raw = next(stream, None)
            first = pb.KVGetChunk.FromString(raw) if raw is not None else None
            if first is None or not first.headers:
                for _ in stream:  # drain: the server ends the stream itself
                    pass
                return None
            try:
                h = parse_header(first.headers[0])
            except BlockCorrupt:
                h = None
            buf = bytearray(h.total_len if h is not None else 0)
            if h is not None:
                buf[: h.header_len] = first.headers[0][: h.header_len]
            for raw in stream:
                for p in parse_parts(raw, 3):
                    if h is not None and p.block == 0 and p.offset + len(p.data) <= len(buf):
                        buf[p.offset : p.offset + len(p.data)] = p.data
        except grpc.RpcError as e:
            _raise(e)
        try:
            if h is None:
                raise BlockCorrupt("bad header")
            check_block(buf, fingerprint)
        except BlockCorrupt as exc:
            log.warning("record %s failed its checks (%s): a miss", key.hex()[:12], exc)
            self._release_later(0, [key])
            return None
        return bytes(buf)

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
            if isinstance(w, _ShmWriter) and w.can_write_whole(blocks):
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
    ) -> "BlockWriter":
        """A layer-wise writer: write_layer(l, [n, ...]) for every layer, then commit() or
        abort()."""
        header = make_header(codec, dtype, tuple(block_shape), model_fingerprint)
        if not keys:
            return _NoWriter(self, [], header, parent)
        if self.slab is not None:
            return _ShmWriter(self, list(keys), header, parent)
        return _GrpcWriter(self, list(keys), header, parent)

    # ------------------------------------------------------------------ the rest

    def stats(self) -> StoreStats:
        self._reap_releases(wait=True)
        try:
            s = self.stub.Stats(pb.KVStatsRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            _raise(e)
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
        )

    def clear(self) -> int:
        """Drop every block the node holds (see KVStore.Clear); how many went now."""
        self._reap_releases(wait=True)
        try:
            return self.stub.Clear(pb.KVClearRequest(), timeout=self.timeout).dropped
        except grpc.RpcError as e:
            _raise(e)

    def close(self) -> None:
        self._reap_releases(wait=True)
        if self.slab is not None:
            self.slab.close()
            self.slab = None
        self.channel.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BlockWriter:
    """Writes n blocks layer by layer; they become visible only at commit()."""

    def __init__(
        self, client: StoreClient, keys: list[bytes], header: BlockHeader, parent: bytes | None
    ):
        self.client, self.keys, self.header, self.parent = client, keys, header, parent
        self.codec = get_codec(header.codec)
        self.sums = [[0] * header.num_layers for _ in keys]
        self.written: set[int] = set()
        self.closed = False

    def _check_layer(self, layer: int, data: torch.Tensor) -> None:
        if self.closed:
            raise RuntimeError("writer already committed or aborted")
        want = (len(self.keys), *self.header.shape[1:])
        if not 0 <= layer < self.header.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.header.num_layers - 1}")
        if tuple(data.shape) != want or data.dtype != self.header.dtype:
            raise ValueError(
                f"layer data is {list(data.shape)} {data.dtype}, expected {list(want)} "
                f"{dtype_name(self.header.dtype)}"
            )

    def _headers(self) -> list[bytes]:
        missing = set(range(self.header.num_layers)) - self.written
        if missing:
            self.abort()
            raise ValueError(f"layers {sorted(missing)} were never written; the put is aborted")
        return [pack_header(self.header._replace(checksums=tuple(s))) for s in self.sums]

    def write_layer(self, layer: int, data: torch.Tensor) -> None: ...

    def commit(self) -> PutResult: ...

    def abort(self) -> None: ...


class _NoWriter(BlockWriter):
    """A put of no blocks: nothing to send."""

    def write_layer(self, layer, data):
        self._check_layer(layer, data)
        self.written.add(layer)

    def commit(self):
        self.closed = True
        return PutResult(0, 0)

    def abort(self):
        self.closed = True


class _ShmWriter(BlockWriter):
    def __init__(self, client, keys, header, parent):
        super().__init__(client, keys, header, parent)
        req = pb.KVLeaseRequest(
            mode=pb.KVLeaseRequest.WRITE,
            keys=keys,
            sizes=[header.total_len] * len(keys),
            parent=parent or b"",
            model_fingerprint=header.fingerprint,
        )
        try:
            reply = client.stub.Lease(req, timeout=client.timeout)
        except grpc.RpcError as e:
            _raise(e)
        self.lease_id, self.ttl = reply.lease_id, reply.ttl_s
        self.slots = [
            (s.index, s.offset) for s in reply.slots
        ]  # blocks the store does not hold yet
        if self.slots:
            client._check_slab(reply.shm_path)
        self.renewed = time.monotonic()

    def _renew(self) -> None:
        # Before writing, never after: once a lease lapses its ranges may belong to another put.
        if self.slots and time.monotonic() - self.renewed > self.ttl / 3:
            try:
                self.client.stub.Lease(
                    pb.KVLeaseRequest(mode=pb.KVLeaseRequest.RENEW, lease_id=self.lease_id),
                    timeout=self.client.timeout,
                )
            except grpc.RpcError as e:
                self.closed = True
                _raise(e)
            self.renewed = time.monotonic()

    def write_layer(self, layer, data):
        self._check_layer(layer, data)
        self._renew()
        h, slab = self.header, self.client.slab
        n = self.codec.layer_nbytes(h.shape[1:], h.dtype)
        for i, off in self.slots:
            start = off + h.layer_offset(layer)
            dst = slab.tensor[start : start + h.layer_bytes]
            self.codec.encode_layer(data[i], dst[:n])
            if n < h.layer_bytes:
                dst[n:].zero_()
            self.sums[i][layer] = checksum(slab.view[start : start + h.layer_bytes])
        self.written.add(layer)

    def can_write_whole(self, blocks: torch.Tensor) -> bool:
        h = self.header
        return (
            h.codec == "raw"
            and self.codec.layer_nbytes(h.shape[1:], h.dtype) == h.layer_bytes
            and blocks.is_contiguous()
            and tuple(blocks.shape[1:]) == h.shape
            and blocks.dtype == h.dtype
        )

    def write_whole(self, blocks: torch.Tensor) -> None:
        """All layers of unpadded raw blocks: one copy per block, then the per-layer checksums."""
        self._renew()
        h, slab = self.header, self.client.slab
        for i, off in self.slots:
            start = off + h.header_len
            copy_bytes(
                slab.tensor[start : start + h.payload_len], blocks[i].reshape(-1).view(torch.uint8)
            )
            for layer in range(h.num_layers):
                lo = off + h.layer_offset(layer)
                self.sums[i][layer] = checksum(slab.view[lo : lo + h.layer_bytes])
        self.written.update(range(h.num_layers))

    def commit(self):
        headers = self._headers()
        self._renew()
        self.closed = True
        if not self.slots:
            return PutResult(0, len(self.keys))
        slab = self.client.slab
        for i, off in self.slots:
            slab.view[off : off + len(headers[i])] = headers[i]
        try:
            reply = self.client.stub.Commit(
                pb.KVCommitRequest(lease_id=self.lease_id), timeout=self.client.timeout
            )
        except grpc.RpcError as e:
            _raise(e)
        # the node answers for the blocks it reserved; the others were held when the lease was
        # granted
        return PutResult(reply.stored, reply.held + len(self.keys) - len(self.slots))

    def abort(self):
        if self.closed:
            return
        self.closed = True
        if self.slots:
            try:
                self.client.stub.Release(
                    pb.KVReleaseRequest(lease_id=self.lease_id), timeout=self.client.timeout
                )
            except grpc.RpcError as e:
                log.warning("abort of lease %d failed: %s", self.lease_id, e.details())


class _GrpcWriter(BlockWriter):
    def __init__(self, client, keys, header, parent):
        super().__init__(client, keys, header, parent)
        self.q: queue.Queue = queue.Queue()
        self.q.put(
            pb.KVPutChunk(
                open=pb.KVPutOpen(
                    keys=keys,
                    sizes=[header.total_len] * len(keys),
                    parent=parent or b"",
                    model_fingerprint=header.fingerprint,
                )
            )
        )
        # The stream stays open while the caller computes layers: a long deadline, not none.
        self.call = client._put.future(
            iter(self.q.get, None), timeout=max(client.timeout, PUT_STREAM_DEADLINE_S)
        )

    def write_layer(self, layer, data):
        self._check_layer(layer, data)
        h = self.header
        n = self.codec.layer_nbytes(h.shape[1:], h.dtype)
        chunk = self.client.chunk_bytes
        parts, size = [], 0
        start = h.layer_offset(layer)
        for i in range(len(self.keys)):
            if self.codec.name == "raw" and n == h.layer_bytes and data[i].is_contiguous():
                buf = data[i].reshape(-1).view(torch.uint8)  # the caller's bytes as they are
            else:
                buf = torch.zeros(h.layer_bytes, dtype=torch.uint8)
                self.codec.encode_layer(data[i], buf[:n])
            raw = memoryview(buf.numpy())
            self.sums[i][layer] = checksum(raw)
            for o in range(0, len(raw), chunk):
                piece = raw[o : o + chunk]
                parts.append(Part(i, layer, start + o, piece))
                size += len(piece)
                if size >= chunk:
                    self.q.put(
                        put_data_chunk(parts)
                    )  # copies the pieces: the caller may reuse data
                    parts, size = [], 0
        if parts:
            self.q.put(put_data_chunk(parts))
        self.written.add(layer)

    def commit(self):
        headers = self._headers()
        self.closed = True
        self.q.put(pb.KVPutChunk(commit=pb.KVPutCommit(headers=headers)))
        self.q.put(None)
        try:
            reply = self.call.result(timeout=self.client.timeout)
        except grpc.RpcError as e:
            _raise(e)
        return PutResult(reply.stored, reply.held)

    def abort(self):
        if self.closed:
            return
        self.closed = True
        self.call.cancel()
        self.q.put(None)
