"""What every gRPC write to a store node goes through, streamed (Put) or through the shared slab
(Lease WRITE, then Commit): the put's checks, its reservation and its commit, each failure ended
with the status a client acts on. Shared by the servicer's parts (rpc_stream.py, rpc_shm.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

import grpc

from kvstore.block_header import BlockCorrupt
from kvstore.types import StoreFull, write_problem
from protos import kvstore_pb2 as pb

if TYPE_CHECKING:  # the node owns its servicer: only the type goes the other way
    from kvstore.node.server import StoreNode


def abort(ctx: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """End the call with `code`. ServicerContext.abort always raises; saying so here lets the
    type checker see that the code after an abort does not run."""
    ctx.abort(code, details)
    raise AssertionError("ServicerContext.abort returned")  # grpc's abort never does


class Writes:
    """The write steps of `node`'s gRPC calls, over its store."""

    def __init__(self, node: StoreNode):
        self.node, self.store, self.cfg = node, node.store, node.cfg

    def check(
        self, ctx: grpc.ServicerContext, keys: list[bytes], sizes: list[int], fingerprint: str
    ) -> None:
        """INVALID_ARGUMENT unless the put is well-formed and of this node's model."""
        problem = write_problem(keys, sizes, fingerprint, self.cfg.model_fingerprint)
        if problem:
            abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, problem)

    def reserve(
        self, ctx: grpc.ServicerContext, keys: Sequence[bytes], sizes: Sequence[int], parent: bytes
    ) -> tuple[int, list[tuple[int, int]]]:
        """The store's reservation for the put (the store's lease id, [(block, offset)]), each
        block's parent the key before it; RESOURCE_EXHAUSTED when the dram tier cannot fit it."""
        parents: list[bytes | None] = [parent or None, *keys[:-1]]
        try:
            return self.store.reserve(list(keys), list(sizes), parents, self.cfg.lease_s)
        except StoreFull as e:
            abort(ctx, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    def commit(
        self, ctx: grpc.ServicerContext, lease_id: int, keys: Sequence[bytes], payloads: bool = True
    ) -> pb.KVPutReply:
        """Commit a write lease (see BlockStore.commit for `payloads`); the reply counts what it
        stored and what the node now holds of `keys`."""
        try:
            stored = self.store.commit(lease_id, payloads=payloads)
        except BlockCorrupt as e:
            abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, f"block refused: {e}")
        except KeyError as e:
            abort(ctx, grpc.StatusCode.NOT_FOUND, str(e).strip("'\""))
        self.node.publish_soon()
        return pb.KVPutReply(stored=stored, held=self.store.count_held(list(keys)))
