"""A worker's side of weight versions over the network: `NetWeightSource` (the run's
WeightSource with `buffer.transport=grpc`: LATEST from the run service, versions fetched into the
worker's own cache) and its `WeightFetcher`.

Trainer side, `WeightService` (on the trainer's rank-0 grpc.Server, beside the experience
service: same port, token, TLS): for a published version folder it serves the chunk list (every
file the manifest lists cut into `buffer.weights_chunk_kb` pieces, the sha256 of each; computed
once per version and cached), the chunks, and a peer registry: which worker holds which chunks
of which version, heard from within `buffer.weights_peer_ttl_s`.

Worker side, `WeightFetcher`: `fetch(version, dest)` streams every chunk into `<dest>.partial/`,
checks each chunk's sha256 against the trainer's list before counting it, records the verified
chunks durably (data fsynced first, then a bitmap sidecar replaced atomically), so a killed fetch
restarted later fetches only what is missing; when all chunks are in, every file is checked
against the manifest's whole-file sha256 and the folder is renamed to `<dest>` (atomic).
`close()` cancels a fetch in progress (FetchCancelled): its verified chunks are made durable and
`<dest>.partial/` is kept for the next fetch; `discard_partial(dest)` removes one no fetch holds.

Peer fan-out (a swarm): each fetcher serves the chunks it holds from its own small grpc.Server
(same token) and reports them to the trainer every `weights_peer_refresh_s`; the trainer answers
with peers that hold chunks. A worker takes from peers every chunk some peer holds (a random
chunk of a random, least-busy peer: chunks spread in parallel), and asks the trainer only for
chunks no known peer holds, by a bitmap of those; the trainer then sends the one it has sent
least often. So each chunk leaves the trainer about once however many workers fetch, and the
workers' own uplinks carry the copies. A peer that fails a request is skipped for
`weights_peer_ttl_s`; a peer whose chunk fails its sha256 is never used again for the version;
the chunk goes back to the missing set, taken from another peer or the trainer.

The trainer's chunk-server processes (buffer.weights_serve_processes: its sends on more cores
than its one GIL's; buffer/weights/net_pool.py): the trainer names their ports (ChunkServers,
asked once per fetch), on its own host; the fetch spreads its weights_trainer_streams over them,
each request asking process k for the wanted chunks k modulo N, the least loaded first. One
that fails a request is skipped for weights_peer_ttl_s (its chunks asked of the trainer's main
process meanwhile, which holds every chunk); one that answers ASK_TRAINER (all it holds of what
was asked left it already, and only the main process knows the peers) has its chunks asked of
the main process from then on, with `sent` set.

"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import random
import shutil
import threading
import time
import uuid
from concurrent import futures

import grpc

from buffer.channel import RunClient, bind_hosts, open_channel, server_credentials, token
from buffer.config import BufferConfig
from buffer.layout import RunLayout
from buffer.storage import when_space
from buffer.weights import delta
from buffer.weights.base import WeightSource
from buffer.weights.net_server import OPTIONS, ChunkServicer, Holding
from protocol import run_service as rs
from protocol.weights import ManifestError, WeightManifest, sha256_file, verify_files
from protocol.weights_wire import (
    ASK_TRAINER,
    CHUNK_LIST_METHOD,
    CHUNK_METHOD,
    CHUNK_SERVERS_METHOD,
    PEERS_METHOD,
    REDIRECT,
    SIDECAR_PREFIX,
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
    to_bitmap,
)

log = logging.getLogger(__name__)
NOTE_EVERY_S = 30.0  # a waiting fetch logs what it waits for this often
_CHUNKS_FILE = SIDECAR_PREFIX + "chunks"
_VERIFIED_FILE = SIDECAR_PREFIX + "verified"
PARTIAL = ".partial"  # <dest>.partial/: a fetch in progress or interrupted; <dest>.partial.lock
TRAINER = "trainer"  # the source name of chunks from the trainer in FetchStats


class _Corrupt(Exception):
    """A chunk whose bytes do not match the chunk list's sha256."""


class FetchCancelled(Exception):
    """The fetcher was closed during the fetch; the verified chunks are durable in
    `<dest>.partial/`, and the next fetch of the version resumes them."""


FILE_HASH_THREADS = 4  # files hashed at once while a fetch goes on (hashlib releases the GIL)


class _FileHashes:
    """The manifest's whole-file sha256 of each file, computed while the transfer goes on:
    threads of its own (up to FILE_HASH_THREADS, thread t the files t modulo their number) hash
    each file's chunks in order as they are written (read back from the page cache), so that at
    the end only the last chunks remain to hash instead of every file again (on a fast link
    that final pass was a quarter of a fetch). One thread hashed ~1.3 GB/s on the GPU machine's
    cores: at a receive rate near that it fell behind, so files are hashed in parallel. Chunks
    arrive in any order; a file's hash waits at its first missing chunk."""

    def __init__(self, chunks: ChunkList, fds: list[int], ready: set[int]):
        self.chunks, self.fds = chunks, fds
        self.sha = [hashlib.sha256() for _ in chunks.files]
        self.next = [chunks.chunks_of(pos).start for pos in range(len(chunks.files))]
        self.ready = set(ready)
        self.cond = threading.Condition()
        self.closed = False
        self.error: BaseException | None = None
        n = max(1, min(FILE_HASH_THREADS, len(chunks.files)))
        self.threads = [
            threading.Thread(target=self._run, args=(range(t, len(chunks.files), n),), name="weights-file-sha256")
            for t in range(n)
        ]
        for th in self.threads:
            th.daemon = True
            th.start()

    def written(self, index: int) -> None:
        with self.cond:
            self.ready.add(index)
            self.cond.notify_all()

    def _advance(self, files: range) -> bool:
        """Hash the next ready chunk of one of `files` (this thread's); False when none is."""
        with self.cond:
            pos = next(
                (p for p in files if self.next[p] in self.ready and self.next[p] in self.chunks.chunks_of(p)),
                None,
            )
        if pos is None:
            return False
        _, offset, length = self.chunks.locate(self.next[pos])
        self.sha[pos].update(os.pread(self.fds[pos], length, offset))
        self.next[pos] += 1
        return True

    def _run(self, files: range) -> None:
        try:
            while True:
                if self._advance(files):
                    continue
                with self.cond:
                    if self.closed:
                        return
                    self.cond.wait(1.0)
        except BaseException as e:  # the final check hashes the files itself then
            self.error = e

    def digests(self, timeout_s: float) -> list[str] | None:
        """Every file's hex sha256 once all chunks are hashed (call when all are written);
        None if a thread failed or they did not finish within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            self.cond.notify_all()
        while any(self.next[p] < self.chunks.chunks_of(p).stop for p in range(len(self.next))):
            alive = all(th.is_alive() for th in self.threads)
            if self.error is not None or not alive or time.monotonic() > deadline:
                return None
            time.sleep(0.005)
        return [h.hexdigest() for h in self.sha]

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        for th in self.threads:
            th.join(timeout=30)  # each ends at its next chunk (one pread + hash)


class _Partial:
    """`<dest>.partial/`: the version's files at full size, written chunk by chunk, plus the
    chunk list it was fetched by and the bitmap of chunks verified and fsynced (sidecars)."""

    def __init__(self, folder: str, chunks: ChunkList):
        self.folder, self.chunks = folder, chunks
        os.makedirs(folder, exist_ok=True)
        wire = chunks.encode()
        self.durable: set[int] = set()
        try:
            with open(os.path.join(folder, _CHUNKS_FILE), "rb") as f:
                same = f.read() == wire
            if same:
                with open(os.path.join(folder, _VERIFIED_FILE), "rb") as f:
                    self.durable = from_bitmap(f.read(), chunks.total)
        except FileNotFoundError:
            same = False
        if not same:  # nothing (or another chunking) there: start over
            for name in os.listdir(folder):
                os.remove(os.path.join(folder, name))
            self._replace(_CHUNKS_FILE, wire)
        self.fds = []
        for entry in chunks.files:
            fd = os.open(os.path.join(folder, entry.name), os.O_RDWR | os.O_CREAT, 0o644)
            if os.fstat(fd).st_size != entry.bytes:
                os.ftruncate(fd, entry.bytes)
            self.fds.append(fd)
        self.pending: set[int] = set()  # verified, written, not yet fsynced (the loop's own)
        self._saver: threading.Thread | None = None  # the save in the background, if any
        self._save_error: BaseException | None = None
        self.saved_at = time.monotonic()
        self.hashes = _FileHashes(chunks, self.fds, self.durable)

    def _replace(self, name: str, data: bytes) -> None:
        tmp = os.path.join(self.folder, name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.folder, name))
        dfd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def write(self, index: int, data: bytes | memoryview) -> None:
        pos, offset, _ = self.chunks.locate(index)
        os.pwrite(self.fds[pos], data, offset)

    def save(self, every_s: float) -> None:
        """Make the pending chunks durable (fsync their files, then the bitmap): with `every_s`
        > 0 (the transfer's loop) at most that often and in the background, one save at a time
        (an fsync of a second's chunks took 0.6 s of a 2.5 s fetch on the CPU box, and the loop
        launched no request meanwhile); 0: now, after the one in the background (the end of a
        transfer). An error of a background save is raised here, at the next call."""
        if every_s > 0 and self._saver is not None and self._saver.is_alive():
            return
        self._join()
        if not self.pending or time.monotonic() - self.saved_at < every_s:
            return
        batch, self.pending = self.pending, set()
        self.saved_at = time.monotonic()
        if every_s == 0:
            self._flush(batch)
            return
        self._saver = threading.Thread(target=self._flush, args=(batch, True), name="weights-fsync", daemon=True)
        self._saver.start()

    def _flush(self, batch: set[int], background: bool = False) -> None:
        try:
            for pos in {self.chunks.locate(i)[0] for i in batch}:
                os.fsync(self.fds[pos])
            self.durable |= batch  # only here, and by forget() after _join: one writer at a time
            self._replace(_VERIFIED_FILE, to_bitmap(self.durable, self.chunks.total))
        except BaseException as e:
            if not background:
                raise
            self._save_error = e  # its chunks stay out of the bitmap: fetched again on a resume

    def _join(self) -> None:
        """Wait for the save in the background (an fsync: bounded by the disk); raise its error."""
        if self._saver is not None:
            self._saver.join()
            self._saver = None
        error, self._save_error = self._save_error, None
        if error is not None:
            raise error

    def forget(self, indices) -> None:
        self._join()
        self.durable -= set(indices)
        self.pending -= set(indices)
        self._replace(_VERIFIED_FILE, to_bitmap(self.durable, self.chunks.total))

    def close(self) -> None:
        if self._saver is not None:
            self._saver.join()  # before the files it syncs are closed (its error was raised or is moot)
        self.hashes.close()  # before the files it reads are closed
        for fd in self.fds:
            os.close(fd)
        self.fds = []


@dataclasses.dataclass
class FetchStats:
    """What one fetch did: chunks by source, and what went wrong on the way."""

    chunks: int = 0  # in the version
    resumed: int = 0  # verified chunks found on disk from an earlier, interrupted fetch
    from_trainer: int = 0
    from_peers: int = 0
    bytes_from_trainer: int = 0
    bytes_from_peers: int = 0
    corrupt: int = 0  # chunks that failed their sha256 (refetched)
    bad_peers: list[str] = dataclasses.field(default_factory=list)  # never used again (version)
    peer_failures: int = 0  # requests to peers that failed (timeout, gone, not held)
    trainer_failures: int = 0
    duplicates: int = 0  # chunks that arrived twice (wasted bytes)
    redirects: int = 0  # trainer answers "live peers hold every chunk you asked for"
    busy: int = 0  # requests a server refused because its send slots were taken (asked later)
    from_servers: int = 0  # of from_trainer: sent by the trainer's chunk-server processes
    server_failures: int = 0  # requests to those that failed (their chunks asked of the trainer)
    deferred: int = 0  # ASK_TRAINER answers of those (their chunks asked of the trainer since)
    seconds: float = 0.0


class WeightFetcher:
    """A worker's side: fetches versions from the trainer at `address` (host:port) and peers,
    and serves what it holds to peers (unless buffer.weights_peer_fanout is false).

    fetch(version, dest_dir) -> dest_dir, verified; stats[version] -> FetchStats;
    close() stops the peer server. `peer_id` names this worker to the trainer and its peers."""

    def __init__(self, address: str, secret: str, cfg: BufferConfig, peer_id: str | None = None):
        self.address, self.secret, self.cfg = address, secret, cfg
        self.peer_id = peer_id or uuid.uuid4().hex[:12]
        self.metadata = [("authorization", f"Bearer {secret}")]
        self.trainer = open_channel(cfg, address, OPTIONS)
        self._calls = {
            name: self.trainer.unary_unary(method)
            for name, method in (
                ("ChunkList", CHUNK_LIST_METHOD),
                ("Chunk", CHUNK_METHOD),
                ("Peers", PEERS_METHOD),
                ("ChunkServers", CHUNK_SERVERS_METHOD),
            )
        }
        self.stats: dict[int, FetchStats] = {}
        self._lock = threading.Lock()  # guards _holdings, _peer_lists, _channels
        self._holdings: collections.OrderedDict[int, Holding] = collections.OrderedDict()
        self._peer_lists: dict[int, list[PeerInfo]] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._stop = threading.Event()
        self._fetching = 0  # fetches in progress; close() waits for them to end
        self._idle = threading.Condition(self._lock)
        self.server: grpc.Server | None = None
        self.peer_address = ""
        if cfg.weights_peer_fanout:
            self._serve()
            self._announcer = threading.Thread(target=self._announce_loop, daemon=True, name="weights-announce")
            self._announcer.start()

    # --- the peer server and the registry -------------------------------------------------
    def _serve(self) -> None:
        host = self.cfg.weights_peer_host or bind_hosts(":0")[0]
        self.server = grpc.server(
            futures.ThreadPoolExecutor(self.cfg.weights_peer_threads, thread_name_prefix="weights-peer"),
            options=OPTIONS,
        )
        self.servicer = ChunkServicer(self._held, self.secret, self.cfg, max(1, self.cfg.weights_peer_threads // 2))
        self.server.add_generic_rpc_handlers([self.servicer.handlers()])
        creds = server_credentials(self.cfg)
        address = f"{host}:{self.cfg.weights_peer_port}"
        port = self.server.add_secure_port(address, creds) if creds else self.server.add_insecure_port(address)
        if not port:
            raise OSError(f"buffer.weights_peer_host/port: cannot listen on {address}")
        self.server.start()
        self.peer_address = f"{host}:{port}"
        log.info(
            "weight peer server of %s listening on %s%s", self.peer_id, self.peer_address, "" if creds else " (no TLS)"
        )

    def _held(self, version: int) -> Holding | None:
        with self._lock:
            return self._holdings.get(version)

    def _hold(self, version: int, holding: Holding) -> None:
        with self._lock:
            self._holdings[version] = holding
            self._holdings.move_to_end(version)
            while len(self._holdings) > self.cfg.weights_serve_versions:
                self._holdings.popitem(last=False)

    def _report(self, version: int, holding: Holding) -> None:
        """Tell the trainer what we hold of `version`; keep the peers it answers with."""
        with holding.lock:
            have = to_bitmap(holding.have, holding.chunks.total)
        raw = self._calls["Peers"](
            PeerReport(version, self.peer_id, self.peer_address, have).encode(),
            timeout=self.cfg.weights_chunk_timeout_s,
            metadata=self.metadata,
        )
        peers = PeerList.decode(raw).peers
        with self._lock:
            self._peer_lists[version] = [p for p in peers if p.peer_id != self.peer_id]

    def _announce_loop(self) -> None:
        failing_since = None
        while not self._stop.wait(self.cfg.weights_peer_refresh_s):
            with self._lock:
                held = list(self._holdings.items())
            for version, holding in held:
                try:
                    self._report(version, holding)
                    failing_since = None
                except ValueError:  # "closed channel": close() ran meanwhile
                    if self._stop.is_set():
                        return
                    raise
                except (grpc.RpcError, WireError) as e:
                    if failing_since is None or time.monotonic() - failing_since > NOTE_EVERY_S:
                        log.warning(
                            "cannot report held weight chunks to the trainer at %s (%s); retrying every %.1f s",
                            self.address,
                            _why(e),
                            self.cfg.weights_peer_refresh_s,
                        )
                        failing_since = time.monotonic()

    def _peer_call(self, address: str):
        with self._lock:
            if self._stop.is_set():  # closed: no new channel (the transfer stops at its next tick)
                raise FetchCancelled(f"the fetcher of {self.peer_id} is closed")
            if address not in self._channels:
                self._channels[address] = open_channel(self.cfg, address, OPTIONS)
            return self._channels[address].unary_unary(CHUNK_METHOD)

    def peers(self, version: int) -> list[PeerInfo]:
        with self._lock:
            return list(self._peer_lists.get(version, []))

    def close(self) -> None:
        """Stop fetching and serving. A fetch in progress ends with FetchCancelled: closing the
        channels ends its chunk requests at once, and it makes its verified chunks durable
        before it returns. It is waited for up to weights_chunk_timeout_s (it takes a loop tick,
        1 s, unless it is hashing the finished files); one still running when the process exits
        leaves the partial folder as a kill -9 does, resumable from its last bitmap."""
        self._stop.set()
        with self._lock:
            channels = [self.trainer, *self._channels.values()]
        for ch in channels:
            ch.close()
        with self._idle:
            if not self._idle.wait_for(lambda: not self._fetching, self.cfg.weights_chunk_timeout_s):
                log.warning(
                    "closing the weight fetcher of %s: a fetch still runs after %.0f s "
                    "(buffer.weights_chunk_timeout_s); its partial folder stays resumable",
                    self.peer_id,
                    self.cfg.weights_chunk_timeout_s,
                )
        if self.server is not None:
            self.server.stop(1.0).wait(timeout=10)

    # --- fetching ---------------------------------------------------------------------------
    def fetch(self, version: int, dest_dir: str) -> str:
        """Version `version` as a verified folder at `dest_dir` (returned): what is there
        already if it verifies against its manifest, else fetched, resuming `<dest>.partial/`.
        FetchCancelled once close() was called (whatever failed then: a closed channel)."""
        with self._idle:
            if self._stop.is_set():
                raise FetchCancelled(f"weight version {version}: the fetcher is closed")
            self._fetching += 1
        try:
            return self._fetch(version, dest_dir)
        except Exception as e:
            if self._stop.is_set() and not isinstance(e, FetchCancelled):
                raise FetchCancelled(f"weight version {version}: cancelled by close() ({e!r})") from e
            raise
        finally:
            with self._idle:
                self._fetching -= 1
                self._idle.notify_all()

    def _fetch(self, version: int, dest_dir: str) -> str:
        dest = os.path.abspath(dest_dir)
        partial = dest + PARTIAL
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with _flock(partial + ".lock", self.cfg.weights_stall_timeout_s):
            if os.path.isdir(dest):
                problem = _folder_problem(dest)
                if problem is None:  # fetched before (this process or an earlier one)
                    self._serve_cached(version, dest)
                    return dest_dir
                log.warning("%s: %s; fetching version %d again", dest, problem, version)
                shutil.rmtree(dest)
            chunks = self._chunk_list(version)
            state = _Partial(partial, chunks)
            try:
                stats = self.stats[version] = FetchStats(chunks=chunks.total, resumed=len(state.durable))
                holding = Holding(chunks, partial, set(state.durable))
                if self.server is not None:
                    self._hold(version, holding)
                _Transfer(self, version, state, holding, stats, self._chunk_servers(version)).run()
                self._finish(state, holding, dest)
            finally:
                state.close()
            if self.server is not None and not self._stop.is_set():
                with contextlib.suppress(grpc.RpcError, WireError):
                    self._report(version, holding)  # peers may take all of it from now on
        return dest_dir

    def _serve_cached(self, version: int, dest: str) -> None:
        """Serve a verified folder found on disk to peers, if the trainer (one try) still has
        the version's chunk list; the folder is usable either way."""
        if self.server is None or self._held(version) is not None:
            return
        try:
            chunks = ChunkList.decode(
                self._calls["ChunkList"](
                    ChunkListRequest(version).encode(), timeout=self.cfg.weights_chunk_timeout_s, metadata=self.metadata
                )
            )
        except (grpc.RpcError, WireError) as e:
            log.info("not serving cached weight version %d to peers: %s", version, _why(e))
            return
        self._hold(version, Holding(chunks, dest, set(range(chunks.total))))

    def _chunk_servers(self, version: int) -> list[str]:
        """The addresses of the trainer's chunk-server processes ("" for one not up now), on the
        host we reach the trainer at; none (every chunk from the trainer) if it names none or
        does not answer (one try: the trainer serves every chunk itself anyway)."""
        try:
            raw = self._calls["ChunkServers"](
                ChunkListRequest(version).encode(), timeout=self.cfg.weights_chunk_timeout_s, metadata=self.metadata
            )
            ports = ServerList.decode(raw).ports
        except (grpc.RpcError, WireError) as e:
            log.info("weight version %d: every chunk from the trainer (no chunk servers: %s)", version, _why(e))
            return []
        host = self.address.rpartition(":")[0]
        return [f"{host}:{p}" if p else "" for p in ports]

    def _chunk_list(self, version: int) -> ChunkList:
        deadline = time.monotonic() + self.cfg.weights_stall_timeout_s
        return _retry(
            lambda: ChunkList.decode(
                self._calls["ChunkList"](
                    ChunkListRequest(version).encode(), timeout=self.cfg.weights_chunk_timeout_s, metadata=self.metadata
                )
            ),
            deadline,
            f"the chunk list of weight version {version} from the trainer at {self.address}",
        )

    def _finish(self, state: _Partial, holding: Holding, dest: str) -> None:
        """Check every file against the manifest's sha256 (a bad one is fetched again: its
        chunks leave the bitmap), then drop the sidecars and rename into place."""
        state.save(0)
        chunks = state.chunks
        sums = state.hashes.digests(self.cfg.weights_chunk_timeout_s)  # hashed while fetching
        if sums is None:  # that thread failed: one thread per file (hashlib releases the GIL)
            with futures.ThreadPoolExecutor(max(1, min(len(chunks.files), os.cpu_count() or 1))) as pool:
                sums = list(pool.map(sha256_file, [os.path.join(state.folder, f.name) for f in chunks.files]))
        bad = [i for i, (f, got) in enumerate(zip(chunks.files, sums)) if got != f.sha256]
        if bad:
            names = [chunks.files[i].name for i in bad]
            state.forget(i for pos in bad for i in chunks.chunks_of(pos))
            raise ManifestError(
                f"{state.folder}: {names} do not match the manifest's sha256 "
                "although every chunk matched (damaged on disk?); their chunks "
                "are fetched again on the next fetch"
            )
        with open(os.path.join(state.folder, "manifest.json"), "w") as f:
            f.write(chunks.manifest)
            f.flush()
            os.fsync(f.fileno())
        for name in os.listdir(state.folder):  # the sidecars (and a temporary of one)
            if name.startswith(SIDECAR_PREFIX):
                os.remove(os.path.join(state.folder, name))
        with holding.lock:
            os.rename(state.folder, dest)
            holding.folder = dest
        dfd = os.open(os.path.dirname(dest), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class _Transfer:
    """One fetch's scheduling loop: up to weights_parallel requests to peers and
    weights_trainer_streams to the trainer in flight; results verified and written by the
    request threads, counted and made durable here."""

    def __init__(
        self,
        fetcher: WeightFetcher,
        version: int,
        state: _Partial,
        holding: Holding,
        stats: FetchStats,
        servers: list[str],
    ):
        self.f, self.version, self.state, self.holding, self.stats = fetcher, version, state, holding, stats
        self.servers = servers  # the trainer's chunk-server processes (k sends chunks k mod N)
        self.via: dict[futures.Future, int | None] = {}  # a trainer request -> its server (None: main)
        self.server_load: collections.Counter[int | None] = collections.Counter()
        self.server_failed: dict[int, float] = {}  # server -> when it last failed
        self.server_busy: dict[int, float] = {}  # server -> when to ask it again
        self.deferred: set[int] = set()  # servers whose chunks are asked of the main process
        self.cfg = fetcher.cfg
        self.missing = set(range(state.chunks.total)) - state.durable
        self.inflight: dict[futures.Future, tuple[str, int | None]] = {}  # -> (source, chunk)
        self.bad: set[str] = set()
        self.failed: dict[str, float] = {}  # peer -> when it last failed
        self.busy_until: dict[str, float] = {}  # peer -> when to ask it again (it was busy)
        self.trainer_retry_at = 0.0
        self.trainer_backoff = 0.2
        self.trainer_corrupt = 0
        self.peer_load: collections.Counter[str] = collections.Counter()  # peer -> our requests in flight to it

    def run(self) -> None:
        if self.f.server is not None and self.missing:
            with contextlib.suppress(grpc.RpcError, WireError):
                self.f._report(self.version, self.holding)  # peers before the first request
        start = last_gain = last_note = time.monotonic()
        self.pool = futures.ThreadPoolExecutor(
            self.cfg.weights_parallel + self.cfg.weights_trainer_streams, thread_name_prefix="weights-fetch"
        )
        try:
            while self.missing:
                self._cancelled()
                self._launch()
                done, _ = futures.wait(list(self.inflight), timeout=1.0, return_when=futures.FIRST_COMPLETED)
                self._cancelled()  # before settling: close() made the requests fail
                for fut in done:
                    if self._settle(fut):
                        last_gain = time.monotonic()
                self.state.save(1.0)
                now = time.monotonic()
                if now - last_gain > self.cfg.weights_stall_timeout_s:
                    raise TimeoutError(
                        f"weight version {self.version}: no chunk verified for "
                        f"{now - last_gain:.0f} s (buffer.weights_stall_timeout_s); "
                        f"{len(self.missing)} of {self.state.chunks.total} missing, "
                        f"trainer at {self.f.address}"
                    )
                if now - last_note >= NOTE_EVERY_S:
                    log.info(
                        "fetching weight version %d: %d of %d chunks verified; waiting for "
                        "%d requests (%d to peers, %d peers known, %d bad)",
                        self.version,
                        self.state.chunks.total - len(self.missing),
                        self.state.chunks.total,
                        len(self.inflight),
                        sum(self.peer_load.values()),
                        len(self.f.peers(self.version)),
                        len(self.bad),
                    )
                    last_note = now
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)  # no request writes any more
            self.state.save(0)  # the chunks verified are kept however the transfer ends
        self.stats.seconds = time.monotonic() - start

    def _cancelled(self) -> None:
        if self.f._stop.is_set():
            raise FetchCancelled(
                f"weight version {self.version}: fetch cancelled (the fetcher was closed) with "
                f"{self.state.chunks.total - len(self.missing)} of {self.state.chunks.total} "
                f"chunks verified, kept in {self.state.folder}"
            )

    def _launch(self) -> None:
        """Fill the free request slots. Peers: a random missing chunk of the least busy peer
        holding any (at most 2 of our requests per peer). Trainer: any missing chunk no known
        peer holds, its choice (it sends each outstanding request of ours a different one).
        A chunk the trainer is sending us is not reserved against peers: the trainer sends a
        chunk no peer had, unless every chunk has left it already (then rarely a duplicate)."""
        busy = {i for _, i in self.inflight.values() if i is not None}
        now = time.monotonic()
        peers = [
            p
            for p in self.f.peers(self.version)
            if p.peer_id not in self.bad
            and now - self.failed.get(p.peer_id, -1e9) > self.cfg.weights_peer_ttl_s
            and now >= self.busy_until.get(p.peer_id, 0.0)
        ]
        held = {p.peer_id: from_bitmap(p.have, self.state.chunks.total) for p in peers}
        n_peer = sum(1 for s, _ in self.inflight.values() if s != TRAINER)
        while n_peer < self.cfg.weights_parallel:
            order = sorted(peers, key=lambda p: (self.peer_load[p.peer_id], random.random()))
            choice = next(
                (
                    (p, options)
                    for p in order
                    if self.peer_load[p.peer_id] < 2 and (options := held[p.peer_id] & self.missing - busy)
                ),
                None,
            )
            if choice is None:
                break
            peer, options = choice
            index = random.choice(tuple(options))
            self._submit(peer.peer_id, index, self._from_peer, peer, index)
            busy.add(index)
            n_peer += 1
        n_trainer = sum(1 for s, _ in self.inflight.values() if s == TRAINER)
        if n_trainer >= self.cfg.weights_trainer_streams or now < self.trainer_retry_at:
            return
        want = self.missing - busy - set().union(*held.values())
        avoid = sorted(self.bad | {p for p, t in self.failed.items() if now - t <= self.cfg.weights_peer_ttl_s})
        for _ in range(min(self.cfg.weights_trainer_streams, len(want)) - n_trainer):
            target = self._trainer_target(want, now)
            if target is None:
                break
            via, part = target
            # to the main process, chunks of a deferred server: it sent them all once already
            sent = bool(self.deferred) and via is None and any(i % len(self.servers) in self.deferred for i in part)
            self.via[self._submit(TRAINER, None, self._from_trainer, part, avoid, via, sent)] = via
            self.server_load[via] += 1

    def _trainer_target(self, want: set[int], now: float) -> tuple[int | None, set[int]] | None:
        """Where the next trainer request goes, and the chunks it asks for: the least loaded of
        the chunk servers up (process k: the chunks k mod N of `want`) and the main process (the
        chunks of those down, failed lately or deferred), each with fewer requests in flight
        than chunks to ask it for (each outstanding one may be bringing one of them)."""
        if not self.servers:
            return (None, want) if self.server_load[None] < len(want) else None
        n = len(self.servers)
        parts: dict[int | None, set[int]] = collections.defaultdict(set)
        for i in want:
            k = i % n
            up = (
                self.servers[k]
                and k not in self.deferred
                and now - self.server_failed.get(k, -1e9) > self.cfg.weights_peer_ttl_s
            )
            if not up:
                parts[None].add(i)
            elif now >= self.server_busy.get(k, 0.0):
                parts[k].add(i)
        options = [(self.server_load[k], random.random(), k) for k, p in parts.items() if self.server_load[k] < len(p)]
        if not options:
            return None
        _, _, k = min(options, key=lambda o: (o[0], o[1]))
        return k, parts[k]

    def _submit(self, source: str, index: int | None, fn, *args) -> futures.Future:
        fut = self.pool.submit(fn, *args)
        self.inflight[fut] = (source, index)
        if source != TRAINER:
            self.peer_load[source] += 1
        return fut

    def _store(self, reply: ChunkReply) -> int:
        """Verify a reply against the chunk list and write it (in the request's thread)."""
        chunks = self.state.chunks
        if not 0 <= reply.index < chunks.total or reply.version != self.version:
            raise _Corrupt(f"chunk {reply.index} of v{reply.version}: not asked for")
        if hashlib.sha256(reply.data).digest() != chunks.digest(reply.index):
            raise _Corrupt(f"chunk {reply.index}: sha256 does not match the chunk list")
        if reply.index in self.missing:
            self.state.write(reply.index, reply.data)
        return reply.index

    def _from_peer(self, peer: PeerInfo, index: int) -> tuple[int, int]:
        raw = self.f._peer_call(peer.address)(
            ChunkRequest(self.version, self.f.peer_id, index=index).encode(),
            timeout=self.cfg.weights_chunk_timeout_s,
            metadata=self.f.metadata,
        )
        reply = ChunkReply.decode(raw)
        if reply.index != index:
            raise _Corrupt(f"asked for chunk {index}, got {reply.index}")
        return self._store(reply), len(reply.data)

    def _from_trainer(self, want: set[int], avoid: list[str], via: int | None, sent: bool) -> tuple[int, int]:
        call = self.f._calls["Chunk"] if via is None else self.f._peer_call(self.servers[via])
        raw = call(
            ChunkRequest(
                self.version,
                self.f.peer_id,
                want=to_bitmap(want, self.state.chunks.total),
                peers=self.cfg.weights_peer_fanout,
                avoid=avoid,
                sent=sent,
            ).encode(),
            timeout=self.cfg.weights_chunk_timeout_s,
            metadata=self.f.metadata,
        )
        reply = ChunkReply.decode(raw)
        if reply.index in (REDIRECT, ASK_TRAINER) and not reply.data:
            return reply.index, 0
        if reply.index not in want:
            raise _Corrupt(f"got chunk {reply.index}, not one asked for")
        return self._store(reply), len(reply.data)

    def _settle(self, fut: futures.Future) -> bool:
        """Count a finished request; True when it brought a new verified chunk."""
        source, _ = self.inflight.pop(fut)
        via = self.via.pop(fut, None)
        if source != TRAINER:
            self.peer_load[source] -= 1
        else:
            self.server_load[via] -= 1
        try:
            index, size = fut.result()
        except _Corrupt as e:
            self.stats.corrupt += 1
            if source == TRAINER:
                self.trainer_corrupt += 1
                if self.trainer_corrupt > 3:
                    raise ManifestError(
                        f"weight version {self.version}: the trainer at "
                        f"{self.f.address} sent {self.trainer_corrupt} chunks "
                        f"that do not match its own chunk list ({e})"
                    ) from None
                log.warning("a chunk from the trainer failed its check (%s); fetching it again", e)
            else:
                self.bad.add(source)
                self.stats.bad_peers.append(source)
                log.warning(
                    "weight version %d: peer %s sent a damaged chunk (%s); not using it again for this version",
                    self.version,
                    source,
                    e,
                )
            return False
        except (grpc.RpcError, WireError) as e:
            if via is not None:
                self._server_failed(via, e)
            else:
                self._failed(source, e)
            return False
        if index == ASK_TRAINER and via is not None:
            self.stats.deferred += 1
            self.deferred.add(via)
            return False
        if index == REDIRECT:  # live peers hold all we asked for: the next peer list has them
            self.stats.redirects += 1
            self.trainer_retry_at = time.monotonic() + self.cfg.weights_peer_refresh_s
            return False
        if index not in self.missing:
            self.stats.duplicates += 1
            return False
        self.missing.discard(index)
        with self.holding.lock:
            self.holding.have.add(index)
        self.state.pending.add(index)
        self.state.hashes.written(index)
        if source == TRAINER:
            self.stats.from_trainer += 1
            self.stats.from_servers += via is not None
            self.stats.bytes_from_trainer += size
            self.trainer_backoff = 0.2
        else:
            self.stats.from_peers += 1
            self.stats.bytes_from_peers += size
        return True

    def _server_failed(self, k: int, e: Exception) -> None:
        """A chunk-server process failed a request: busy, asked again shortly; else (it died,
        it restarts; or it does not hold the version) its chunks go to the trainer's main
        process for weights_peer_ttl_s, which says what is wrong if anything is."""
        if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.stats.busy += 1
            self.server_busy[k] = time.monotonic() + self.cfg.weights_peer_refresh_s
            return
        self.stats.server_failures += 1
        self.server_failed[k] = time.monotonic()
        log.info(
            "the trainer's chunk server at %s failed a request (%s); its chunks from the trainer for %.0f s",
            self.servers[k],
            _why(e),
            self.cfg.weights_peer_ttl_s,
        )

    def _failed(self, source: str, e: Exception) -> None:
        code = e.code() if isinstance(e, grpc.RpcError) else None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # its link is full: ask again shortly
            self.stats.busy += 1
            again = time.monotonic() + self.cfg.weights_peer_refresh_s
            if source == TRAINER:
                self.trainer_retry_at = again
            else:
                self.busy_until[source] = again
            return
        if source != TRAINER:
            self.stats.peer_failures += 1
            self.failed[source] = time.monotonic()
            log.info(
                "weight peer %s failed a chunk request (%s); skipping it for %.0f s",
                source,
                _why(e),
                self.cfg.weights_peer_ttl_s,
            )
            return
        self.stats.trainer_failures += 1
        if code == grpc.StatusCode.UNAUTHENTICATED:
            raise PermissionError(
                f"the trainer at {self.f.address} refused the token "
                f"(buffer.grpc_token_file or $TANDEM_GRPC_TOKEN): {_why(e)}"
            )
        if code == grpc.StatusCode.NOT_FOUND:  # the trainer holds every chunk of what it publishes
            raise ManifestError(f"weight version {self.version}: no longer on the trainer (pruned?): {_why(e)}")
        log.warning(
            "a chunk request to the trainer at %s failed (%s); retrying in %.1f s",
            self.f.address,
            _why(e),
            self.trainer_backoff,
        )
        self.trainer_retry_at = time.monotonic() + self.trainer_backoff
        self.trainer_backoff = min(self.trainer_backoff * 2, 5.0)


def _why(e: Exception) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    return repr(e)


def _retry(call, deadline: float, what: str):
    """call() until it succeeds; transient gRPC failures retried with backoff until `deadline`,
    a line per failure saying what it waits for; a refused token or a missing version raise."""
    backoff = 0.2
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise PermissionError(
                    f"{what}: token refused (buffer.grpc_token_file or $TANDEM_GRPC_TOKEN): {_why(e)}"
                ) from None
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise ManifestError(f"{what}: {_why(e)}") from None
            if time.monotonic() + backoff > deadline:
                raise TimeoutError(f"{what}: gave up after buffer.weights_stall_timeout_s ({_why(e)})") from None
            log.warning("waiting for %s (%s); retrying in %.1f s", what, _why(e), backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)


@contextlib.contextmanager
def _flock(path: str, timeout_s: float):
    """One fetch per destination (another process fetching it holds the lock; a killed one
    released it, and left the file). Waits up to `timeout_s`, saying so. The holder removes the
    file before it lets go, however it ends, so that only a killed fetch leaves one."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start, noted = time.monotonic(), -NOTE_EVERY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited >= timeout_s:
                    raise TimeoutError(
                        f"{path}: another fetch of this version held the lock for {waited:.0f} s"
                    ) from None
                if waited - noted >= NOTE_EVERY_S:
                    log.info("waiting for another fetch into %s to finish (%.0f s)", path, waited)
                    noted = waited
                time.sleep(0.2)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    finally:
        os.close(fd)


def discard_partial(dest: str) -> bool:
    """Remove `<dest>.partial/` and its lock file unless a fetch (of this process or another)
    holds the lock; False when one does."""
    try:
        with _flock(dest + PARTIAL + ".lock", timeout_s=0):
            shutil.rmtree(dest + PARTIAL, ignore_errors=True)
    except TimeoutError:
        return False
    return True


def _folder_problem(folder: str) -> str | None:
    """Why a finished folder is not the version its manifest.json describes, or None."""
    path = os.path.join(folder, "manifest.json")
    try:
        with open(path) as f:
            verify_files(WeightManifest.from_json(f.read(), where=path), folder)
    except (OSError, ManifestError) as e:
        return str(e)
    return None


class NetWeightSource(WeightSource):
    """LATEST from the run service; versions fetched into the process's own folder's weights/
    (`layout`, its weight cache) by a WeightFetcher (chunked, verified, resumable, from peers
    too), made on the first fetch (its peer server is of no use to a process that never
    fetches). The newest `keep` complete versions (buffer.grpc_cache_versions) are kept, and at
    most one partial fetch (`_prune`)."""

    def __init__(self, client: RunClient, layout: RunLayout, keep: int):
        self.client, self.layout, self.keep = client, layout, keep
        self._fetcher: WeightFetcher | None = None
        self._verified: set[int] = set()  # cache folders this process fetched or checked
        self._rebuilt: set[int] = set()  # rebuilt delta versions (.full/) this process checked
        self._ready: set[int] = set()  # versions whose full folder is here (fetch returns at once)
        # (version, thread, errors) of the one background fetch. A daemon thread: a process
        # killed mid-fetch leaves a resumable partial folder (the next fetch continues it);
        # close() cancels it on a clean stop and keeps the folder (see close).
        self._background: tuple[int, threading.Thread, list[BaseException]] | None = None

    def pointer(self) -> dict | None:
        doc = self.client.call("WeightsPointer").doc
        if doc is not None:
            self._prefetch(int(doc["version"]))
        return doc

    def _prefetch(self, version: int) -> None:
        """Fetch `version` in the background, one version at a time (a newer one seen while
        another is in flight starts at a later `pointer()`). Called from one thread (the role's)."""
        bg = self._background
        if version in self._ready or (bg is not None and (bg[0] == version or bg[1].is_alive())):
            return
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self._fetch(version)
            except Exception as e:  # handed to fetch(version); a pruned version is retried later
                errors.append(e)

        thread = threading.Thread(target=run, name=f"prefetch-v{version}", daemon=True)
        self._background = (version, thread, errors)
        thread.start()

    def ready(self, version: int) -> bool:
        bg = self._background
        return version in self._ready or (bg is not None and bg[0] == version and not bg[1].is_alive())

    def newest_ready(self, above: int) -> int | None:
        ready = list(self._ready)  # one C-level copy: the background fetch adds to it meanwhile
        return max((v for v in ready if v > above), default=None)  # _prune drops pruned ones

    def exists(self, version: int) -> bool:
        return self.client.call("VersionExists", rs.VersionRef(version)).value

    def where(self) -> str:
        return f"the trainer's weights at {self.client.address} (cached in {self.layout.weights_dir})"

    def fetch(self, version: int) -> str:
        bg = self._background
        if bg is not None and bg[0] == version:  # in flight or done in the background
            bg[1].join()  # bounded: the fetcher gives up after buffer.weights_stall_timeout_s
            self._background = None
            if bg[2]:
                raise bg[2][0]
        return self._fetch(version)

    def version_bytes(self, version: int) -> int:
        path = os.path.join(self.layout.version_dir(version), "manifest.json")
        try:
            with open(path) as f:
                return sum(e.bytes for e in WeightManifest.from_json(f.read(), where=path).files)
        except (OSError, ManifestError):  # pruned from the cache meanwhile: not counted
            return 0

    def request_snapshot(self, version: int) -> None:
        self.client.call("RequestSnapshot", rs.VersionRef(version))

    def _fetch(self, version: int) -> str:
        """The full folder of `version`: fetched (a snapshot), or its delta fetched and rebuilt
        on its base (fetched too, or rebuilt, if this cache lacks it: buffer/weights/delta.py)."""
        t0 = time.monotonic()
        folder = delta.resolve(
            version, self._published, self.layout.weights_dir, drop=self._drop, verified=self._rebuilt
        )
        self._ready.add(version)
        log.info("weight version %d in %s (%.2f s)", version, folder, time.monotonic() - t0)
        self._prune()
        return folder

    def _published(self, version: int) -> str:
        """The version's published folder (a snapshot or a delta) in the cache, verified."""
        folder = self.layout.version_dir(version)
        if version in self._verified and os.path.isdir(folder):
            return folder
        if self._fetcher is None:
            self._fetcher = WeightFetcher(self.client.address, token(self.client.cfg), self.client.cfg)
        # a folder already there is checked, else fetched; a full cache disk is waited out
        # (resuming the verified chunks), never handed to the worker as a crash
        fetcher = self._fetcher
        when_space(lambda: fetcher.fetch(version, folder), folder)
        self._verified.add(version)
        return folder

    def _drop(self, version: int) -> None:
        """Forget a cached copy that did not rebuild right: the next `_published` fetches it."""
        self._verified.discard(version)
        self._ready.discard(version)
        shutil.rmtree(self.layout.version_dir(version), ignore_errors=True)

    def close(self) -> None:
        """A clean stop cancels the fetch in flight and KEEPS its partial folder, as a kill -9
        does: its verified chunks are durable, and a worker restarted on this folder (SLURM
        requeue after preemption, a pool growing again) resumes it instead of fetching a
        model's worth again. Its disk is bounded (one partial, `_prune`); its lock file goes."""
        if self._fetcher is not None:
            self._fetcher.close()

    def _prune(self) -> None:
        """The cache bound: the newest `keep` complete versions and at most one partial fetch,
        that of the newest version above them (in flight, or left by a stop: resumed by the
        next fetch of it). Older partials go: a worker fetches the newest version, so it would
        not resume them. A partial that a fetch is writing (it holds the lock) is left alone."""
        names = os.listdir(self.layout.weights_dir)
        complete = sorted(v for v in map(RunLayout.version_of, names) if v is not None)
        partials = {RunLayout.version_of(n.split(".", 1)[0]) for n in names if PARTIAL in n}
        newest = max(complete, default=-1)
        resumable = max((v for v in partials if v is not None and v > newest), default=None)
        for version in complete[: -self.keep]:
            shutil.rmtree(self.layout.version_dir(version), ignore_errors=True)
            self._verified.discard(version)
            self._ready.discard(version)
        for version in partials - {None, resumable}:
            discard_partial(self.layout.version_dir(version))
        rebuilt = os.path.join(self.layout.weights_dir, delta.FULL_DIR)
        kept = set(complete[-self.keep :])
        for name in os.listdir(rebuilt) if os.path.isdir(rebuilt) else []:
            if RunLayout.version_of(name) is not None and RunLayout.version_of(name) not in kept:
                shutil.rmtree(os.path.join(rebuilt, name), ignore_errors=True)
                self._rebuilt.discard(RunLayout.version_of(name) or -1)
