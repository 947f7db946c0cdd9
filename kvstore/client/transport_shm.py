"""The shared-memory transport: a client on the node's own host maps the node's slab and copies
blocks in and out of it under leases (gRPC carries only the lease, commit and release calls)."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections.abc import Sequence

import grpc
import numpy as np
import torch

import kernels
from kvstore.block_header import BlockHeader, checksum, fixed_fields, table_offsets
from kvstore.client.block_format import decode_layers, u8view
from kvstore.client.transport import (
    BlockTransport,
    StoreLink,
    fits,
    get_staged,
    header_of,
    rpc_failed,
)
from kvstore.client.writers import BlockWriter, PutResult
from kvstore.control import StoreUnavailable
from kvstore.slab import ShmSlab
from kvstore.types import boot_id
from protos import kvstore_pb2 as pb

log = logging.getLogger(__name__)
_FUSED_COPY_BYTES = 2 << 20  # blocks up to this are copied whole before their layers are checked

# (index in the keys, slab offset or -1 where the block came inline, length, inline bytes)
_Slot = tuple[int, int, int, bytes]


def copy_hashed(
    dst: np.ndarray, dst_offsets: list[int], src: np.ndarray, src_offsets: list[int], nbytes: int,
    layer_bytes: int, threads: int = 1,
) -> list[list[int]]:  # fmt: skip
    """dst[dst_offsets[i]:][:nbytes] = src[src_offsets[i]:][:nbytes] for each block i (flat
    uint8 arrays); the checksum of each layer of each copy, taken while it is still in cache (one
    pass over memory instead of two): one C call for the batch where the kernels are built
    (kernels/csrc/copy_hashed.c), else block by block here."""
    if kernels.copy_hashed_available():
        sums = kernels.copy_hashed(dst, dst_offsets, src, src_offsets, nbytes, layer_bytes, threads)
        return sums.tolist()
    step = nbytes if nbytes <= _FUSED_COPY_BYTES else layer_bytes  # big: copy, hash by layer
    mv, out = dst.data, []
    for d, s in zip(dst_offsets, src_offsets):
        block_sums: list[int] = []
        for o in range(0, nbytes, step):
            np.copyto(dst[d + o : d + o + step], src[s + o : s + o + step])
            block_sums += [
                checksum(mv[a : a + layer_bytes]) for a in range(d + o, d + o + step, layer_bytes)
            ]
        out.append(block_sums)
    return out


def _is_slab_file(path: str) -> bool:
    """Whether the file a store's Info names looks like a store slab (a regular file named as
    ShmSlab.create names them, not a link): the node chooses what a client maps, so a client
    maps nothing else."""
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    if os.path.basename(path).startswith("halfmoon-"):
        return True
    log.warning("store's shared memory %s is not a store slab: using gRPC", path)
    return False


class ShmTransport(BlockTransport):
    name = "shm"

    def __init__(self, link: StoreLink, slab: ShmSlab):
        super().__init__(link)
        self.slab: ShmSlab | None = slab  # None once closed

    @classmethod
    def open(cls, link: StoreLink) -> ShmTransport | None:
        """The transport over the node's slab where this host can map it, else None (logged
        where the slab is there but would not map)."""
        info = link.info
        same_host = (
            info.hostname == socket.gethostname()
            and info.boot_id == boot_id()
            and info.shm_path
            and os.path.exists(info.shm_path)
            and _is_slab_file(info.shm_path)
        )
        if not same_host:
            return None
        try:
            return cls(link, ShmSlab(info.shm_path, info.shm_size, create=False))
        except OSError as e:
            log.warning("cannot map %s (%s): using gRPC", info.shm_path, e)
            return None

    def mapped(self) -> ShmSlab:
        """The slab, while the client is open."""
        if self.slab is None:
            raise ValueError("the store client is closed")
        return self.slab

    def check_slab(self, shm_path: str) -> None:
        """Map the slab a lease's offsets refer to, if the node was restarted since we mapped
        one."""
        slab = self.mapped()
        if shm_path == slab.path:
            return
        info = self.link.refresh_info()
        if info.shm_path != shm_path:
            raise StoreUnavailable(
                f"store {self.link.address} changed its shared memory during the call"
            )
        slab.close()
        self.slab = ShmSlab(shm_path, info.shm_size, create=False)

    def get_into(self, keys: list[bytes], out: torch.Tensor, rows: list[int] | None) -> int:
        # each block is copied straight to its row of a CPU `out`; a device's is staged
        if rows is not None and out.device.type != "cpu":
            return get_staged(self, keys, out, rows)
        return self._get(keys, out, rows if rows is not None else range(len(keys)))

    def _get(self, keys: list[bytes], out: torch.Tensor, rows: Sequence[int]) -> int:
        """get_into over the slab: block i of the held prefix into out[rows[i]]."""
        link = self.link
        try:
            reply = link.stub.Lease(
                pb.KVLeaseRequest(mode=pb.KVLeaseRequest.READ, keys=keys, packed=True),
                timeout=link.timeout,
            )
        except grpc.RpcError as e:
            rpc_failed(e)
        slots: list[_Slot]
        if reply.slots:  # a block came inline (from ssd): the node answered per-block slots
            slots = [(s.index, s.offset, s.length, s.data) for s in reply.slots]
        else:
            slots = list(zip(reply.indices, reply.offsets, reply.lengths, itertools.repeat(b"")))
        if reply.slots or reply.offsets:
            self.check_slab(reply.shm_path)
        slab = self.mapped()
        got, corrupt = 0, []
        shape, dtype = tuple(out.shape[1:]), out.dtype
        block_bytes = out[0].numel() * out.element_size()
        # unpadded raw blocks are the block tensor's bytes: copied as plain bytes into out, a run
        # of those in the slab in one call that also checks their headers (_copy_run)
        out_bytes = out.view(-1).view(torch.uint8).numpy() if out.device.type == "cpu" else None
        i = 0
        while i < len(slots):
            index, off, length, data = slots[i]
            view = slab.view[off : off + length] if off >= 0 else memoryview(data)
            h = header_of(view, length) if len(view) == length else None
            if h is None:
                corrupt.append(keys[index])
                break
            if not fits(h, shape, dtype):
                break
            if out_bytes is not None and h.codec == "raw" and h.payload_len == block_bytes:
                if off >= 0:
                    passed, failed = self._copy_run(slab, slots, i, view, h, out_bytes, rows, got)
                    got, i = got + passed, i + passed
                    if failed:
                        corrupt.append(keys[slots[i][0]])
                        break
                    continue  # done, or slot i has a header of its own: read above
                payload = np.frombuffer(view, np.uint8, block_bytes, h.header_len)  # inline
                sums = copy_hashed(
                    out_bytes, [rows[got] * block_bytes], payload, [0], block_bytes, h.layer_bytes
                )
                ok = sums[0] == list(h.checksums)
            else:
                ok = all(
                    checksum(view[o : o + h.layer_bytes]) == h.checksums[layer]
                    for layer, o in enumerate(range(h.header_len, h.total_len, h.layer_bytes))
                )
                if ok:
                    decode_layers(u8view(view), h, out[rows[got]], range(h.num_layers))
            if not ok:
                corrupt.append(keys[index])
                break
            got += 1
            i += 1
        if reply.lease_id or corrupt:
            link.release_later(reply.lease_id, corrupt)
        return got

    @staticmethod
    def _copy_run(
        slab: ShmSlab, slots: list[_Slot], i: int, view: memoryview, h: BlockHeader,
        out_bytes: np.ndarray, rows: Sequence[int], got: int,
    ) -> tuple[int, bool]:  # fmt: skip
        """The raw blocks in the slab from slots[i] on (slot i's header `view`, parsed as `h`)
        copied into out's rows rows[got], rows[got + 1], ... while their headers are h's
        layout: (how many passed, whether the next one failed a checksum). One C call checks
        every header and layer (kernels.copy_checked) where the kernels are built, else one
        block at a time."""
        block_bytes = h.payload_len
        run = []  # the slab offsets of the blocks from slot i on that are in the slab, h's length
        for _, off, length, _ in itertools.islice(slots, i, None):
            if off < 0 or length != h.total_len:
                break
            run.append(off)
        if kernels.copy_hashed_available():
            table, header_sum = table_offsets(view, h)
            res = kernels.copy_checked(
                out_bytes, [rows[got + j] * block_bytes for j in range(len(run))], slab.array,
                run, bytes(view[:table]), table, header_sum, h.header_len, block_bytes,
                h.layer_bytes,
            )  # fmt: skip
            if res.passed or res.why != 1:
                return res.passed, res.why == 2
            # slot i's own header refused there (more layers than the C side holds): alone here
        sums = copy_hashed(
            out_bytes, [rows[got] * block_bytes], slab.array, [run[0] + h.header_len],
            block_bytes, h.layer_bytes,
        )  # fmt: skip
        return (1, False) if sums[0] == list(h.checksums) else (0, True)

    def open_put(self, keys: list[bytes], header: BlockHeader, parent: bytes | None) -> BlockWriter:
        return ShmWriter(self, keys, header, parent)

    def close(self) -> None:
        if self.slab is not None:
            self.slab.close()
            self.slab = None


class ShmWriter(BlockWriter):
    """A put into the slab under a write lease: each layer is copied (and hashed) into the
    ranges the node reserved, the headers sealed there at commit."""

    def __init__(
        self, shm: ShmTransport, keys: list[bytes], header: BlockHeader, parent: bytes | None
    ):
        super().__init__(keys, header, parent)
        self.shm, self.link = shm, shm.link
        req = pb.KVLeaseRequest(
            mode=pb.KVLeaseRequest.WRITE,
            keys=keys,
            sizes=[header.total_len] * len(keys),
            parent=parent or b"",
            model_fingerprint=header.fingerprint,
            packed=True,
        )
        try:
            reply = self.link.stub.Lease(req, timeout=self.link.timeout)
        except grpc.RpcError as e:
            rpc_failed(e)
        self.lease_id, self.ttl = reply.lease_id, reply.ttl_s
        # (index in keys, slab offset) of the blocks the store does not hold yet
        self.slots = [(s.index, s.offset) for s in reply.slots] or list(
            zip(reply.indices, reply.offsets)
        )
        if self.slots:
            shm.check_slab(reply.shm_path)
        self.renewed = time.monotonic()
        # every layer's checksum was taken from the slab in the pass that copied it in
        # (write_whole, or copy_layer for each layer): the node then need not hash the payloads
        # again at commit
        self.hashed_in_copy = False
        self._copied: set[int] = set()  # layers copy_layer wrote
        self._hashed_after = False  # a layer write_layer wrote

    def _renew(self) -> None:
        # Before writing, never after: once a lease lapses its ranges may belong to another put.
        if self.slots and time.monotonic() - self.renewed > self.ttl / 3:
            try:
                self.link.stub.Lease(
                    pb.KVLeaseRequest(mode=pb.KVLeaseRequest.RENEW, lease_id=self.lease_id),
                    timeout=self.link.timeout,
                )
            except grpc.RpcError as e:
                self.closed = True
                rpc_failed(e)
            self.renewed = time.monotonic()

    def write_layer(self, layer: int, data: torch.Tensor) -> None:
        self._check_layer(layer, data)
        self._renew()
        self._hashed_after = True
        h, slab = self.header, self.shm.mapped()
        n = self.codec.layer_nbytes(h.shape[1:], h.dtype)
        for i, off in self.slots:
            start = off + h.layer_offset(layer)
            dst = slab.tensor[start : start + h.layer_bytes]
            self.codec.encode_layer(data[i], dst[:n])
            if n < h.layer_bytes:
                dst[n:].zero_()
            self.sums[i][layer] = checksum(slab.view[start : start + h.layer_bytes])
        self.written.add(layer)
        self.hashed_in_copy = False  # hashed from the slab after the copy, not in it

    def can_copy_layers(self, pool: torch.Tensor) -> bool:
        return pool.device.type == "cpu" and pool.is_contiguous() and self._fits_whole(pool)

    def copy_layer(
        self, layer: int, pool: np.ndarray, offsets: list[int], threads: int = 1
    ) -> None:
        if self.closed:
            raise RuntimeError("writer already committed or aborted")
        self._renew()
        h = self.header
        slots = list(self.slots)
        sums = copy_hashed(
            self.shm.mapped().array, [off + h.layer_offset(layer) for _, off in slots], pool,
            [offsets[i] for i, _ in slots], h.layer_bytes, h.layer_bytes, threads,
        )  # fmt: skip
        for (i, _), block_sums in zip(slots, sums):
            self.sums[i][layer] = block_sums[0]
        self.written.add(layer)
        self._copied.add(layer)
        # every layer hashed in its copy (none by write_layer): the node need not hash them again
        self.hashed_in_copy = len(self._copied) == h.num_layers and not self._hashed_after

    def can_write_whole(self, blocks: torch.Tensor) -> bool:
        return blocks.is_contiguous() and self._fits_whole(blocks)

    def write_whole(self, blocks: torch.Tensor) -> None:
        """All layers of unpadded raw blocks: one copy per block, each layer's checksum taken
        from the copy while it is still in cache."""
        self._renew()
        h, slab = self.header, self.shm.mapped()
        flat = blocks.reshape(-1).view(torch.uint8)
        src = (flat if flat.device.type == "cpu" else flat.cpu()).numpy()  # one copy off a device
        n = h.payload_len
        slots = list(self.slots)
        sums = copy_hashed(
            slab.array, [off + h.header_len for _, off in slots], src, [i * n for i, _ in slots],
            n, h.layer_bytes,
        )  # fmt: skip
        for (i, _), block_sums in zip(slots, sums):
            self.sums[i] = block_sums
        self.written.update(range(h.num_layers))
        self.hashed_in_copy = True

    def commit(self) -> PutResult:
        self._check_complete()
        self._renew()
        self.closed = True
        if not self.slots:
            return PutResult(0, len(self.keys))
        self._seal_headers()
        try:
            reply = self.link.stub.Commit(
                pb.KVCommitRequest(lease_id=self.lease_id, writer_hashed=self.hashed_in_copy),
                timeout=self.link.timeout,
            )
        except grpc.RpcError as e:
            rpc_failed(e)
        # the node answers for the blocks it reserved; the others were held when the lease was
        # granted
        return PutResult(reply.stored, reply.held + len(self.keys) - len(self.slots))

    def _seal_headers(self) -> None:
        """Every reserved block's header into the slab: one C call where the kernels are built
        (kernels.seal_headers: the same bytes as pack_header's), else one at a time."""
        slab, slots = self.shm.mapped(), list(self.slots)
        if kernels.copy_hashed_available():
            kernels.seal_headers(
                slab.array, [off for _, off in slots], fixed_fields(self.header),
                np.array([self.sums[i] for i, _ in slots], dtype=np.uint64).reshape(
                    len(slots), self.header.num_layers
                ),
                self.header.header_len,
            )  # fmt: skip
            return
        for i, off in slots:
            header = self._header(i)
            slab.view[off : off + len(header)] = header

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.slots:
            try:
                self.link.stub.Release(
                    pb.KVReleaseRequest(lease_id=self.lease_id), timeout=self.link.timeout
                )
            except grpc.RpcError as e:
                log.warning("abort of lease %d failed: %s", self.lease_id, e.details())
