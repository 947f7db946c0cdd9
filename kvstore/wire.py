"""Bulk messages of the KVStore service without protobuf object copies.

KVGetChunk and KVPutChunk carry block bytes in KVBlockPart.data. Building and parsing those with
the protobuf runtime copies every byte several times; here the payload parts are written and read
directly in protobuf's wire format (so any protobuf client still reads them), and parsed parts
are memoryviews into the received message. Small messages go through the protobuf runtime.
"""

from __future__ import annotations

from typing import NamedTuple

import grpc

from protos import kvstore_pb2 as pb

_SERVICE = "halfmoon.KVStore"


class Part(NamedTuple):
    block: int  # index of the block in the request's keys
    layer: int  # layer the bytes belong to
    offset: int  # byte offset in the encoded block
    data: memoryview  # the bytes (a view into the message, or into the sender's buffer)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(mv: memoryview, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = mv[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint")


def _part_pieces(p: Part) -> tuple[list, int]:
    head = (
        b"\x08"
        + _varint(p.block)
        + b"\x10"
        + _varint(p.layer)
        + b"\x18"
        + _varint(p.offset)
        + b"\x22"
        + _varint(len(p.data))
    )
    return [head, p.data], len(head) + len(p.data)


def encode_parts(field: int, parts: list[Part]) -> list:
    """Wire pieces of `repeated KVBlockPart <field>`."""
    out = []
    for p in parts:
        pieces, n = _part_pieces(p)
        out.append(bytes([field << 3 | 2]) + _varint(n))
        out.extend(pieces)
    return out


def get_chunk(parts: list[Part]) -> bytes:
    """A serialized KVGetChunk holding `parts` (field 3)."""
    return b"".join(encode_parts(3, parts))


def put_data_chunk(parts: list[Part]) -> bytes:
    """A serialized KVPutChunk whose `data` (field 2) holds `parts`."""
    inner = encode_parts(1, parts)
    return b"".join([b"\x12", _varint(sum(len(x) for x in inner))] + inner)


def _fields(mv: memoryview, start: int = 0, end: int | None = None):
    """(field number, value) of a message: ints for varints, memoryviews for length-delimited."""
    pos, end = start, len(mv) if end is None else end
    while pos < end:
        tag, pos = _read_varint(mv, pos)
        wire = tag & 7
        val: int | memoryview
        if wire == 0:
            val, pos = _read_varint(mv, pos)
        elif wire == 2:
            n, pos = _read_varint(mv, pos)
            if pos + n > end:
                raise ValueError("truncated field")
            val, pos = mv[pos : pos + n], pos + n
        elif wire == 1:
            val, pos = mv[pos : pos + 8], pos + 8
        elif wire == 5:
            val, pos = mv[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield tag >> 3, val


def _part(mv: memoryview) -> Part:
    if isinstance(mv, int):
        raise ValueError("a block part must be a message")
    block = layer = offset = 0
    data = mv[0:0]
    for f, v in _fields(mv):
        if f == 1:
            block = v
        elif f == 2:
            layer = v
        elif f == 3:
            offset = v
        elif f == 4:
            data = v
    return Part(block, layer, offset, data)


def parse_parts(raw: bytes, field: int) -> list[Part]:
    """The KVBlockParts at `field` of a serialized message (other fields skipped)."""
    return [_part(v) for f, v in _fields(memoryview(raw)) if f == field]


class RawPutData(NamedTuple):
    """A KVPutChunk with `data`, parsed without copying its bytes."""

    parts: list[Part]


class BadChunk(NamedTuple):
    """A KVPutChunk that does not parse; the Put handler refuses it with INVALID_ARGUMENT."""

    reason: str


def parse_put_chunk(raw: bytes):
    """KVPutChunk: a RawPutData for data chunks, the protobuf message for open and commit."""
    mv = memoryview(raw)
    try:
        if len(mv) and mv[0] == 0x12:
            parts = []
            for f, v in _fields(mv):
                if f == 2:
                    parts.extend(parse_parts(v, 1))
            return RawPutData(parts)
        return pb.KVPutChunk.FromString(raw)
    except Exception as e:  # noqa: BLE001 - any parse failure is the sender's malformed message
        return BadChunk(f"malformed put message: {e}")


def _serialize(msg) -> bytes | bytearray:
    return msg if isinstance(msg, (bytes, bytearray)) else msg.SerializeToString()


def _identity(raw: bytes) -> bytes:
    return raw


def add_servicer(servicer, server: grpc.Server) -> None:
    """Register the KVStore servicer; Get answers and Put requests may be pre-serialized bytes."""
    u = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Lookup": u(
            servicer.Lookup, pb.KVLookupRequest.FromString, pb.KVLookupReply.SerializeToString
        ),
        "Get": grpc.unary_stream_rpc_method_handler(
            servicer.Get, pb.KVGetRequest.FromString, _serialize
        ),
        "Put": grpc.stream_unary_rpc_method_handler(
            servicer.Put, parse_put_chunk, pb.KVPutReply.SerializeToString
        ),
        "Lease": u(servicer.Lease, pb.KVLeaseRequest.FromString, pb.KVLeaseReply.SerializeToString),
        "Release": u(
            servicer.Release, pb.KVReleaseRequest.FromString, pb.KVReleaseReply.SerializeToString
        ),
        "Commit": u(
            servicer.Commit, pb.KVCommitRequest.FromString, pb.KVPutReply.SerializeToString
        ),
        "Stats": u(servicer.Stats, pb.KVStatsRequest.FromString, pb.KVStatsReply.SerializeToString),
        "Info": u(servicer.Info, pb.KVInfoRequest.FromString, pb.KVInfoReply.SerializeToString),
        "Clear": u(servicer.Clear, pb.KVClearRequest.FromString, pb.KVClearReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))


def raw_get(channel: grpc.Channel):
    """Get, answering serialized KVGetChunks (bytes) for parse_parts."""
    return channel.unary_stream(
        f"/{_SERVICE}/Get",
        request_serializer=pb.KVGetRequest.SerializeToString,
        response_deserializer=_identity,
    )


def raw_put(channel: grpc.Channel):
    """Put, sending KVPutChunk messages or pre-serialized bytes."""
    return channel.stream_unary(
        f"/{_SERVICE}/Put",
        request_serializer=_serialize,
        response_deserializer=pb.KVPutReply.FromString,
    )
