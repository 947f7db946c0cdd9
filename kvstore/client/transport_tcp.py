"""The bulk-port transport (kvstore/bulk.py): blocks travel as plain frames on pooled TCP (or
TLS) connections to the node's bulk port, the client's choice for a node on another host. A
call that finds no connection (every one of the node's taken, the port gone) goes over gRPC,
logged and counted."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator

import numpy as np
import torch

from kvstore.block_header import BlockHeader, checksum, layer_ok
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
from kvstore.client.block_format import decode_layers
from kvstore.client.transport import BlockTransport, StoreLink, fits, get_staged, header_of
from kvstore.client.transport_grpc import GrpcTransport
from kvstore.client.writers import BlockWriter, PutResult, byte_rows
from kvstore.control import StoreUnavailable, raise_status
from servekit.security import SecurityConfig

log = logging.getLogger(__name__)
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
        if out_bytes is None or not direct(h):
            block = np.empty(h.total_len, np.uint8)  # the payload after room for the header
            recv_exact(sock, block.data[h.header_len :])
            if not _payload_ok(block.data[h.header_len :], h):
                return b
            decode_layers(torch.from_numpy(block), h, out[b], range(h.num_layers))
            b += 1
            continue
        run = 1
        while b + run < len(headers) and run * block_bytes < _RUN_BYTES:
            if not direct(headers[b + run]):
                break
            run += 1
        view = out_bytes[b * block_bytes : (b + run) * block_bytes].data
        recv_exact(sock, view)
        for j in range(run):
            if not _payload_ok(view[j * block_bytes : (j + 1) * block_bytes], headers[b + j]):
                return b + j
        b += run
    return b


@contextlib.contextmanager
def _bulk_call(what: str) -> Iterator[None]:
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


class TcpTransport(BlockTransport):
    name = "tcp"

    def __init__(self, link: StoreLink, bulk: BulkChannel):
        super().__init__(link)
        self.bulk = bulk
        self.grpc = GrpcTransport(link)  # a call that finds no bulk connection goes this way

    @classmethod
    def open(
        cls, link: StoreLink, security: SecurityConfig | None, required: bool
    ) -> TcpTransport | None:
        """The transport over the node's bulk port, connected once now (errors surface here,
        not mid-call); where it does not open: StoreUnavailable when `required` ("tcp"), else
        None (logged, and counted through the link where the node advertises the port)."""
        info = link.info
        if not info.bulk_port:
            why = "the node has no bulk port"
        else:
            bulk = BulkChannel(_host_of(link.address), info.bulk_port, security, link.timeout)
            try:
                bulk.open()
                return cls(link, bulk)
            except (OSError, BulkError) as e:
                bulk.close()
                why = f"its bulk port {info.bulk_port} did not open: {e}"
        if required:
            raise StoreUnavailable(f"store {link.address}: {why}")
        if info.bulk_port:
            link.fell_back(why, "blocks go")
        else:  # a node without the port: nothing fell back
            log.warning("store %s: %s; blocks go over gRPC", link.address, why)
        return None

    def _socket(self, op: str) -> socket.socket | None:
        """A bulk connection for one call; None (logged, counted through on_fallback) when no
        new one opens (every connection of the node taken, or the port gone): the call then goes
        over gRPC."""
        try:
            return self.bulk.take()
        except (OSError, BulkError) as e:
            self.link.fell_back(f"no bulk connection for a {op} ({e})", "this call goes")
            return None

    def get_into(self, keys: list[bytes], out: torch.Tensor, rows: list[int] | None) -> int:
        if rows is not None:  # blocks land in out[:k] as they arrive: staged for rows
            return get_staged(self, keys, out, rows)
        sock = self._socket("get")
        if sock is None:
            return self.grpc.get_into(keys, out, None)
        return self._get(keys, out, sock)

    def _get(self, keys: list[bytes], out: torch.Tensor, sock: socket.socket) -> int:
        """get_into over the bulk connection `sock`: unpadded raw blocks land straight in out
        (recv_into, no staging, a run of them a call), checked layer by layer right after they
        land. The connection goes back to the pool after a reply read whole, else it closes."""
        shape, dtype = tuple(out.shape[1:]), out.dtype
        headers: list[BlockHeader] = []
        corrupt: list[bytes] = []
        whole = False
        try:
            with _bulk_call("get"):
                send_frame(sock, GET, encode_keys(keys))
                raw_headers, lengths = decode_headers(expect(sock, HEADERS))
                for b, (raw, n) in enumerate(zip(raw_headers, lengths)):
                    h = header_of(raw, len(raw) + n, len(raw))
                    if h is None:
                        corrupt.append(keys[b])
                        break
                    if not fits(h, shape, dtype):
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
            self.link.release_later(0, corrupt)
        return got

    def open_put(self, keys: list[bytes], header: BlockHeader, parent: bytes | None) -> BlockWriter:
        sock = self._socket("put")
        if sock is None:
            return self.grpc.open_put(keys, header, parent)
        return TcpWriter(self.bulk, sock, keys, header, parent)

    def close(self) -> None:
        self.bulk.close()
        self.grpc.close()


class TcpWriter(BlockWriter):
    """A put over the bulk port: the node answers which blocks it takes (those it holds already
    are never sent), each layer of those goes as it is written, and the node checks every
    checksum at commit."""

    def __init__(
        self, bulk: BulkChannel, sock: socket.socket, keys: list[bytes], header: BlockHeader,
        parent: bytes | None,
    ):  # fmt: skip
        super().__init__(keys, header, parent)
        self.bulk = bulk
        self.sock: socket.socket | None = sock
        with self._exchange() as s:
            send_frame(
                s,
                PUT_OPEN,
                encode_open(
                    PutOpen(header.fingerprint, parent or b"", [header.total_len] * len(keys),
                            keys)
                ),
            )  # fmt: skip
            self.slots = decode_slots(expect(s, SLOTS))

    @contextlib.contextmanager
    def _exchange(self) -> Iterator[socket.socket]:
        """The connection, for frames to and from the node: a failure closes it (the node then
        drops the reservation) and is raised as _bulk_call raises it."""
        with _bulk_call("put"):
            try:
                if self.sock is None:  # dropped by a failure, or given back at commit
                    raise RuntimeError("writer already committed or aborted")
                yield self.sock
            except BaseException:
                self._drop()
                raise

    def _drop(self) -> None:
        self.closed = True
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def write_layer(self, layer: int, data: torch.Tensor) -> None:
        self._check_layer(layer, data)
        start, pieces = self.header.layer_offset(layer), []
        for i, raw in self._stored_rows(data, self.slots):
            self.sums[i][layer] = checksum(raw)
            pieces.append((i, start, raw))
        self._send(pieces)
        self.written.add(layer)

    def can_write_whole(self, blocks: torch.Tensor) -> bool:
        return byte_rows(blocks) is not None and self._fits_whole(blocks)

    def write_whole(self, blocks: torch.Tensor) -> None:
        """All layers of unpadded raw blocks: each block's payload in one piece, from where it
        lies."""
        h, rows = self.header, byte_rows(blocks)
        if rows is None:
            raise ValueError("blocks are not contiguous rows on the CPU (see can_write_whole)")
        pieces = []
        for i in self.slots:
            raw = rows[i].data
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
        with self._exchange() as s:
            send_frame(
                s,
                DATA,
                encode_data([(i, off, len(raw)) for i, off, raw in pieces]),
                [raw for _, _, raw in pieces],
            )

    def commit(self) -> PutResult:
        self._check_complete()
        with self._exchange() as s:
            headers = [self._header(i) for i in self.slots]
            send_frame(s, COMMIT, encode_commit(headers))
            stored, held = decode_done(expect(s, DONE))
        self.closed = True
        self.bulk.give_back(s)
        self.sock = None
        return PutResult(stored, held)

    def abort(self) -> None:
        if not self.closed:
            self._drop()  # the node releases the reservation when the connection ends
