"""Wire messages of weight versions over the network (buffer/weights/net_client.py and net_server.py).

Service `tandem.Weights`, msgpack-encoded dataclasses with gRPC generic handlers (no protoc; a
ChunkReply is framed: msgpack header, then the raw chunk bytes):

    ChunkList(ChunkListRequest) -> ChunkList    trainer only: a version's files cut into chunks,
                                                the sha256 of every chunk, and the manifest
    Chunk(ChunkRequest) -> ChunkReply           trainer and peers: one chunk's bytes
    Peers(PeerReport) -> PeerList               trainer only: a worker says which chunks of a
                                                version it holds and where it serves them; the
                                                answer is other workers that hold chunks
    ChunkServers(ChunkListRequest) -> ServerList  trainer only: the ports of its chunk-server
                                                processes (buffer.weights_serve_processes), on
                                                the trainer's host; empty: ask the trainer itself
    Ping(b"") -> b""                            a chunk-server process: the trainer's health check

Chunk servers (buffer/weights/net_pool.py): process k of N serves the chunks whose number is k
modulo N (so each chunk has one sender and "sent least often" stays exact across processes),
the same Chunk method with the same token and TLS; what it cannot decide (every chunk asked
for has left it already and the requester takes chunks from peers: only the trainer's main
process knows the peers) it answers ASK_TRAINER, and the worker asks the trainer again with
`sent` set.

Chunks are numbered globally: file 0's chunks first, then file 1's, ... in manifest order (a
`ChunkList`'s `locate` maps a number to file, offset, length). A set of chunk numbers crosses
the wire as a little-endian bitmap (`to_bitmap` / `from_bitmap`). Every call carries
`authorization: Bearer <token>` metadata (the experience server's token).
"""

from __future__ import annotations

import bisect
import builtins
import dataclasses
import hashlib
import os
import struct
from collections.abc import Iterable

import msgpack

from protocol.weights import FileEntry, WeightManifest

SERVICE = "tandem.Weights"
CHUNK_LIST_METHOD = f"/{SERVICE}/ChunkList"
CHUNK_METHOD = f"/{SERVICE}/Chunk"
PEERS_METHOD = f"/{SERVICE}/Peers"
CHUNK_SERVERS_METHOD = f"/{SERVICE}/ChunkServers"
PING_METHOD = f"/{SERVICE}/Ping"
REDIRECT = -1  # a ChunkReply's index: every chunk asked for is with live peers, ask them
ASK_TRAINER = -2  # a ChunkReply's index (chunk servers): every chunk asked for left here already
SIDECAR_PREFIX = ".tandem-"  # a fetch's own files in <dest>.partial/; no weight file starts so


class WireError(ValueError):
    """A message that does not decode into the expected dataclass."""


class _Message:
    """msgpack of the dataclass's fields as a map; decoding checks names and types."""

    def encode(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)  # type: ignore[call-overload]

    @classmethod
    def decode(cls, raw: bytes):
        try:
            d = msgpack.unpackb(raw, raw=False)
            if not isinstance(d, dict):
                raise TypeError(f"a {type(d).__name__}, expected a map")
            return cls._build(d)
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
            raise WireError(f"{cls.__name__}: undecodable message: {e!r}") from None

    @classmethod
    def _build(cls, d: dict):
        obj = cls(**d)
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            want = {"int": int, "str": str, "bytes": bytes, "bool": bool}.get(str(f.type))
            if want is not None and not isinstance(getattr(obj, f.name), want):
                raise TypeError(f"field {f.name}: {type(getattr(obj, f.name)).__name__}, expected {f.type}")
        return obj


@dataclasses.dataclass
class ChunkListRequest(_Message):
    version: int


@dataclasses.dataclass
class FileChunks:
    name: str
    bytes: int
    sha256: str  # of the whole file, as the manifest says
    chunks: list[builtins.bytes]  # raw 32-byte sha256 digest of each chunk, in order


@dataclasses.dataclass
class ChunkList(_Message):
    """A version's files (those its manifest lists) cut into `chunk_bytes` pieces (the last
    piece of a file may be shorter), with the manifest's JSON text."""

    version: int
    chunk_bytes: int
    manifest: str
    files: list[FileChunks]

    @classmethod
    def _build(cls, d: dict):
        files = [FileChunks(**f) for f in d.pop("files")]
        out = super()._build({**d, "files": []})
        out.files = files
        out.check()
        return out

    def __post_init__(self):
        self._starts = []
        n = 0
        for f in self.files:
            self._starts.append(n)
            n += len(f.chunks)
        self.total = n

    def check(self) -> None:
        """Raise WireError unless the chunk counts fit the sizes and the names are plain file
        names (a fetch writes them into its folder: no path may escape it)."""
        self.__post_init__()
        if self.chunk_bytes <= 0:
            raise WireError(f"ChunkList v{self.version}: chunk_bytes {self.chunk_bytes}")
        for f in self.files:
            if (
                not f.name
                or f.name in (".", "..")
                or "/" in f.name
                or "\\" in f.name
                or f.name.startswith(SIDECAR_PREFIX)
                or f.name == "manifest.json"
            ):
                raise WireError(f"ChunkList v{self.version}: file name {f.name!r} refused")
            if len(f.chunks) != max(1, -(-f.bytes // self.chunk_bytes)) or any(
                not isinstance(c, bytes) or len(c) != 32 for c in f.chunks
            ):
                raise WireError(
                    f"ChunkList v{self.version}: {f.name}: {len(f.chunks)} chunk "
                    f"digests for {f.bytes} bytes in chunks of {self.chunk_bytes}"
                )
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise WireError(f"ChunkList v{self.version}: a file listed twice")

    def locate(self, index: int) -> tuple[int, int, int]:
        """Chunk number -> (file position in `files`, byte offset in that file, length)."""
        if not 0 <= index < self.total:
            raise IndexError(f"chunk {index} of v{self.version} (it has {self.total})")
        i = bisect.bisect_right(self._starts, index) - 1
        k = index - self._starts[i]
        offset = k * self.chunk_bytes
        return i, offset, min(self.chunk_bytes, self.files[i].bytes - offset)

    def digest(self, index: int) -> bytes:
        i = bisect.bisect_right(self._starts, index) - 1
        return self.files[i].chunks[index - self._starts[i]]

    def chunks_of(self, file_pos: int) -> range:
        return range(self._starts[file_pos], self._starts[file_pos] + len(self.files[file_pos].chunks))

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "version": self.version,
                "chunk_bytes": self.chunk_bytes,
                "manifest": self.manifest,
                "files": [dataclasses.asdict(f) for f in self.files],
            },
            use_bin_type=True,
        )

    @classmethod
    def unhashed(cls, manifest: WeightManifest, manifest_text: str, chunk_bytes: int) -> ChunkList:
        """The manifest's chunking with zero digests: what a chunk-server process needs to find
        a chunk (file, offset, length) without hashing the version once more (the trainer's
        main process hashed it; the worker checks every chunk against that list). Never sent."""
        files = [
            FileChunks(e.name, e.bytes, e.sha256, [bytes(32)] * max(1, -(-e.bytes // chunk_bytes)))
            for e in manifest.files
        ]
        out = cls(manifest.version, chunk_bytes, manifest_text, files)
        out.check()
        return out

    @classmethod
    def of_folder(cls, folder: str, manifest: WeightManifest, manifest_text: str, chunk_bytes: int) -> ChunkList:
        """Hash the manifest's files in `folder` chunk by chunk (one read of each file)."""
        files = []
        for entry in manifest.files:
            files.append(
                FileChunks(
                    entry.name,
                    entry.bytes,
                    entry.sha256,
                    _chunk_digests(os.path.join(folder, entry.name), entry, chunk_bytes),
                )
            )
        out = cls(manifest.version, chunk_bytes, manifest_text, files)
        out.check()
        return out


def _chunk_digests(path: str, entry: FileEntry, chunk_bytes: int) -> list[bytes]:
    size = os.path.getsize(path)
    if size != entry.bytes:
        raise ValueError(f"{path}: {size} bytes, the manifest says {entry.bytes}")
    out: list[bytes] = []
    with open(path, "rb", buffering=0) as f:
        while True:
            block = f.read(chunk_bytes)
            if not block and out:
                break
            out.append(hashlib.sha256(block).digest())
            if len(block) < chunk_bytes:
                break
    return out


@dataclasses.dataclass
class ChunkRequest(_Message):
    """One chunk: `index`, or (index -1) any chunk of the bitmap `want`, the server's choice
    (the trainer sends the one it has sent least often: each chunk leaves it about once).
    `peers`: the requester takes chunks from peers, except those in `avoid` (so the trainer
    may answer REDIRECT, index -1, when live peers hold every chunk of `want`). `sent`: every
    chunk of `want` left the trainer already (its chunk server said ASK_TRAINER), so the trainer
    sends one again only if no live peer covers it."""

    version: int
    peer_id: str
    index: int = -1
    want: bytes = b""
    peers: bool = False
    avoid: list[str] = dataclasses.field(default_factory=list)
    sent: bool = False

    @classmethod
    def _build(cls, d: dict):
        out = super()._build(d)
        if not isinstance(out.avoid, list) or not all(isinstance(a, str) for a in out.avoid):
            raise TypeError("field avoid: a list of peer ids (strings)")
        return out


@dataclasses.dataclass
class ChunkReply(_Message):
    """`index` REDIRECT (no data): every chunk asked for is with live peers; ask them.
    ASK_TRAINER (no data, from a chunk-server process): ask the trainer with `sent` set.

    Framed, not one msgpack map: a 4-byte little-endian length, the msgpack map of version and
    index, then the chunk's raw bytes. Decoding hands `data` out as a memoryview of the
    received message (hashed and written from there), so a chunk is not copied out of its
    reply: on the worker's path that copy held the GIL for ~5% of a chunk's time."""

    version: int
    index: int
    data: bytes | memoryview

    def encode(self) -> bytes:
        head = msgpack.packb({"version": self.version, "index": self.index})
        return b"".join((struct.pack("<I", len(head)), head, self.data))

    @classmethod
    def decode(cls, raw: bytes):
        try:
            view = memoryview(raw)
            (n,) = struct.unpack_from("<I", view)
            if not 0 < n <= len(view) - 4:
                raise ValueError(f"header of {n} bytes in a message of {len(view)}")
            head = msgpack.unpackb(view[4 : 4 + n], raw=False)
            if not isinstance(head, dict) or set(head) != {"version", "index"}:
                raise TypeError(f"header {head!r}: expected version and index")
            if not all(isinstance(head[k], int) and not isinstance(head[k], bool) for k in head):
                raise TypeError("version and index are integers")
            return cls(head["version"], head["index"], view[4 + n :])
        except (ValueError, TypeError, struct.error, msgpack.UnpackException) as e:
            raise WireError(f"{cls.__name__}: undecodable message: {e!r}") from None


@dataclasses.dataclass
class ServerList(_Message):
    """The trainer's chunk-server processes: their ports on the host the worker reaches the
    trainer at (its buffer.grpc_address: same name, so the same TLS certificate), in order, so
    that port k serves the chunks k modulo len(ports); a port 0 is a process not up now (being
    restarted): its chunks are the trainer's to send. Empty: the trainer serves every chunk."""

    ports: list[int]

    @classmethod
    def _build(cls, d: dict):
        out = super()._build(d)
        if not isinstance(out.ports, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 65536 for p in out.ports
        ):
            raise TypeError("field ports: a list of port numbers")
        return out


@dataclasses.dataclass
class PeerInfo:
    peer_id: str
    address: str  # host:port of its peer server
    have: bytes  # bitmap of the chunks it holds, verified


@dataclasses.dataclass
class PeerReport(_Message):
    """A worker's holdings of a version; `address` empty: it serves nothing (fan-out off)."""

    version: int
    peer_id: str
    address: str
    have: bytes


@dataclasses.dataclass
class PeerList(_Message):
    version: int
    peers: list[PeerInfo]

    @classmethod
    def _build(cls, d: dict):
        peers = [PeerInfo(**p) for p in d.pop("peers")]
        for p in peers:
            if not (isinstance(p.peer_id, str) and isinstance(p.address, str) and isinstance(p.have, bytes)):
                raise TypeError("PeerInfo: peer_id and address are strings, have is bytes")
        return cls(version=int(d["version"]), peers=peers)


def to_bitmap(indices: Iterable[int], total: int) -> bytes:
    out = bytearray((total + 7) // 8)
    for i in indices:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def from_bitmap(raw: bytes, total: int) -> set[int]:
    """The chunk numbers below `total` set in `raw` (bits past it are ignored)."""
    return {
        pos << 3 | bit
        for pos, byte in enumerate(raw[: (total + 7) // 8])
        if byte
        for bit in range(8)
        if byte >> bit & 1 and pos << 3 | bit < total
    }
