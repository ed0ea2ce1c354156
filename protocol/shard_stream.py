"""The wire encoding of the gRPC experience stream (protocol/experience.proto, `ShardChunk`),
with a copy-free path for data chunks.

A shard is megabytes; going through protobuf objects costs two extra full copies of it per side
(build + serialize, parse + read the field), which on a 2-core node was a third of the server's
time per shard. A data chunk's encoding is fixed by the proto3 spec: the key of field 2 with
wire type 2 (0x12), the length as a varint, the bytes. `encode_chunk` writes exactly what
`ShardChunk(data=...).SerializeToString()` would, in one copy; `decode_chunk` returns a
memoryview of the payload for that form and parses anything else (headers, any other valid
encoding from another client) with protobuf, so any client generated from the .proto works.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from protocol import experience_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Experience"].full_name
PUSH_METHOD = f"/{SERVICE}/Push"
_DATA_KEY = 0x12  # (field number 2 << 3) | wire type 2 (length-delimited)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_chunk(msg) -> bytes:
    """Serialize a `pb.ShardChunk`, or shard bytes (bytes / memoryview) as a data chunk."""
    if isinstance(msg, pb.ShardChunk):
        return msg.SerializeToString()
    return b"".join((bytes((_DATA_KEY,)), _varint(len(msg)), msg))


class Undecodable:
    """A message that is not a ShardChunk: the server refuses the push (INVALID_ARGUMENT)
    instead of failing inside gRPC's deserializer."""

    def __init__(self, reason: str):
        self.reason = reason


def decode_chunk(raw: bytes):
    """A memoryview of the data of a canonical data chunk, else the parsed `pb.ShardChunk`,
    else `Undecodable`."""
    if raw[:1] == b"\x12":
        length, shift, i = 0, 0, 1
        while i < len(raw) and i <= 10:
            byte = raw[i]
            length |= (byte & 0x7F) << shift
            i += 1
            if not byte & 0x80:
                if i + length == len(raw):
                    return memoryview(raw)[i:]
                break
            shift += 7
    try:
        return pb.ShardChunk.FromString(raw)
    except DecodeError as e:
        return Undecodable(f"a message that is not a ShardChunk ({len(raw)} bytes): {e}")


def chunk_data(chunk) -> memoryview | bytes | None:
    """The data of a decoded chunk (None for a header); ValueError for an undecodable one."""
    if isinstance(chunk, memoryview):
        return chunk
    if isinstance(chunk, Undecodable):
        raise ValueError(chunk.reason)
    return chunk.data if chunk.WhichOneof("part") == "data" else None
