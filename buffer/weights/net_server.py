"""The servers of weight versions over the network.

`WeightService`, the trainer's (on its rank-0 grpc.Server, beside the experience service: same
port, token, TLS): for a published version folder it serves the chunk list (every file the
manifest lists cut into `buffer.weights_chunk_kb` pieces, the sha256 of each; computed once per
version and cached), the chunks, and a peer registry: which worker holds which chunks of which
version, heard from within `buffer.weights_peer_ttl_s`.

`ChunkServicer` answers the Chunk method from `Holding`s: all of a published version (the
trainer), or the chunks verified so far (every worker's peer server, run by its WeightFetcher in
buffer/weights/net_client.py), with a bounded number of sends at once and an optional cap on the
upload rate.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Protocol

import grpc

from buffer.channel import MAX_MESSAGE_BYTES, ServicePool, authorized, in_pool, open_channel
from buffer.config import BufferConfig
from protocol.weights import ManifestError, WeightManifest
from protocol.weights_wire import (
    ASK_TRAINER,
    CHUNK_METHOD,
    REDIRECT,
    SERVICE,
    ChunkList,
    ChunkListRequest,
    ChunkReply,
    ChunkRequest,
    PeerInfo,
    PeerList,
    PeerReport,
    ServerList,
    WireError,
    from_bitmap,
)


class ChunkServers(Protocol):
    """The trainer's chunk-server processes (buffer/weights/net_pool.py's ChunkServerPool,
    which imports this module: hence a protocol here, not the class)."""

    def ports(self) -> list[int]: ...

    def stop(self) -> None: ...


log = logging.getLogger(__name__)

# Chunks (<= 4 MiB) fit the experience stream's limit; a chunk list (32 bytes a chunk: 2 MiB
# for 256 GB in 4 MiB chunks) is the largest message a worker receives.
OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


_PACE_BYTES = 256 << 10  # the uplink model's packet: concurrent replies interleave at this grain


class _Uplink:
    """A sender's link of `rate` bytes/s: each reply reserves its packets' slots on one clock,
    so concurrent replies share the rate (a FIFO of _PACE_BYTES packets); 0: no limit."""

    def __init__(self, rate: float):
        self.rate = rate
        self.lock = threading.Lock()
        self.free_at = 0.0

    def send(self, n: int) -> None:
        if not self.rate:
            return
        for start in range(0, n, _PACE_BYTES):
            size = min(_PACE_BYTES, n - start)
            with self.lock:
                now = time.monotonic()
                self.free_at = max(now, self.free_at) + size / self.rate
                until = self.free_at
            time.sleep(max(0.0, until - time.monotonic()))


def check_token(context, expected: bytes) -> None:
    if not authorized(context, expected):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")


def decode_or_abort(cls, raw: bytes, context):
    try:
        return cls.decode(raw)
    except WireError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


class Holding:
    """The chunks of one version a process holds and serves: all of a published folder (the
    trainer), or the verified ones of a fetch in progress. `folder` moves once, from
    `<dest>.partial` to `<dest>`, under `lock`."""

    def __init__(self, chunks: ChunkList, folder: str, have: set[int]):
        self.chunks, self.folder, self.have = chunks, folder, have
        self.lock = threading.Lock()
        self.served: collections.Counter[int] = collections.Counter()  # chunk -> times sent
        self.recent: dict[str, dict[int, float]] = {}  # peer -> chunk -> when sent to it

    def read(self, index: int) -> bytes:
        pos, offset, length = self.chunks.locate(index)
        with self.lock:
            fd = os.open(os.path.join(self.folder, self.chunks.files[pos].name), os.O_RDONLY)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def pick(
        self, want: set[int], peer: str, window_s: float, covered: Callable[[], set[int]] = set, all_sent: bool = False
    ) -> int | None:
        """The chunk of `want` this holder has sent least often, preferring those not sent to
        `peer` within `window_s` (its request for them may still be on the way back). A chunk
        sent before (`all_sent`: every one of `want` was, by a chunk-server process) is only sent
        again when it is not in `covered()` (held by, or just sent to, a live peer the
        requester can use); REDIRECT when every one is."""
        now = time.monotonic()
        with self.lock:
            for who, sent in list(self.recent.items()):
                for k in [k for k, t in sent.items() if now - t > window_s]:
                    del sent[k]
                if not sent:
                    del self.recent[who]
            sent = self.recent.setdefault(peer, {})
            options = [i for i in want if i in self.have]
            if not options:
                return None
            if all_sent or all(self.served[i] for i in options):
                elsewhere = covered()
                options = [i for i in options if i not in elsewhere]
                if not options:
                    return REDIRECT
            best = min(options, key=lambda i: (i in sent, self.served[i], random.random()))
            self.served[best] += 1
            sent[best] = now
            return best


class ChunkServicer:
    """The Chunk method, served from `holding(version)`; shared by the trainer, its chunk-server
    processes (`defer`: a request that takes chunks from peers, of which every chunk held here
    was sent already, is answered ASK_TRAINER: only the trainer's main process knows the peers,
    to REDIRECT or send one again) and the peers."""

    def __init__(
        self,
        holding: Callable[[int], Holding | None],
        secret: str,
        cfg: BufferConfig,
        max_waiting: int,
        covered=None,
        defer: bool = False,
    ):
        self.holding, self.defer = holding, defer
        self.max_waiting, self.waiting = max_waiting, 0
        self.covered = covered  # (version, requester, its peers to avoid) -> chunks peers cover
        self.expected = f"Bearer {secret}".encode()
        self.cfg = cfg
        self.uplink = _Uplink(cfg.weights_upload_mb_s * 1e6)
        self.slots = threading.BoundedSemaphore(cfg.weights_send_slots)
        self.stats: collections.Counter[str] = collections.Counter()
        self.stats_lock = threading.Lock()  # handlers run concurrently: += alone loses counts

    def count(self, **add: int) -> None:
        with self.stats_lock:
            self.stats.update(add)

    def Chunk(self, raw: bytes, context) -> bytes:
        """A chunk, sent in one of weights_send_slots slots: few chunks at a time, each at a
        good share of the uplink, so they reach peers early one after another (all at once,
        every one would arrive late). The chunk is picked when the slot is free."""
        check_token(context, self.expected)
        req = decode_or_abort(ChunkRequest, raw, context)
        if not self._take_slot():
            self.count(busy=1)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "weight send slots busy: retry later")
        try:
            return self._send(req, context)
        finally:
            self.slots.release()

    def _take_slot(self) -> bool:
        """A send slot; waits (at most weights_chunk_timeout_s / 2) only while fewer than
        `max_waiting` handlers wait already: a waiting handler holds one of the server's
        threads, which on the trainer serve experience pushes too."""
        if self.slots.acquire(blocking=False):
            return True
        with self.stats_lock:
            if self.waiting >= self.max_waiting:
                return False
            self.waiting += 1
        try:
            return self.slots.acquire(timeout=self.cfg.weights_chunk_timeout_s / 2)
        finally:
            with self.stats_lock:
                self.waiting -= 1

    def _send(self, req: ChunkRequest, context) -> bytes:
        held = self.holding(req.version)
        if held is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"weight version {req.version} not held here")
        if req.index >= 0:
            index = req.index if req.index in held.have else None
        else:
            covered: Callable[[], set[int]] = set
            if self.covered is not None and req.peers:
                covered = lambda: self.covered(req.version, req.peer_id, set(req.avoid))  # noqa: E731
            elif self.defer and req.peers:  # all sent once already: "covered", the trainer decides
                covered = lambda: held.have  # noqa: E731
            want = from_bitmap(req.want, held.chunks.total)
            index = held.pick(want, req.peer_id, self.cfg.weights_chunk_timeout_s, covered, req.sent)
            if index == REDIRECT:
                self.count(**{"deferred" if self.defer else "redirects": 1})
                return ChunkReply(req.version, ASK_TRAINER if self.defer else REDIRECT, b"").encode()
        if index is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"v{req.version}: no chunk asked for is held here")
        try:
            data = held.read(index)
        except OSError as e:  # pruned meanwhile (trainer) or the folder went away (peer)
            context.abort(grpc.StatusCode.NOT_FOUND, f"v{req.version} chunk {index}: {e}")
        self.uplink.send(len(data))
        self.count(chunks=1, bytes=len(data))
        return ChunkReply(req.version, index, data).encode()

    def handlers(self, pool: ServicePool | None = None, **more) -> grpc.GenericRpcHandler:
        """The methods (Chunk and `more`), on `pool` when given (else the server's own)."""
        methods = {"Chunk": self.Chunk, **more}
        run = (lambda fn: in_pool(fn, pool)) if pool is not None else (lambda fn: fn)
        return grpc.method_handlers_generic_handler(
            SERVICE, {name: grpc.unary_unary_rpc_method_handler(run(fn)) for name, fn in methods.items()}
        )


CACHED_VERSIONS = 4  # chunk lists the trainer keeps in memory (the newest versions' are asked)


MAX_PEER_ID = 128  # characters of a peer id, and of an address, a report may carry
MAX_ADDRESS = 256
PROBE_THREADS = 4  # probes of new peers at once; more wait for the next report
PROBE_OK = (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED)  # it answered


@dataclasses.dataclass
class _Peer:
    address: str
    have: bytes
    seen: float


class WeightService:
    """The trainer's side: chunk lists, chunks and the peer registry of published versions.

    version_dir(v) -> the published folder of version v (with its manifest.json), or None when
    it is not (or no longer) published. `register(server)` adds the service to a grpc.Server
    (e.g. the experience ShardServer's `.server`; before or after it starts). `pool`: the
    chunk-server processes that send the chunks of the same folders (net_pool.chunk_servers),
    named to workers by ChunkServers; the service owns it from then on: `close()` ends it."""

    def __init__(
        self,
        version_dir: Callable[[int], str | None],
        secret: str,
        cfg: BufferConfig,
        pool: ChunkServers | None = None,
    ):
        self.version_dir, self.cfg, self.pool = version_dir, cfg, pool
        self.chunk_bytes = cfg.weights_chunk_kb << 10
        # its own pool (buffer.grpc_max_workers); half of it at most waits for a send slot
        self.threads = ServicePool(cfg.grpc_max_workers, "grpc-weights")
        self.chunks = ChunkServicer(self._holding, secret, cfg, max(1, cfg.grpc_max_workers // 2), self._covered)
        self.stats = self.chunks.stats
        self._held: collections.OrderedDict[int, Holding] = collections.OrderedDict()
        self._lock = threading.Lock()  # guards _held, _making, peers, answered, probing
        self._making: dict[int, threading.Lock] = {}
        self.peers: dict[int, dict[str, _Peer]] = {}  # <= weights_max_registered_peers in all
        self.answered: dict[str, float] = {}  # peer address -> when a probe of it succeeded
        self.probing: dict[str, float] = {}  # address -> when its probe started, or last failed
        self.prober = futures.ThreadPoolExecutor(PROBE_THREADS, thread_name_prefix="weights-probe")
        self.preparer = futures.ThreadPoolExecutor(1, thread_name_prefix="weights-prepare")  # see prepare

    def register(self, server: grpc.Server) -> None:
        server.add_generic_rpc_handlers(
            [
                self.chunks.handlers(
                    self.threads, ChunkList=self.ChunkList, Peers=self.Peers, ChunkServers=self.ChunkServers
                )
            ]
        )

    def prepare(self, version: int) -> None:
        """Hash the chunk list of `version`, just published, in the background: not in the
        first worker's ChunkList request, on the path of every network reload (sha256 of every
        chunk, ~0.75 s a GB on one core of the H200 host). A request meanwhile waits for this
        hash (`_holding`: one per version)."""

        def run() -> None:
            try:
                self._holding(version)
            except OSError as e:  # pruned meanwhile, say: a request hashes it again (or finds it gone)
                log.warning("weight version %d: chunk list not prepared (%s)", version, e)

        try:
            self.preparer.submit(run)
        except RuntimeError:  # closed: the run is over
            pass

    def close(self) -> None:
        """After the server stopped: end the chunk-server processes, the probes and the threads."""
        if self.pool is not None:
            self.pool.stop()
        self.preparer.shutdown(wait=True, cancel_futures=True)
        self.prober.shutdown(wait=True, cancel_futures=True)
        self.threads.shutdown(wait=False, cancel_futures=True)

    def ChunkServers(self, raw: bytes, context) -> bytes:
        """The ports of the chunk-server processes (0: one not up now), none without a pool."""
        check_token(context, self.chunks.expected)
        decode_or_abort(ChunkListRequest, raw, context)
        return ServerList(self.pool.ports() if self.pool is not None else []).encode()

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
            try:
                return self._hash(version)
            finally:  # also for versions never published: asked-for numbers must not pile up
                with self._lock:
                    self._making.pop(version, None)

    def _hash(self, version: int) -> Holding | None:
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
        log.info(
            "weight version %d: %d chunks of %d KiB over %d files hashed in %.1f s",
            version,
            chunks.total,
            self.chunk_bytes >> 10,
            len(chunks.files),
            time.monotonic() - started,
        )
        with self._lock:
            self._held[version] = held
            while len(self._held) > CACHED_VERSIONS:
                self._held.popitem(last=False)
        return held

    def _covered(self, version: int, requester: str, avoid: set[str]) -> set[int]:
        """Chunks that live peers (heard from within weights_peer_ttl_s, not the requester nor
        one it avoids) hold, or were sent within weights_chunk_timeout_s."""
        now, ttl = time.monotonic(), self.cfg.weights_peer_ttl_s
        held = self._held.get(version)
        with self._lock:
            live = [
                (p, e.have)
                for p, e in self.peers.get(version, {}).items()
                if now - e.seen <= ttl and p != requester and p not in avoid and e.address in self.answered
            ]
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
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"weight version {req.version} is not published on the trainer (pruned, or not yet)",
            )
        return held.chunks.encode()

    def Peers(self, raw: bytes, context) -> bytes:
        """Record the caller's holdings; answer with up to weights_max_peers live peers that
        answered a probe and hold chunks it lacks: in random order (load spreads), first those
        that add chunks the ones before do not hold (the answer covers what the registry
        knows), then others. Reports for versions not published, with more bits than the
        version has chunks, or past weights_max_registered_peers are refused."""
        check_token(context, self.chunks.expected)
        rep = decode_or_abort(PeerReport, raw, context)
        have = self._check_report(rep, context)
        now = time.monotonic()
        lacks = ~int.from_bytes(have, "little")
        with self._lock:
            self._expire(now)
            table = self.peers.setdefault(rep.version, {})
            if rep.address:
                if rep.peer_id not in table and self._registered() >= self.cfg.weights_max_registered_peers:
                    self.count(peers_refused=1)
                    context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{self.cfg.weights_max_registered_peers} peers registered "
                        "(buffer.weights_max_registered_peers): report again later",
                    )
                table[rep.peer_id] = _Peer(rep.address, have, now)
                self._probe(rep.version, rep.address, now)
            useful = [
                PeerInfo(p, e.address, e.have)
                for p, e in table.items()
                if p != rep.peer_id and e.address in self.answered and int.from_bytes(e.have, "little") & lacks
            ]
            if not table:
                del self.peers[rep.version]
        random.shuffle(useful)
        first: list[PeerInfo] = []
        rest: list[PeerInfo] = []
        for peer in useful:
            adds = int.from_bytes(peer.have, "little") & lacks
            (first if adds else rest).append(peer)
            lacks &= ~adds
        return PeerList(rep.version, (first + rest)[: self.cfg.weights_max_peers]).encode()

    def count(self, **add: int) -> None:
        self.chunks.count(**add)

    def _check_report(self, rep: PeerReport, context) -> bytes:
        """The report's bitmap, if the report may enter the registry (else it aborts)."""
        if len(rep.peer_id) > MAX_PEER_ID or len(rep.address) > MAX_ADDRESS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a peer id or address over {MAX_ADDRESS} characters")
        try:
            held = self._holding(rep.version)
        except (OSError, ManifestError, ValueError) as e:
            held, why = None, str(e)
        else:
            why = "pruned, or not yet"
        if held is None:
            self.count(reports_refused=1)
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"weight version {rep.version} is not published on the trainer ({why})"
            )
        if len(rep.have) > (held.chunks.total + 7) // 8:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a bitmap of {len(rep.have)} bytes for {held.chunks.total} chunks of v{rep.version}",
            )
        return rep.have

    def _registered(self) -> int:
        return sum(len(t) for t in self.peers.values())

    def _expire(self, now: float) -> None:
        """Drop every peer not heard from within weights_peer_ttl_s, of every version, and what
        is known of addresses no peer uses any more (under _lock)."""
        ttl = self.cfg.weights_peer_ttl_s
        for version, table in list(self.peers.items()):
            for gone in [p for p, e in table.items() if now - e.seen > ttl]:
                del table[gone]
            if not table:
                del self.peers[version]
        used = {e.address for t in self.peers.values() for e in t.values()}
        for known in (self.answered, self.probing):
            for address in [a for a in known if a not in used and now - known[a] > ttl]:
                del known[address]

    def _probe(self, version: int, address: str, now: float) -> None:
        """Ask a new address one request (under _lock), in the background; until it answers it
        is never handed out. One probe per address per weights_peer_ttl_s at most."""
        if address in self.answered or now - self.probing.get(address, -math.inf) <= self.cfg.weights_peer_ttl_s:
            return
        self.probing[address] = now
        try:
            self.prober.submit(self._ask, version, address)
        except RuntimeError:  # closed: the server is stopping
            pass

    def _ask(self, version: int, address: str) -> None:
        request = ChunkRequest(version, "trainer-probe", want=b"").encode()  # no chunk: a quick NOT_FOUND
        channel = open_channel(self.cfg, address, OPTIONS)
        token = [("authorization", self.chunks.expected.decode())]
        try:
            channel.unary_unary(CHUNK_METHOD)(request, timeout=self.cfg.weights_probe_timeout_s, metadata=token)
            ok = True
        except grpc.RpcError as e:
            ok = e.code() in PROBE_OK
        finally:
            channel.close()
        with self._lock:
            if ok:
                self.answered[address] = time.monotonic()
            else:
                self.probing[address] = time.monotonic()
        self.count(**{"probes_answered" if ok else "probes_failed": 1})
        if not ok:
            log.warning(
                "weight peer %s did not answer within buffer.weights_probe_timeout_s: not handed to others", address
            )


def add_weight_service(
    server: grpc.Server,
    version_dir: Callable[[int], str | None],
    secret: str,
    cfg: BufferConfig,
    pool: ChunkServers | None = None,
) -> WeightService:
    """Serve the published versions `version_dir` finds on `server` (their chunks from `pool`'s
    processes too: see WeightService); returns the service."""
    service = WeightService(version_dir, secret, cfg, pool)
    service.register(server)
    return service
