"""The trainer's side of weight versions over the network, `WeightService` (on the trainer's
rank-0 grpc.Server, beside the experience service: same port, token, TLS): for a published
version folder it serves the chunk list (every file the manifest lists cut into
`buffer.weights_chunk_kb` pieces, the sha256 of each; computed once per version and cached), the
chunks (buffer/weights/chunks.py), and a peer registry: which worker holds which chunks of which
version, heard from within `buffer.weights_peer_ttl_s`. The worker's side is
buffer/weights/net_client.py.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import random
import threading
import time
from collections.abc import Callable

import grpc

from buffer.config import BufferConfig
from buffer.weights.chunks import ChunkServicer, Holding, check_token, decode_or_abort
from protocol.weights import ManifestError, WeightManifest
from protocol.weights_wire import ChunkList, ChunkListRequest, PeerInfo, PeerList, PeerReport, from_bitmap

log = logging.getLogger(__name__)
CACHED_VERSIONS = 4  # chunk lists the trainer keeps in memory (the newest versions' are asked)


@dataclasses.dataclass
class _Peer:
    address: str
    have: bytes
    seen: float


class WeightService:
    """The trainer's side: chunk lists, chunks and the peer registry of published versions.

    version_dir(v) -> the published folder of version v (with its manifest.json), or None when
    it is not (or no longer) published. `register(server)` adds the service to a grpc.Server
    (e.g. the experience ShardServer's `.server`; before or after it starts)."""

    def __init__(self, version_dir: Callable[[int], str | None], secret: str, cfg: BufferConfig):
        self.version_dir, self.cfg = version_dir, cfg
        self.chunk_bytes = cfg.weights_chunk_kb << 10
        # half the experience server's threads at most wait for a send slot
        self.chunks = ChunkServicer(self._holding, secret, cfg, max(1, cfg.grpc_server_threads // 2),
                                     self._covered)
        self.stats = self.chunks.stats
        self._held: collections.OrderedDict[int, Holding] = collections.OrderedDict()
        self._lock = threading.Lock()  # guards _held, _making, peers
        self._making: dict[int, threading.Lock] = {}
        self.peers: dict[int, dict[str, _Peer]] = {}

    def register(self, server: grpc.Server) -> None:
        server.add_generic_rpc_handlers([self.chunks.handlers(ChunkList=self.ChunkList,
                                                              Peers=self.Peers)])

    def _holding(self, version: int) -> Holding | None:
        """The version's chunk list, hashed once (one thread per version; others wait)."""
        with self._lock:
            if version in self._held:
                self._held.move_to_end(version)
                return self._held[version]
            making = self._making.setdefault(version, threading.Lock())
        with making:
            with self._lock:
                if version in self._held:
                    return self._held[version]
            folder = self.version_dir(version)
            if folder is None or not os.path.isfile(os.path.join(folder, "manifest.json")):
                return None
            started = time.monotonic()
            path = os.path.join(folder, "manifest.json")
            with open(path) as f:
                text = f.read()
            manifest = WeightManifest.from_json(text, where=path)
            chunks = ChunkList.of_folder(folder, manifest, text, self.chunk_bytes)
            held = Holding(chunks, folder, set(range(chunks.total)))
            log.info("weight version %d: %d chunks of %d KiB over %d files hashed in %.1f s",
                     version, chunks.total, self.chunk_bytes >> 10, len(chunks.files),
                     time.monotonic() - started)
            with self._lock:
                self._held[version] = held
                while len(self._held) > CACHED_VERSIONS:
                    self._held.popitem(last=False)
                self._making.pop(version, None)
            return held

    def _covered(self, version: int, requester: str, avoid: set[str]) -> set[int]:
        """Chunks that live peers (heard from within weights_peer_ttl_s, not the requester nor
        one it avoids) hold, or were sent within weights_chunk_timeout_s."""
        now, ttl = time.monotonic(), self.cfg.weights_peer_ttl_s
        held = self._held.get(version)
        with self._lock:
            live = [(p, e.have) for p, e in self.peers.get(version, {}).items()
                    if now - e.seen <= ttl and p != requester and p not in avoid]
        bits = 0
        for _, have in live:
            bits |= int.from_bytes(have, "little")
        out = from_bitmap(bits.to_bytes((bits.bit_length() + 7) // 8, "little"), bits.bit_length())
        if held is not None:  # called under held.lock
            for p, _ in live:
                out.update(held.recent.get(p, ()))
        return out

    def ChunkList(self, raw: bytes, context) -> bytes:
        check_token(context, self.chunks.expected)
        req = decode_or_abort(ChunkListRequest, raw, context)
        try:
            held = self._holding(req.version)
        except (OSError, ManifestError, ValueError) as e:  # pruned while hashing, or damaged
            context.abort(grpc.StatusCode.NOT_FOUND, f"weight version {req.version}: {e}")
        if held is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"weight version {req.version} is not published on the trainer "
                          "(pruned, or not yet)")
        return held.chunks.encode()

    def Peers(self, raw: bytes, context) -> bytes:
        """Record the caller's holdings; answer with up to weights_max_peers live peers that
        hold chunks it lacks: in random order (load spreads), first those that add chunks the
        ones before do not hold (the answer covers what the registry knows), then others."""
        check_token(context, self.chunks.expected)
        rep = decode_or_abort(PeerReport, raw, context)
        now, ttl = time.monotonic(), self.cfg.weights_peer_ttl_s
        lacks = ~int.from_bytes(rep.have, "little")
        with self._lock:
            table = self.peers.setdefault(rep.version, {})
            if rep.address:
                table[rep.peer_id] = _Peer(rep.address, rep.have, now)
            for gone in [p for p, e in table.items() if now - e.seen > ttl]:
                del table[gone]
            for version in [v for v, t in self.peers.items() if not t]:
                del self.peers[version]
            useful = [PeerInfo(p, e.address, e.have) for p, e in table.items()
                      if p != rep.peer_id and int.from_bytes(e.have, "little") & lacks]
        random.shuffle(useful)
        first, rest = [], []
        for peer in useful:
            adds = int.from_bytes(peer.have, "little") & lacks
            (first if adds else rest).append(peer)
            lacks &= ~adds
        return PeerList(rep.version, (first + rest)[:self.cfg.weights_max_peers]).encode()


def add_weight_service(server: grpc.Server, version_dir: Callable[[int], str | None], secret: str,
                       cfg: BufferConfig) -> WeightService:
    """Serve the published versions `version_dir` finds on `server`; returns the service."""
    service = WeightService(version_dir, secret, cfg)
    service.register(server)
    return service
