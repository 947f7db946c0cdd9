"""The store's bulk port: block bytes between hosts over a plain TCP socket (TLS when the cluster
has it), beside the node's gRPC service.

Python gRPC carries about 1 GB/s between two processes here whatever the message size (it keeps
one message in flight per stream and copies each through its own buffers); a socket moves the same
bytes at several times that, read by `recv_into` straight into the reader's tensor and sent from
the slab as it lies. Mooncake's transfer engine moves its blocks the same way over TCP. Lookups,
leases, stats and everything else stay on gRPC; this port carries only Get and Put.

A connection starts with HELLO (the cluster token) and is answered OK or ERR; then any number of
calls, one at a time:

    GET      keys                          -> HEADERS, then each block's payload bytes in order
    PUT_OPEN fingerprint, parent, sizes, keys -> SLOTS (the blocks the node does not hold yet)
    DATA     pieces (block, offset, length), then their bytes   (any number; slots only)
    COMMIT   the slots' headers             -> DONE stored, held

A frame is `u32 body length, u8 op, body`; DATA's and a GET's payload bytes follow their frame
unframed. An error is ERR (a gRPC status name and a message) and the node closes the connection:
the client's next call opens a fresh one. Torch-free: the store node serves this too.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from kvstore.keys import KEY_BYTES
from servekit.security import SecurityConfig, ssl_client_context

HELLO, OK, ERR, GET, HEADERS, PUT_OPEN, SLOTS, DATA, COMMIT, DONE = range(1, 11)
OP_NAMES = {
    HELLO: "HELLO", OK: "OK", ERR: "ERR", GET: "GET", HEADERS: "HEADERS", PUT_OPEN: "PUT_OPEN",
    SLOTS: "SLOTS", DATA: "DATA", COMMIT: "COMMIT", DONE: "DONE",
}  # fmt: skip
# gRPC status names an ERR carries (the client raises what raise_rpc_error would for each)
CODES = (
    "INVALID_ARGUMENT",
    "RESOURCE_EXHAUSTED",
    "NOT_FOUND",
    "UNAUTHENTICATED",
    "ABORTED",
    "UNAVAILABLE",
)
MAX_BODY = 16 << 20  # a frame's body (keys, headers): never a payload, which follows unframed
_FRAME = struct.Struct("<IB")
_DATA = struct.Struct("<IQQ")  # block index, byte offset in the encoded block, length
_U32 = struct.Struct("<I")
_DONE = struct.Struct("<QQ")
IDLE_S = 120.0  # a pooled connection idle this long is closed, not reused (the node may be gone)


class BulkError(Exception):
    """An ERR frame: `code` is a gRPC status name, `message` says what was wrong."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


# ---------------------------------------------------------------------- frames


def send_frame(sock: socket.socket, op: int, body: bytes = b"", payload=()) -> None:
    """One frame, then the `payload` buffers unframed, in order; no copy of them on a plain socket
    (sendmsg of all the pieces)."""
    head = _FRAME.pack(len(body), op)
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg under TLS
        sock.sendall(head + body)
        for p in payload:
            sock.sendall(p)
    else:
        _sendmsg_all(sock, [head, body, *payload])


def _sendmsg_all(sock: socket.socket, pieces: list) -> None:
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    i = 0
    while i < len(views):
        n = sock.sendmsg(views[i : i + 512])  # IOV_MAX is 1024 on Linux
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; ConnectionError if it closes first."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_frame(sock: socket.socket, max_body: int = MAX_BODY) -> tuple[int, memoryview] | None:
    """(op, body) of the next frame; None at a clean end of the connection (before a frame)."""
    head = bytearray(_FRAME.size)
    k = sock.recv_into(head, len(head))
    if not k:
        return None
    if k < len(head):
        recv_exact(sock, memoryview(head)[k:])
    length, op = _FRAME.unpack(head)
    if length > max_body:
        raise BulkError("INVALID_ARGUMENT", f"a {length}-byte frame is over {max_body} bytes")
    body = bytearray(length)
    if length:
        recv_exact(sock, memoryview(body))
    return op, memoryview(body)


def error_frame(code: str, message: str) -> bytes:
    return bytes([CODES.index(code)]) + message.encode()[:4096]


def expect(sock: socket.socket, op: int) -> memoryview:
    """The body of the next frame, which must be `op`; BulkError for an ERR (or anything else)."""
    got = recv_frame(sock)
    if got is None:
        raise ConnectionError(f"the store closed the bulk connection before {OP_NAMES[op]}")
    kind, body = got
    if kind == ERR:
        code = CODES[body[0]] if len(body) and body[0] < len(CODES) else "UNAVAILABLE"
        raise BulkError(code, bytes(body[1:]).decode(errors="replace"))
    if kind != op:
        raise BulkError("UNAVAILABLE", f"expected {OP_NAMES[op]}, got op {kind}")
    return body


# ---------------------------------------------------------------------- messages


def _take(body: memoryview, pos: int, n: int, what: str) -> tuple[memoryview, int]:
    if pos + n > len(body):
        raise BulkError("INVALID_ARGUMENT", f"{what} runs past the end of its frame")
    return body[pos : pos + n], pos + n


def encode_keys(keys: list[bytes]) -> bytes:
    return b"".join(keys)


def decode_keys(body: memoryview) -> list[bytes]:
    if len(body) % KEY_BYTES:
        raise BulkError(
            "INVALID_ARGUMENT", f"keys are {KEY_BYTES} bytes each; got {len(body)} bytes of keys"
        )
    raw = bytes(body)
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


def encode_headers(headers: list[bytes], payload_lens: list[int]) -> bytes:
    """HEADERS: how many blocks, each one's payload length (bytes after its header), headers."""
    out = [_U32.pack(len(headers)), struct.pack(f"<{len(headers)}Q", *payload_lens)]
    for h in headers:
        out += [_U32.pack(len(h)), h]
    return b"".join(out)


def decode_headers(body: memoryview) -> tuple[list[bytes], list[int]]:
    (n,), pos = _U32.unpack_from(body, 0), _U32.size
    lens, pos = _take(body, pos, 8 * n, "payload lengths")
    headers = []
    for _ in range(n):
        size, pos = _take(body, pos, 4, "a header's length")
        h, pos = _take(body, pos, _U32.unpack(size)[0], "a header")
        headers.append(bytes(h))
    return headers, list(struct.unpack(f"<{n}Q", lens))


class PutOpen(NamedTuple):
    """A PUT_OPEN's fields, as gRPC's KVPutOpen."""

    fingerprint: str  # the blocks' model fingerprint
    parent: bytes  # key of the block before the first ("" = the first block of a prompt)
    sizes: list[int]  # each block's encoded length
    keys: list[bytes]  # the blocks' keys


def encode_open(o: PutOpen) -> bytes:
    fp = o.fingerprint.encode()
    return b"".join(
        [
            struct.pack("<HH", len(fp), len(o.parent)),
            fp,
            o.parent,
            _U32.pack(len(o.keys)),
            struct.pack(f"<{len(o.sizes)}Q", *o.sizes),
            encode_keys(o.keys),
        ]
    )


def decode_open(body: memoryview) -> PutOpen:
    lens, pos = _take(body, 0, 4, "PUT_OPEN")
    fp_len, parent_len = struct.unpack("<HH", lens)
    fp, pos = _take(body, pos, fp_len, "the fingerprint")
    parent, pos = _take(body, pos, parent_len, "the parent key")
    count, pos = _take(body, pos, 4, "the block count")
    (n,) = _U32.unpack(count)
    sizes, pos = _take(body, pos, 8 * n, "the sizes")
    keys = decode_keys(body[pos:])
    if len(keys) != n:
        raise BulkError("INVALID_ARGUMENT", f"PUT_OPEN names {n} blocks but holds {len(keys)} keys")
    return PutOpen(
        bytes(fp).decode(errors="replace"), bytes(parent), list(struct.unpack(f"<{n}Q", sizes)),
        keys,
    )  # fmt: skip


def encode_slots(indices: list[int]) -> bytes:
    return _U32.pack(len(indices)) + struct.pack(f"<{len(indices)}I", *indices)


def decode_slots(body: memoryview) -> list[int]:
    (n,) = _U32.unpack_from(body, 0)
    return list(struct.unpack_from(f"<{n}I", body, _U32.size))


def encode_data(pieces: list[tuple[int, int, int]]) -> bytes:
    """DATA: (block index, byte offset in the encoded block, length) of each piece whose bytes
    follow the frame, in this order."""
    return _U32.pack(len(pieces)) + b"".join(_DATA.pack(*p) for p in pieces)


def decode_data(body: memoryview) -> list[tuple[int, int, int]]:
    (n,) = _U32.unpack_from(body, 0) if len(body) >= 4 else (-1,)
    if n < 0 or len(body) != _U32.size + n * _DATA.size:
        raise BulkError("INVALID_ARGUMENT", "a DATA frame's pieces do not fill its body")
    return [_DATA.unpack_from(body, _U32.size + i * _DATA.size) for i in range(n)]


def encode_commit(headers: list[bytes]) -> bytes:
    return b"".join([_U32.pack(len(headers))] + [_U32.pack(len(h)) + h for h in headers])


def decode_commit(body: memoryview) -> list[bytes]:
    count, pos = _take(body, 0, 4, "COMMIT")
    out = []
    for _ in range(_U32.unpack(count)[0]):
        size, pos = _take(body, pos, 4, "a header's length")
        h, pos = _take(body, pos, _U32.unpack(size)[0], "a header")
        out.append(bytes(h))
    return out


def encode_done(stored: int, held: int) -> bytes:
    return _DONE.pack(stored, held)


def decode_done(body: memoryview) -> tuple[int, int]:
    return _DONE.unpack(body)


# ---------------------------------------------------------------------- pacing


class Pacer:
    """Holds a sender to `gbps()` Gbit/s (read at every wait, so a change takes effect mid-call;
    0 = unlimited): a token bucket one piece deep. The node's link_gbps, for a thin link on one
    machine."""

    def __init__(self, gbps):
        self.gbps = gbps
        self.due = time.perf_counter()

    def wait(self, nbytes: int) -> None:
        """Before sending `nbytes`."""
        gbps = self.gbps()
        if gbps <= 0:
            return
        now = time.perf_counter()
        self.due = max(self.due, now - 0.001) + nbytes * 8 / (gbps * 1e9)
        if self.due > now:
            time.sleep(self.due - now)


# ---------------------------------------------------------------------- client side


class BulkChannel:
    """Connections to one store node's bulk port, kept open between calls (one call at a time
    each; concurrent calls open more)."""

    def __init__(
        self, host: str, port: int, security: SecurityConfig | None, timeout_s: float = 30.0
    ):
        self.host, self.port, self.timeout = host, port, timeout_s
        self.security = security or SecurityConfig()
        self._tls = ssl_client_context(self.security) if self.security.tls else None
        self._idle: list[tuple[socket.socket, float]] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=min(self.timeout, 5.0))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                name = self.security.tls_server_name or self.host
                sock = self._tls.wrap_socket(sock, server_hostname=name)
            sock.settimeout(self.timeout)
            send_frame(sock, HELLO, self.security.cluster_token.encode())
            expect(sock, OK)
        except BaseException:
            sock.close()
            raise
        return sock

    def open(self) -> None:
        """Connect once now (and keep the connection): errors surface here, not mid-call."""
        self.give_back(self.take())

    def take(self) -> socket.socket:
        """A connection for one call: give_back() it when the call ended cleanly, close it when
        not (a half-read reply cannot be resumed)."""
        with self._lock:
            while self._idle:
                sock, since = self._idle.pop()
                # an idle connection has nothing to read: if it has, the node closed it (a
                # restart) and the call goes on a fresh one
                if time.monotonic() - since < IDLE_S and not select.select([sock], [], [], 0)[0]:
                    return sock
                sock.close()
        return self._connect()

    def give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append((sock, time.monotonic()))
                return
        sock.close()

    @contextmanager
    def connection(self) -> Iterator[socket.socket]:
        """take() for the block's call; given back when it ends cleanly, closed when it raises."""
        sock = self.take()
        try:
            yield sock
        except BaseException:
            sock.close()
            raise
        self.give_back(sock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for s, _ in idle:
            s.close()
