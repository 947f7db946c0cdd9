"""The store node's side of the bulk port (kvstore/bulk.py says what travels on it): a listening
socket, one thread per connection, Get and Put served from and into the slab with the same leases,
checks and metrics as the gRPC calls."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

from kvstore.block_header import BlockCorrupt
from kvstore.bulk import (
    COMMIT,
    DATA,
    DONE,
    ERR,
    GET,
    HEADERS,
    HELLO,
    OK,
    OP_NAMES,
    PUT_OPEN,
    SLOTS,
    BulkError,
    Pacer,
    decode_commit,
    decode_data,
    decode_keys,
    decode_open,
    encode_done,
    encode_headers,
    encode_slots,
    error_frame,
    recv_exact,
    recv_frame,
    send_frame,
)
from kvstore.types import StoreFull, write_problem
from servekit.security import ssl_server_context, token_matches

if TYPE_CHECKING:  # the node owns its bulk server: only the type goes the other way
    from kvstore.node.server import StoreNode

log = logging.getLogger(__name__)
HANDSHAKE_S = 10.0  # a connection has this long to finish TLS and HELLO
IDLE_S = 300.0  # an idle connection is closed after this (clients reopen; see bulk.IDLE_S)


class BulkServer:
    """Serves a StoreNode's bulk port: start() binds and returns the port; stop() closes every
    connection (a transfer cut short releases its lease)."""

    def __init__(self, node: StoreNode):
        self.node, self.cfg, self.store = node, node.cfg, node.store
        self._tls = ssl_server_context(self.cfg.security) if self.cfg.security.tls else None
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def start(self) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.cfg.host, max(self.cfg.bulk_port, 0)))
        s.listen(64)
        self._listener = s
        t = threading.Thread(
            target=self._accept, args=(s,), name=f"bulk-{self.cfg.node_id}", daemon=True
        )
        t.start()
        self._threads.append(t)
        return s.getsockname()[1]

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            conns = list(self._conns)
        if self._listener is not None:
            try:  # wakes accept()
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in list(self._threads):
            t.join(timeout=5)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, peer = listener.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                if self._stopping:
                    sock.close()
                    return
                busy = len(self._conns) >= self.cfg.bulk_connections
                if not busy:
                    self._conns.add(sock)
            if busy:  # answered at once, as the gRPC calls over their limit are
                self.node.metrics.busy_refusals.labels(self.cfg.node_id).inc()
                log.warning("bulk port: %s refused, %d connections open", peer, len(self._conns))
                self._refuse(sock)
                continue
            t = threading.Thread(target=self._serve, args=(sock, peer), daemon=True)
            t.start()
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _refuse(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(1.0)
            msg = f"store node {self.cfg.node_id}: every bulk connection is taken"
            send_frame(sock, ERR, error_frame("RESOURCE_EXHAUSTED", msg))
        except OSError:
            pass
        sock.close()

    # ------------------------------------------------------------------ a connection

    def _serve(self, sock: socket.socket, peer) -> None:
        conn = sock
        try:
            conn.settimeout(HANDSHAKE_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:  # the TLS socket takes over sock's fd
                conn = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                with self._lock:  # what stop() shuts down, before the handshake can block
                    self._conns.discard(sock)
                    self._conns.add(conn)
                conn.do_handshake()
            self._hello(conn)
            while True:
                conn.settimeout(IDLE_S)
                frame = recv_frame(conn)
                if frame is None:
                    return
                conn.settimeout(self.cfg.lease_s)  # a call that stalls this long is dropped
                op, body = frame
                if op == GET:
                    self._get(conn, decode_keys(body))
                elif op == PUT_OPEN:
                    self._put(conn, body)
                else:
                    raise BulkError("INVALID_ARGUMENT", f"unexpected {OP_NAMES.get(op, op)}")
        except BulkError as e:  # the caller's mistake: said, then the connection ends
            log.warning("bulk port: %s from %s", e, peer)
            try:
                send_frame(conn, ERR, error_frame(e.code, e.message))
            except OSError:
                pass
        except (OSError, ValueError) as e:  # the peer went away or broke the stream mid-call
            if not self._stopping:
                log.info("bulk connection from %s ended: %s", peer, e)
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(sock)
                self._conns.discard(conn)

    def _hello(self, conn: socket.socket) -> None:
        frame = recv_frame(conn, max_body=4096)
        if frame is None or frame[0] != HELLO:
            raise BulkError("UNAUTHENTICATED", "a bulk connection starts with HELLO")
        if not token_matches(self.cfg.security, bytes(frame[1]).decode(errors="replace")):
            raise BulkError("UNAUTHENTICATED", "wrong or missing cluster token")
        send_frame(conn, OK)

    def _get(self, conn: socket.socket, keys: list[bytes]) -> None:
        t0 = time.perf_counter()
        lease_id, refs = self.store.acquire(keys, self.cfg.lease_s)
        self.node.publish_soon()
        sent = 0
        try:
            headed = self.store.read_headed(refs)
            views, headers = [memoryview(v) for v, _ in headed], [h for _, h in headed]
            head = encode_headers(
                [bytes(v[: h.header_len]) for v, h in zip(views, headers)],
                [h.total_len - h.header_len for h in headers],
            )
            payloads = [v[h.header_len : h.total_len] for v, h in zip(views, headers)]
            if self.node.link_gbps <= 0:  # from the leased slab ranges as they lie, one sendmsg
                send_frame(conn, HEADERS, head, payloads)
                sent = sum(len(p) for p in payloads)
                return
            send_frame(conn, HEADERS, head)
            pacer, chunk = Pacer(lambda: self.node.link_gbps), self.cfg.chunk_bytes
            for view, h in zip(views, headers):
                for o in range(h.header_len, h.total_len, chunk):
                    piece = view[o : min(o + chunk, h.total_len)]
                    pacer.wait(len(piece))
                    conn.sendall(piece)  # from the leased slab range as it lies
                    sent += len(piece)
        finally:
            if lease_id:
                self.store.release(lease_id)
                self.node.publish_soon()
            self.node.metrics.record("get", "tcp", sent, time.perf_counter() - t0)

    def _put(self, conn: socket.socket, body) -> None:
        t0 = time.perf_counter()
        op = decode_open(body)
        problem = write_problem(op.keys, op.sizes, op.fingerprint, self.cfg.model_fingerprint)
        if problem:
            raise BulkError("INVALID_ARGUMENT", problem)
        parents = [op.parent or None] + op.keys[:-1]
        try:
            lease_id, slots = self.store.reserve(op.keys, op.sizes, parents, self.cfg.lease_s)
        except StoreFull as e:
            raise BulkError("RESOURCE_EXHAUSTED", str(e)) from None
        self.node.publish_soon()  # a reservation may have evicted blocks
        where, done, received = dict(slots), False, 0
        # no dram tier: no slots, so nothing is written through the empty view
        view = self.node.slab.view if self.node.slab else memoryview(b"")
        try:
            send_frame(conn, SLOTS, encode_slots([i for i, _ in slots]))
            while True:
                frame = recv_frame(conn)
                if frame is None:
                    raise ConnectionError("the writer left before COMMIT; nothing stored")
                kind, body = frame
                # the connection is alive: keep its reservation (a lapsed one may be reused)
                if slots and not self.store.renew(lease_id, self.cfg.lease_s):
                    raise BulkError("ABORTED", "the put's reservation lapsed; nothing stored")
                if kind == DATA:
                    pieces = decode_data(body)
                    for b, offset, length in pieces:  # all checked before any byte lands
                        if where.get(b) is None or offset + length > op.sizes[b]:
                            raise BulkError(
                                "INVALID_ARGUMENT",
                                f"data for block {b} at {offset}+{length} is outside the blocks "
                                "this put writes",
                            )
                    for b, offset, length in pieces:
                        at = where[b] + offset
                        recv_exact(conn, view[at : at + length])
                        received += length
                elif kind == COMMIT:
                    headers = decode_commit(body)
                    if len(headers) != len(slots):
                        raise BulkError(
                            "INVALID_ARGUMENT", f"{len(headers)} headers for {len(slots)} slots"
                        )
                    for (i, off), h in zip(slots, headers):
                        if len(h) > op.sizes[i]:
                            raise BulkError(
                                "INVALID_ARGUMENT", f"header of block {i} is longer than the block"
                            )
                        view[off : off + len(h)] = h
                    stored = 0
                    if slots:
                        try:  # every layer's checksum is checked: the writer is another host
                            stored = self.store.commit(lease_id)
                        except BlockCorrupt as e:
                            raise BulkError("INVALID_ARGUMENT", f"block refused: {e}") from None
                        except KeyError as e:
                            raise BulkError("NOT_FOUND", str(e).strip("'\"")) from None
                        self.node.publish_soon()
                    done = True
                    held = self.store.count_held(op.keys)
                    # counted before the answer: a writer that reads the metrics next sees it
                    self.node.metrics.record("put", "tcp", received, time.perf_counter() - t0)
                    send_frame(conn, DONE, encode_done(stored, held))
                    return
                else:
                    raise BulkError("INVALID_ARGUMENT", f"unexpected {OP_NAMES.get(kind, kind)}")
        finally:
            if not done and slots:
                self.store.release(lease_id)
