"""StoreClient: batch reads into and writes from a caller's tensors, over shared memory when the
node is on this host, over its bulk port (kvstore/bulk.py) from other hosts, and over gRPC where
neither is open (the tiers above it: kvstore.KVConnector)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

import grpc
import numpy as np
import torch

import kernels
from kvstore.block_header import (
    BlockCorrupt,
    BlockHeader,
    checksum,
    fixed_fields,
    layer_ok,
    pack_header,
    table_offsets,
)
from kvstore.bulk import (
    COMMIT,
    DATA,
    DONE,
    GET,
    HEADERS,
    PUT_OPEN,
    SLOTS,
    BulkChannel,
    BulkError,
    PutOpen,
    decode_done,
    decode_headers,
    decode_slots,
    encode_commit,
    encode_data,
    encode_keys,
    encode_open,
    expect,
    recv_exact,
    send_frame,
)
from kvstore.client.block_format import (
    check_block,
    decode_layers,
    dtype_name,
    make_header,
    parse_header,
    u8view,
)
from kvstore.client.codecs import get_codec
from kvstore.control import (
    StoreUnavailable,
    clear_store,
    raise_rpc_error,
    raise_status,
    store_stats,
)
from kvstore.slab import ShmSlab
from kvstore.types import LookupResult, StoreStats, boot_id, grpc_options
from kvstore.wire import Part, parse_parts, put_data_chunk, raw_get, raw_put
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc
from servekit.security import SecurityConfig, open_channel

log = logging.getLogger(__name__)
PUT_STREAM_DEADLINE_S = 600.0
_FUSED_COPY_BYTES = 2 << 20  # blocks up to this are copied whole before their layers are checked


def _copy_hashed(
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
    mv, out = memoryview(dst), []
    for d, s in zip(dst_offsets, src_offsets):
        sums = []
        for o in range(0, nbytes, step):
            np.copyto(dst[d + o : d + o + step], src[s + o : s + o + step])
            sums += [
                checksum(mv[a : a + layer_bytes]) for a in range(d + o, d + o + step, layer_bytes)
            ]
        out.append(sums)
    return out


def _byte_rows(data: torch.Tensor) -> np.ndarray | None:
    """data [n, ...] as n rows of its bytes without a copy (numpy views: no tensor per row),
    when every row is contiguous on the CPU; None otherwise."""
    if data.device.type != "cpu" or data.dim() < 2:
        return None
    want, step = [], 1
    for d in reversed(data.shape[1:]):
        want.append(step)
        step *= d
    if list(data.stride()[1:]) != want[::-1]:
        return None
    return data.detach().view(torch.uint8).numpy().reshape(len(data), -1)


_RUN_BYTES = 2 << 20  # raw blocks received in one call, then hashed while still in cache


def _payload_ok(payload: memoryview, h: BlockHeader) -> bool:
    """Whether every layer of a block's payload (its bytes after the header) matches its
    checksum."""
    return all(layer_ok(payload, h, layer, -h.header_len) for layer in range(h.num_layers))


def _receive_blocks(sock: socket.socket, headers: list[BlockHeader], out: torch.Tensor) -> int:
    """Receive the payloads of blocks `headers` (in order) into out[:len(headers)]; how many
    arrived whole and passed their checksums (the stream is left unread after a bad one)."""
    block_bytes = out[0].numel() * out.element_size()
    out_bytes = out.view(-1).view(torch.uint8).numpy() if out.device.type == "cpu" else None

    def direct(h: BlockHeader) -> bool:  # its payload is the block tensor's bytes
        return out_bytes is not None and h.codec == "raw" and h.payload_len == block_bytes

    b = 0
    while b < len(headers):
        h = headers[b]
        if not direct(h):
            block = np.empty(h.total_len, np.uint8)  # the payload after room for the header
            recv_exact(sock, memoryview(block)[h.header_len :])
            if not _payload_ok(memoryview(block)[h.header_len :], h):
                return b
            decode_layers(torch.from_numpy(block), h, out[b], range(h.num_layers))
            b += 1
            continue
        run = 1
        while b + run < len(headers) and run * block_bytes < _RUN_BYTES:
            if not direct(headers[b + run]):
                break
            run += 1
        view = memoryview(out_bytes[b * block_bytes : (b + run) * block_bytes])
        recv_exact(sock, view)
        for j in range(run):
            if not _payload_ok(view[j * block_bytes : (j + 1) * block_bytes], headers[b + j]):
                return b + j
        b += run
    return b


class _Background:
    """Runs a client's background RPCs (lease releases) in order on one thread, each as a
    blocking unary call: a get does not wait for its release, and no release starts the spin
    thread that a `.future()` on an idle channel starts (milliseconds on a busy machine)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._todo: list[tuple[Future, Callable[[], object]]] = []
        self._running = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, call: Callable[[], object]) -> Future:
        """call() on the background thread, after everything submitted before it; its future."""
        f: Future = Future()
        with self._cond:
            if not self._closed:
                self._todo.append((f, call))
                if self._thread is None:  # started by the first call: many clients never need it
                    self._thread = threading.Thread(
                        target=self._run, name="kvstore-client", daemon=True
                    )
                    self._thread.start()
                self._cond.notify_all()
                return f
        self._call(f, call)  # after close(): on the caller's own thread
        return f

    @staticmethod
    def _call(f: Future, call: Callable[[], object]) -> None:
        try:
            f.set_result(call())
        except BaseException as e:  # the submitter's to handle, through the future
            f.set_exception(e)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._todo and not self._closed:
                    self._cond.wait()
                if not self._todo:
                    return
                f, call = self._todo.pop(0)
                self._running = True
            try:
                self._call(f, call)
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every call submitted so far has run."""
        with self._cond:
            while self._todo or self._running:
                self._cond.wait()

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()


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


@contextlib.contextmanager
def _bulk_call(what: str):
    """Bulk-port failures as the exceptions gRPC's stand for (raise_status); a socket that fails
    is StoreUnavailable."""
    try:
        yield
    except BulkError as e:
        raise_status(e.code, e.message)
    except OSError as e:  # ConnectionError, timeouts, TLS errors
        raise StoreUnavailable(f"store bulk {what}: {e}") from None


def _host_of(address: str) -> str:
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


class PutResult(NamedTuple):
    stored: int  # blocks newly written
    held: int  # blocks of the put the store holds now


class StoreClient:
    """A client of one store node. transport: "auto" (shm on the same host, else the node's bulk
    port, else gRPC), "shm", "tcp" (the bulk port) or "grpc". Under "auto", a bulk port that
    cannot be opened leaves the client on gRPC: logged, and counted through on_fallback(why)."""

    def __init__(
        self,
        address: str,
        transport: str = "auto",
        timeout_s: float = 30.0,
        security: SecurityConfig | None = None,
        on_fallback: Callable[[str], None] | None = None,
    ):
        self.address, self.timeout = address, timeout_s
        # TLS and the cluster token when the cluster is configured with them
        self.channel = open_channel(address, security, grpc_options(256 << 20))
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self._get, self._put = raw_get(self.channel), raw_put(self.channel)
        try:
            # waits for the channel to connect, but not as long as a transfer may take
            self.info = self.stub.Info(
                pb.KVInfoRequest(), timeout=min(timeout_s, 5.0), wait_for_ready=True
            )
        except grpc.RpcError as e:
            self.channel.close()
            raise_rpc_error(e)
        self.slab: ShmSlab | None = None
        self.bulk: BulkChannel | None = None
        self._background = _Background()
        if transport not in ("auto", "shm", "tcp", "grpc"):
            self.channel.close()
            raise ValueError(f"transport must be auto, shm, tcp or grpc, got {transport!r}")
        if transport in ("auto", "shm"):
            same_host = (
                self.info.hostname == socket.gethostname()
                and self.info.boot_id == boot_id()
                and self.info.shm_path
                and os.path.exists(self.info.shm_path)
                and _is_slab_file(self.info.shm_path)
            )
            if same_host:
                try:
                    self.slab = ShmSlab(self.info.shm_path, self.info.shm_size, create=False)
                except OSError as e:
                    log.warning("cannot map %s (%s): using gRPC", self.info.shm_path, e)
            if transport == "shm" and self.slab is None:
                self.channel.close()
                raise ValueError(f"store {address} has no shared memory reachable from this host")
        self._on_fallback = on_fallback
        if transport == "tcp" or (transport == "auto" and self.slab is None):
            self._open_bulk(transport, security)
        self.transport = "shm" if self.slab else "tcp" if self.bulk else "grpc"
        self.chunk_bytes = self.info.chunk_bytes or (1 << 20)

    def _fell_back(self, why: str, what_goes: str) -> None:
        """A transfer that could have used the bulk port goes over gRPC: logged and counted."""
        log.warning("store %s: %s; %s over gRPC", self.address, why, what_goes)
        if self._on_fallback is not None:
            self._on_fallback(why)

    def _open_bulk(self, transport: str, security) -> None:
        why = ""
        if not self.info.bulk_port:
            why = "the node has no bulk port"
        else:
            bulk = BulkChannel(
                _host_of(self.address), self.info.bulk_port, security, self.timeout
            )
            try:
                bulk.open()
                self.bulk = bulk
                return
            except (OSError, BulkError) as e:
                bulk.close()
                why = f"its bulk port {self.info.bulk_port} did not open: {e}"
        if transport == "tcp":
            self.channel.close()
            raise StoreUnavailable(f"store {self.address}: {why}")
        if self.info.bulk_port:
            self._fell_back(why, "blocks go")
        else:  # a node without the port: nothing fell back
            log.warning("store %s: %s; blocks go over gRPC", self.address, why)

    def _bulk_socket(self, op: str):
        """A bulk connection for one call; None (logged, counted through on_fallback) when no
        new one opens (every connection of the node taken, or the port gone): the call then goes
        over gRPC."""
        try:
            return self.bulk.take()
        except (OSError, BulkError) as e:
            self._fell_back(f"no bulk connection for a {op} ({e})", "this call goes")
            return None

    def _check_slab(self, shm_path: str) -> None:
        """Map the slab a lease's offsets refer to, if the node was restarted since we mapped
        one."""
        if shm_path == self.slab.path:
            return
        try:
            self.info = self.stub.Info(pb.KVInfoRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            raise_rpc_error(e)
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
            raise_rpc_error(e)
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
        if rows is not None and (self.slab is None or out.device.type != "cpu"):
            staging = torch.empty((len(keys), *out.shape[1:]), dtype=out.dtype)
            got = self.get_into(keys, staging)
            out[torch.tensor(rows[:got], dtype=torch.long)] = staging[:got].to(out.device)
            return got
        if self.slab is not None:
            return self._get_shm(keys, out, rows if rows is not None else range(len(keys)))
        sock = self._bulk_socket("get") if self.bulk is not None else None
        if sock is not None:
            return self._get_tcp(keys, out, sock)
        return self._get_grpc(keys, out)

    @staticmethod
    def _fits(h: BlockHeader, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        if h.shape != shape or h.dtype != dtype:
            log.warning(
                "stored block is %s %s, out is %s %s: treated as a miss",
                list(h.shape),
                h.dtype,
                list(shape),
                dtype,
            )
            return False
        return True

    @staticmethod
    def _header_of(raw, total_len: int, header_len: int | None = None) -> BlockHeader | None:
        """The header `raw` begins with, if it parses and says the block is `total_len` bytes
        (its header `header_len` of them, when given); None: the block is corrupt."""
        try:
            h = parse_header(raw)
        except BlockCorrupt:
            return None
        if h.total_len != total_len or header_len not in (None, h.header_len):
            return None
        return h

    def _get_shm(self, keys: list[bytes], out: torch.Tensor, rows) -> int:
        """get_into over the slab: block i of the held prefix into out[rows[i]]."""
        try:
            reply = self.stub.Lease(
                pb.KVLeaseRequest(mode=pb.KVLeaseRequest.READ, keys=keys, packed=True),
                timeout=self.timeout,
            )
        except grpc.RpcError as e:
            raise_rpc_error(e)
        if reply.slots:  # a block came inline (from ssd): the node answered per-block slots
            slots = [(s.index, s.offset, s.length, s.data) for s in reply.slots]
        else:
            slots = zip(reply.indices, reply.offsets, reply.lengths, itertools.repeat(b""))
        if reply.slots or reply.offsets:
            self._check_slab(reply.shm_path)
        got, corrupt = 0, []
        shape, dtype = tuple(out.shape[1:]), out.dtype
        block_bytes = out[0].numel() * out.element_size()
        # unpadded raw blocks are the block tensor's bytes: copied as plain bytes into out, a run
        # of those in the slab in one call that also checks their headers (_copy_run)
        out_bytes = out.view(-1).view(torch.uint8).numpy() if out.device.type == "cpu" else None
        slab_view = self.slab.view
        slots = list(slots)
        i = 0
        while i < len(slots):
            index, off, length, data = slots[i]
            view = slab_view[off : off + length] if off >= 0 else memoryview(data)
            h = self._header_of(view, length) if len(view) == length else None
            if h is None:
                corrupt.append(keys[index])
                break
            if not self._fits(h, shape, dtype):
                break
            raw = out_bytes is not None and h.codec == "raw" and h.payload_len == block_bytes
            if raw and off >= 0:
                passed, failed = self._copy_run(slots, i, view, h, out_bytes, rows, got)
                got, i = got + passed, i + passed
                if failed:
                    corrupt.append(keys[slots[i][0]])
                    break
                continue  # done, or slot i has a header of its own: read above
            if raw:  # inline
                payload = np.frombuffer(view, np.uint8, block_bytes, h.header_len)
                sums = _copy_hashed(
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
            self._release_later(reply.lease_id, corrupt)
        return got

    def _copy_run(self, slots, i: int, view, h: BlockHeader, out_bytes, rows, got: int):
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
                out_bytes, [rows[got + j] * block_bytes for j in range(len(run))], self.slab.array,
                run, bytes(view[:table]), table, header_sum, h.header_len, block_bytes,
                h.layer_bytes,
            )  # fmt: skip
            if res.passed or res.why != 1:
                return res.passed, res.why == 2
            # slot i's own header refused there (more layers than the C side holds): alone here
        sums = _copy_hashed(
            out_bytes, [rows[got] * block_bytes], self.slab.array, [run[0] + h.header_len],
            block_bytes, h.layer_bytes,
        )  # fmt: skip
        return (1, False) if sums[0] == list(h.checksums) else (0, True)

    def _release_later(self, lease_id: int, corrupt: list[bytes]) -> None:
        # Released in the background: the copies are done, nothing waits on the answer.
        req = pb.KVReleaseRequest(lease_id=lease_id, corrupt=corrupt)
        self._background.submit(lambda: self._release(req))

    def _release(self, req: pb.KVReleaseRequest) -> None:
        try:
            self.stub.Release(req, timeout=self.timeout)
        except (grpc.RpcError, ValueError) as e:  # ValueError: the channel was closed
            details = e.details() if isinstance(e, grpc.RpcError) else str(e)
            log.warning("lease %d release failed: %s", req.lease_id, details)

    def _get_tcp(self, keys: list[bytes], out: torch.Tensor, sock) -> int:
        """get_into over the bulk connection `sock`: unpadded raw blocks land straight in out
        (recv_into, no staging, a run of them a call), checked layer by layer right after they
        land. The connection goes back to the pool after a reply read whole, else it closes."""
        shape, dtype = tuple(out.shape[1:]), out.dtype
        headers, corrupt, whole = [], [], False
        try:
            with _bulk_call("get"):
                send_frame(sock, GET, encode_keys(keys))
                raw_headers, lengths = decode_headers(expect(sock, HEADERS))
                for b, (raw, n) in enumerate(zip(raw_headers, lengths)):
                    h = self._header_of(raw, len(raw) + n, len(raw))
                    if h is None:
                        corrupt.append(keys[b])
                        break
                    if not self._fits(h, shape, dtype):
                        break
                    headers.append(h)
                got = _receive_blocks(sock, headers, out)
                if got < len(headers):
                    corrupt.append(keys[got])
                whole = got == len(raw_headers)  # else the rest is not read: the socket closes
        finally:
            if whole:
                self.bulk.give_back(sock)
            else:
                sock.close()
        if corrupt:
            self._release_later(0, corrupt)
        return got

    def _get_grpc(self, keys: list[bytes], out: torch.Tensor) -> int:
        try:
            stream = self._get(pb.KVGetRequest(keys=keys), timeout=self.timeout)
            raw = next(stream, None)
            if raw is None:
                return 0
            first = pb.KVGetChunk.FromString(raw)
            shape, dtype = tuple(out.shape[1:]), out.dtype
            headers: list[BlockHeader] = []
            for raw in first.headers:
                try:
                    h = parse_header(raw)
                except BlockCorrupt:
                    break
                if not self._fits(h, shape, dtype):
                    break
                headers.append(h)
            k, corrupt = self._receive_layers(stream, headers, out)
        except grpc.RpcError as e:
            raise_rpc_error(e)
        if corrupt:
            self._release_later(0, [keys[b] for b in corrupt])
        return k

    @staticmethod
    def _receive_layers(stream, headers: list[BlockHeader], out: torch.Tensor):
        """Write the layers a Get stream carries into out[:len(headers)], checking each layer as
        its last piece lands; (k, blocks that failed a check): out[:k] is checked, whole data.
        Unpadded raw layers land straight in out (no staging copy); a layer that fails its
        checksum, or never arrives whole, ends the prefix."""
        k, corrupt = len(headers), []
        block_bytes = out[0].numel() * out.element_size()
        out_bytes = out.view(-1).view(torch.uint8).numpy() if out.device.type == "cpu" else None
        direct = [
            out_bytes is not None and h.codec == "raw" and h.payload_len == block_bytes
            for h in headers
        ]
        # bytes still to come of each (block, layer); a layer is checked when it reaches 0
        left = {
            (b, layer): h.layer_bytes
            for b, h in enumerate(headers)
            for layer in range(h.num_layers)
        }
        stage: dict[tuple[int, int], np.ndarray] = {}  # split layers of blocks decoded by codec
        for raw in stream:
            for p in parse_parts(raw, 3):
                b, layer, n = p.block, p.layer, len(p.data)
                todo = left.get((b, layer)) if b < k else None
                if todo is None:  # past the prefix, or a layer done already: never rewritten
                    continue
                h = headers[b]
                rel = p.offset - h.layer_offset(layer)
                if rel < 0 or rel + n > h.layer_bytes or n > todo:
                    corrupt.append(b)  # a piece outside its layer: the block is not trusted
                    k = b
                    continue
                if direct[b]:
                    at = b * block_bytes + layer * h.layer_bytes
                    np.copyto(out_bytes[at + rel : at + rel + n], np.frombuffer(p.data, np.uint8))
                elif rel or n < h.layer_bytes:
                    buf = stage.get((b, layer))
                    if buf is None:
                        buf = stage[(b, layer)] = np.empty(h.layer_bytes, np.uint8)
                    np.copyto(buf[rel : rel + n], np.frombuffer(p.data, np.uint8))
                left[(b, layer)] = todo = todo - n
                if todo:
                    continue
                del left[(b, layer)]
                if direct[b]:
                    data = out_bytes[at : at + h.layer_bytes]
                else:
                    data = stage.pop((b, layer), None)
                    data = p.data if data is None else data
                if checksum(data) != h.checksums[layer]:
                    corrupt.append(b)
                    k = b
                    continue
                if not direct[b]:
                    decode_layers(u8view(data), h, out[b], [layer], base=-h.layer_offset(layer))
        missing = [b for b, _ in left if b < k]
        return min([k, *missing]), corrupt

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
            raise_rpc_error(e)
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
            if isinstance(w, (_ShmWriter, _TcpWriter)) and w.can_write_whole(blocks):
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
            return _NoWriter(self, [], header, parent)
        if self.slab is not None:
            return _ShmWriter(self, list(keys), header, parent)
        sock = self._bulk_socket("put") if self.bulk is not None else None
        if sock is not None:
            return _TcpWriter(self, list(keys), header, parent, sock)
        return _GrpcWriter(self, list(keys), header, parent)

    # ------------------------------------------------------------------ the rest

    def stats(self) -> StoreStats:
        self._background.drain()
        return store_stats(self.stub, self.timeout)

    def clear(self) -> int:
        """Drop every block the node holds (see KVStore.Clear); how many went now."""
        self._background.drain()
        return clear_store(self.stub, self.timeout)

    def close(self) -> None:
        self._background.close()
        if self.bulk is not None:
            self.bulk.close()
        if self.slab is not None:
            self.slab.close()
            self.slab = None
        self.channel.close()

    def __enter__(self) -> StoreClient:
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

    def _check_complete(self) -> None:
        missing = set(range(self.header.num_layers)) - self.written
        if missing:
            self.abort()
            raise ValueError(f"layers {sorted(missing)} were never written; the put is aborted")

    def _header(self, i: int) -> bytes:
        """Block i's final header (its layers' checksums known)."""
        return pack_header(self.header._replace(checksums=tuple(self.sums[i])))

    def _headers(self) -> list[bytes]:
        self._check_complete()
        return [self._header(i) for i in range(len(self.keys))]

    @property
    def _raw_unpadded(self) -> bool:
        """Whether a stored layer is the block tensor's layer as it is (raw, no padding)."""
        h = self.header
        return h.codec == "raw" and self.codec.layer_nbytes(h.shape[1:], h.dtype) == h.layer_bytes

    def _fits_whole(self, blocks: torch.Tensor) -> bool:
        """Whether `blocks` [n, *block shape] are stored exactly as their bytes lie."""
        h = self.header
        return self._raw_unpadded and tuple(blocks.shape[1:]) == h.shape and blocks.dtype == h.dtype

    def _stored_rows(self, data: torch.Tensor, indices):
        """(i, block i's layer as stored) for each i of indices: the caller's own bytes where the
        layer is unpadded raw, else encoded into a fresh buffer."""
        h, layer_bytes = self.header, self.header.layer_bytes
        n = self.codec.layer_nbytes(h.shape[1:], h.dtype)
        rows = _byte_rows(data) if self._raw_unpadded else None
        for i in indices:
            if rows is not None:
                raw = memoryview(rows[i])
            else:
                buf = np.zeros(layer_bytes, np.uint8)
                self.codec.encode_layer(data[i], torch.from_numpy(buf[:n]))
                raw = memoryview(buf)
            yield i, raw

    def write_layer(self, layer: int, data: torch.Tensor) -> None: ...

    def can_copy_layers(self, pool: torch.Tensor) -> bool:
        """Whether `copy_layer` takes layers straight from `pool` [num_blocks, *block shape]: a
        contiguous CPU pool of the blocks exactly as they are stored (only shared memory)."""
        return False

    def copy_layer(
        self, layer: int, pool: np.ndarray, offsets: list[int], threads: int = 1
    ) -> None:
        """`write_layer` of layer `layer` read where it lies: key i's layer at byte offsets[i] of
        the pool's bytes (flat uint8), hashed in the pass that copies it; on `threads` threads
        (a caller whose other threads would only wait)."""
        raise NotImplementedError

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
            packed=True,
        )
        try:
            reply = client.stub.Lease(req, timeout=client.timeout)
        except grpc.RpcError as e:
            raise_rpc_error(e)
        self.lease_id, self.ttl = reply.lease_id, reply.ttl_s
        # (index in keys, slab offset) of the blocks the store does not hold yet
        self.slots = [(s.index, s.offset) for s in reply.slots] or list(
            zip(reply.indices, reply.offsets)
        )
        if self.slots:
            client._check_slab(reply.shm_path)
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
                self.client.stub.Lease(
                    pb.KVLeaseRequest(mode=pb.KVLeaseRequest.RENEW, lease_id=self.lease_id),
                    timeout=self.client.timeout,
                )
            except grpc.RpcError as e:
                self.closed = True
                raise_rpc_error(e)
            self.renewed = time.monotonic()

    def write_layer(self, layer, data):
        self._check_layer(layer, data)
        self._renew()
        self._hashed_after = True
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
        self.hashed_in_copy = False  # hashed from the slab after the copy, not in it

    def can_copy_layers(self, pool: torch.Tensor) -> bool:
        return pool.device.type == "cpu" and pool.is_contiguous() and self._fits_whole(pool)

    def copy_layer(self, layer, pool, offsets, threads=1):
        if self.closed:
            raise RuntimeError("writer already committed or aborted")
        self._renew()
        h = self.header
        slots = list(self.slots)
        sums = _copy_hashed(
            self.client.slab.array, [off + h.layer_offset(layer) for _, off in slots], pool,
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
        h, slab = self.header, self.client.slab
        src = blocks.reshape(-1).view(torch.uint8)
        src = (src if src.device.type == "cpu" else src.cpu()).numpy()  # one copy off a device
        n = h.payload_len
        slots = list(self.slots)
        sums = _copy_hashed(
            slab.array, [off + h.header_len for _, off in slots], src, [i * n for i, _ in slots],
            n, h.layer_bytes,
        )  # fmt: skip
        for (i, _), block_sums in zip(slots, sums):
            self.sums[i] = block_sums
        self.written.update(range(h.num_layers))
        self.hashed_in_copy = True

    def commit(self):
        self._check_complete()
        self._renew()
        self.closed = True
        if not self.slots:
            return PutResult(0, len(self.keys))
        self._seal_headers()
        try:
            reply = self.client.stub.Commit(
                pb.KVCommitRequest(lease_id=self.lease_id, writer_hashed=self.hashed_in_copy),
                timeout=self.client.timeout,
            )
        except grpc.RpcError as e:
            raise_rpc_error(e)
        # the node answers for the blocks it reserved; the others were held when the lease was
        # granted
        return PutResult(reply.stored, reply.held + len(self.keys) - len(self.slots))

    def _seal_headers(self) -> None:
        """Every reserved block's header into the slab: one C call where the kernels are built
        (kernels.seal_headers: the same bytes as pack_header's), else one at a time."""
        slab, slots = self.client.slab, list(self.slots)
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
        chunk = self.client.chunk_bytes
        parts, size = [], 0
        start = self.header.layer_offset(layer)
        for i, raw in self._stored_rows(data, range(len(self.keys))):
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
            raise_rpc_error(e)
        return PutResult(reply.stored, reply.held)

    def abort(self):
        if self.closed:
            return
        self.closed = True
        self.call.cancel()
        self.q.put(None)


class _TcpWriter(BlockWriter):
    """A put over the bulk port: the node answers which blocks it takes (those it holds already
    are never sent), each layer of those goes as it is written, and the node checks every
    checksum at commit."""

    def __init__(self, client, keys, header, parent, sock):
        super().__init__(client, keys, header, parent)
        self.bulk, self.sock = client.bulk, sock
        with self._exchange():
            send_frame(
                self.sock,
                PUT_OPEN,
                encode_open(
                    PutOpen(header.fingerprint, parent or b"", [header.total_len] * len(keys),
                            keys)
                ),
            )  # fmt: skip
            self.slots = decode_slots(expect(self.sock, SLOTS))

    @contextlib.contextmanager
    def _exchange(self):
        """Frames to and from the node: a failure closes the connection (the node then drops
        the reservation) and is raised as _bulk_call raises it."""
        with _bulk_call("put"):
            try:
                yield
            except BaseException:
                self._drop()
                raise

    def _drop(self) -> None:
        self.closed = True
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def write_layer(self, layer, data):
        self._check_layer(layer, data)
        start, pieces = self.header.layer_offset(layer), []
        for i, raw in self._stored_rows(data, self.slots):
            self.sums[i][layer] = checksum(raw)
            pieces.append((i, start, raw))
        self._send(pieces)
        self.written.add(layer)

    def can_write_whole(self, blocks: torch.Tensor) -> bool:
        return _byte_rows(blocks) is not None and self._fits_whole(blocks)

    def write_whole(self, blocks: torch.Tensor) -> None:
        """All layers of unpadded raw blocks: each block's payload in one piece, from where it
        lies."""
        h, rows = self.header, _byte_rows(blocks)
        pieces = []
        for i in self.slots:
            raw = memoryview(rows[i])
            self.sums[i] = [
                checksum(raw[o : o + h.layer_bytes]) for o in range(0, h.payload_len, h.layer_bytes)
            ]
            pieces.append((i, h.header_len, raw))
        self._send(pieces)
        self.written.update(range(h.num_layers))

    def _send(self, pieces: list[tuple[int, int, memoryview]]) -> None:
        """One DATA frame of (block, offset, bytes) pieces."""
        if not pieces:
            return
        with self._exchange():
            send_frame(
                self.sock,
                DATA,
                encode_data([(i, off, len(raw)) for i, off, raw in pieces]),
                [raw for _, _, raw in pieces],
            )

    def commit(self):
        self._check_complete()
        with self._exchange():
            headers = [self._header(i) for i in self.slots]
            send_frame(self.sock, COMMIT, encode_commit(headers))
            stored, held = decode_done(expect(self.sock, DONE))
        self.closed = True
        self.bulk.give_back(self.sock)
        self.sock = None
        return PutResult(stored, held)

    def abort(self):
        if not self.closed:
            self._drop()  # the node releases the reservation when the connection ends
