"""The one interface a StoreClient moves blocks through (BlockTransport: shm, tcp or gRPC, each in
its own module, kvstore/client/transport_*.py) and what every transport shares: the node's gRPC
connection (StoreLink: its Info, the unary calls, lease releases in the background, the count of
transfers that fell back to gRPC) and the checks every reader applies to a stored header."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import NoReturn

import grpc
import torch

from kvstore.block_header import BlockCorrupt, BlockHeader
from kvstore.client.block_format import parse_header
from kvstore.client.writers import BlockWriter
from kvstore.control import raise_rpc_error
from kvstore.slab import ShmSlab
from kvstore.types import grpc_options
from kvstore.wire import raw_get, raw_put
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc
from servekit.security import SecurityConfig, open_channel

log = logging.getLogger(__name__)


def rpc_failed(e: grpc.RpcError) -> NoReturn:
    """raise_rpc_error, typed as never returning (it always raises), so that a call answered in
    a `try` may return from it."""
    raise_rpc_error(e)
    raise AssertionError("raise_rpc_error returned")  # unreachable: it raised above


class Background:
    """Runs a client's background RPCs (lease releases) in order on one thread, each as a
    blocking unary call: a get does not wait for its release, and no release starts the spin
    thread that a `.future()` on an idle channel starts (milliseconds on a busy machine)."""

    def __init__(self) -> None:
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


class StoreLink:
    """The gRPC connection to one store node, which every transport uses whatever carries its
    blocks: leases and commits (shm), releases of corrupt blocks (all), the Get and Put streams
    (gRPC, and tcp when no bulk connection opens)."""

    def __init__(
        self,
        address: str,
        timeout_s: float,
        security: SecurityConfig | None,
        on_fallback: Callable[[str], None] | None,
    ):
        self.address, self.timeout = address, timeout_s
        # TLS and the cluster token when the cluster is configured with them
        self.channel = open_channel(address, security, grpc_options(256 << 20))
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.get, self.put = raw_get(self.channel), raw_put(self.channel)
        try:
            # waits for the channel to connect, but not as long as a transfer may take
            self.info: pb.KVInfoReply = self.stub.Info(
                pb.KVInfoRequest(), timeout=min(timeout_s, 5.0), wait_for_ready=True
            )
        except grpc.RpcError as e:
            self.channel.close()
            rpc_failed(e)
        self.chunk_bytes = self.info.chunk_bytes or (1 << 20)
        self.background = Background()
        self._on_fallback = on_fallback

    def refresh_info(self) -> pb.KVInfoReply:
        """Ask the node's Info again (a restarted node has a new slab)."""
        try:
            self.info = self.stub.Info(pb.KVInfoRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            rpc_failed(e)
        return self.info

    def fell_back(self, why: str, what_goes: str) -> None:
        """A transfer that could have used the bulk port goes over gRPC: logged and counted."""
        log.warning("store %s: %s; %s over gRPC", self.address, why, what_goes)
        if self._on_fallback is not None:
            self._on_fallback(why)

    def release_later(self, lease_id: int, corrupt: list[bytes]) -> None:
        """Release a read lease (and report the blocks that failed their checks) in the
        background: the copies are done, nothing waits on the answer."""
        req = pb.KVReleaseRequest(lease_id=lease_id, corrupt=corrupt)
        self.background.submit(lambda: self._release(req))

    def _release(self, req: pb.KVReleaseRequest) -> None:
        try:
            self.stub.Release(req, timeout=self.timeout)
        except (grpc.RpcError, ValueError) as e:  # ValueError: the channel was closed
            details = e.details() if isinstance(e, grpc.RpcError) else str(e)
            log.warning("lease %d release failed: %s", req.lease_id, details)


class BlockTransport(ABC):
    """How one client's blocks travel to and from its node, chosen once when the client is made
    (StoreClient): its arguments are checked there, so a transport only moves and checks
    blocks. A transport may carry one call another way (tcp: gRPC when no bulk connection
    opens), logged and counted through its link's fell_back."""

    name: str  # "shm", "tcp" or "grpc": what StoreClient.transport reports
    # the node's shared memory where this transport maps it (shm), else None: readable by a
    # caller that inspects or tampers with stored bytes (the tests)
    slab: ShmSlab | None = None

    def __init__(self, link: StoreLink):
        self.link = link

    @abstractmethod
    def get_into(self, keys: list[bytes], out: torch.Tensor, rows: list[int] | None) -> int:
        """StoreClient.get_into on checked arguments (keys not empty, out contiguous and large
        enough, rows distinct and inside out when given): the held prefix's length."""
        ...

    @abstractmethod
    def open_put(self, keys: list[bytes], header: BlockHeader, parent: bytes | None) -> BlockWriter:
        """A writer of blocks `keys` (not empty), each stored with `header`'s layout."""
        ...

    @abstractmethod
    def close(self) -> None:
        """Free what the transport holds (a mapping, connections); the link stays open."""
        ...


def get_staged(
    transport: BlockTransport, keys: list[bytes], out: torch.Tensor, rows: list[int]
) -> int:
    """get_into(rows=...) for a transport that cannot land each block in its row: the blocks
    into a staging tensor, then into out's rows (one scatter)."""
    staging = torch.empty((len(keys), *out.shape[1:]), dtype=out.dtype)
    got = transport.get_into(keys, staging, None)
    out[torch.tensor(rows[:got], dtype=torch.long)] = staging[:got].to(out.device)
    return got


def fits(h: BlockHeader, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether a stored block is out's block shape and dtype; logged (a miss) when not."""
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


def header_of(
    raw: bytes | memoryview, total_len: int, header_len: int | None = None
) -> BlockHeader | None:
    """The header `raw` begins with, if it parses and says the block is `total_len` bytes (its
    header `header_len` of them, when given); None: the block is corrupt."""
    try:
        h = parse_header(raw)
    except BlockCorrupt:
        return None
    if h.total_len != total_len or header_len not in (None, h.header_len):
        return None
    return h
