"""The gRPC transport: blocks travel in the node's Get and Put streams, layer by layer (where no
shared memory or bulk port is open, and for a tcp call that finds no bulk connection); and
whole records, which always travel this way (read_record)."""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterable

import grpc
import numpy as np
import torch

from kvstore.block_header import BlockCorrupt, BlockHeader, checksum
from kvstore.client.block_format import check_block, decode_layers, parse_header, u8view
from kvstore.client.transport import BlockTransport, StoreLink, fits, get_staged, rpc_failed
from kvstore.client.writers import BlockWriter, PutResult
from kvstore.wire import Part, parse_parts, put_data_chunk
from protos import kvstore_pb2 as pb

log = logging.getLogger(__name__)
PUT_STREAM_DEADLINE_S = 600.0


def receive_layers(
    stream: Iterable[bytes], headers: list[BlockHeader], out: torch.Tensor
) -> tuple[int, list[int]]:
    """Write the layers a Get stream carries into out[:len(headers)], checking each layer as
    its last piece lands; (k, blocks that failed a check): out[:k] is checked, whole data.
    Unpadded raw layers land straight in out (no staging copy); a layer that fails its
    checksum, or never arrives whole, ends the prefix."""
    k, corrupt = len(headers), []
    block_bytes = out[0].numel() * out.element_size()
    out_bytes = out.view(-1).view(torch.uint8).numpy() if out.device.type == "cpu" else None
    # each block's destination bytes where its payload is the block tensor's bytes, else None
    direct = [
        out_bytes if h.codec == "raw" and h.payload_len == block_bytes else None for h in headers
    ]
    # bytes still to come of each (block, layer); a layer is checked when it reaches 0
    left = {
        (b, layer): h.layer_bytes for b, h in enumerate(headers) for layer in range(h.num_layers)
    }
    stage: dict[tuple[int, int], np.ndarray] = {}  # split layers of blocks decoded by codec
    for raw in stream:
        for p in parse_parts(raw, 3):
            b, layer, n = p.block, p.layer, len(p.data)
            todo = left.get((b, layer)) if b < k else None
            if todo is None:  # past the prefix, or a layer done already: never rewritten
                continue
            h, dst = headers[b], direct[b]
            rel = p.offset - h.layer_offset(layer)
            if rel < 0 or rel + n > h.layer_bytes or n > todo:
                corrupt.append(b)  # a piece outside its layer: the block is not trusted
                k = b
                continue
            at = b * block_bytes + layer * h.layer_bytes
            if dst is not None:
                np.copyto(dst[at + rel : at + rel + n], np.frombuffer(p.data, np.uint8))
            elif rel or n < h.layer_bytes:
                buf = stage.get((b, layer))
                if buf is None:
                    buf = stage[(b, layer)] = np.empty(h.layer_bytes, np.uint8)
                np.copyto(buf[rel : rel + n], np.frombuffer(p.data, np.uint8))
            left[(b, layer)] = todo = todo - n
            if todo:
                continue
            del left[(b, layer)]
            data: np.ndarray | memoryview
            if dst is not None:
                data = dst[at : at + h.layer_bytes]
            else:
                staged = stage.pop((b, layer), None)
                data = p.data if staged is None else staged
            if checksum(data) != h.checksums[layer]:
                corrupt.append(b)
                k = b
                continue
            if dst is None:
                decode_layers(u8view(data), h, out[b], [layer], base=-h.layer_offset(layer))
    missing = [b for b, _ in left if b < k]
    return min([k, *missing]), corrupt


def read_record(link: StoreLink, key: bytes, fingerprint: str) -> bytes | None:
    """StoreClient.get_record: one encoded block of any shape, whole, from the Get stream,
    checked; None when the node does not hold it or it fails a check (released as corrupt)."""
    h: BlockHeader | None
    try:
        stream = link.get(pb.KVGetRequest(keys=[key]), timeout=link.timeout)
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
        rpc_failed(e)
    try:
        if h is None:
            raise BlockCorrupt("bad header")
        check_block(buf, fingerprint)
    except BlockCorrupt as exc:
        log.warning("record %s failed its checks (%s): a miss", key.hex()[:12], exc)
        link.release_later(0, [key])
        return None
    return bytes(buf)


class GrpcTransport(BlockTransport):
    name = "grpc"

    def get_into(self, keys: list[bytes], out: torch.Tensor, rows: list[int] | None) -> int:
        if rows is not None:  # layers land in out[:k] as they arrive: staged for rows
            return get_staged(self, keys, out, rows)
        link = self.link
        try:
            stream = link.get(pb.KVGetRequest(keys=keys), timeout=link.timeout)
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
                if not fits(h, shape, dtype):
                    break
                headers.append(h)
            k, corrupt = receive_layers(stream, headers, out)
        except grpc.RpcError as e:
            rpc_failed(e)
        if corrupt:
            link.release_later(0, [keys[b] for b in corrupt])
        return k

    def open_put(self, keys: list[bytes], header: BlockHeader, parent: bytes | None) -> BlockWriter:
        return GrpcWriter(self.link, keys, header, parent)

    def close(self) -> None:
        pass  # nothing of its own: the link's channel is the client's to close


class GrpcWriter(BlockWriter):
    """A put in one Put stream: the open message, each layer's pieces as they are written, the
    headers at commit."""

    def __init__(
        self, link: StoreLink, keys: list[bytes], header: BlockHeader, parent: bytes | None
    ):
        super().__init__(keys, header, parent)
        self.link = link
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
        self.call = link.put.future(
            iter(self.q.get, None), timeout=max(link.timeout, PUT_STREAM_DEADLINE_S)
        )

    def write_layer(self, layer: int, data: torch.Tensor) -> None:
        self._check_layer(layer, data)
        chunk = self.link.chunk_bytes
        parts, size = [], 0
        start = self.header.layer_offset(layer)
        for i, raw in self._stored_rows(data, range(len(self.keys))):
            self.sums[i][layer] = checksum(raw)
            for o in range(0, len(raw), chunk):
                piece = raw[o : o + chunk]
                parts.append(Part(i, layer, start + o, piece))
                size += len(piece)
                if size >= chunk:
                    self.q.put(put_data_chunk(parts))  # copies the pieces: data may be reused
                    parts, size = [], 0
        if parts:
            self.q.put(put_data_chunk(parts))
        self.written.add(layer)

    def commit(self) -> PutResult:
        headers = self._headers()
        self.closed = True
        self.q.put(pb.KVPutChunk(commit=pb.KVPutCommit(headers=headers)))
        self.q.put(None)
        try:
            reply = self.call.result(timeout=self.link.timeout)
        except grpc.RpcError as e:
            rpc_failed(e)
        return PutResult(reply.stored, reply.held)

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.call.cancel()
        self.q.put(None)
