"""The trainer's side of experience over the network (`buffer.transport=grpc`), `ShardServer`.

It receives shards (service in protocol/experience.proto) as a stream of chunks, checks the token
and the schema version from the header, writes each chunk to a temporary file while hashing it,
and publishes (fsync + rename) the run's own `experience/<worker>/<seq>.arrow` on the trainer's
disk (`FsSpool`) only if the sha256 trailer matches; only then it
acknowledges. The filesystem reader consumes the spool, so both transports share one reader and
its exactly-once ledger; a trainer crash loses nothing it acknowledged. Resends of one (worker,
seq) are idempotent; different shards are handled in parallel. The worker's side is
buffer/experience/net_client.py.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import pyarrow as pa

from buffer.channel import (
    MAX_MESSAGE_BYTES,
    WRITER_KEY,
    ServicePool,
    authorized,
    bind_hosts,
    in_pool,
    is_loopback,
    server_credentials,
    token,
)
from buffer.config import BufferConfig
from buffer.control.fs import FsStore
from buffer.layout import RunLayout
from buffer.ledger import shard_key
from buffer.storage import atomic_writer, filesystem, is_disk_full
from protocol import experience_pb2 as pb
from protocol.experience import SCHEMA_VERSION, IntegrityError, StreamVerifier
from protocol.shard_stream import SERVICE, Undecodable, chunk_data, decode_chunk

log = logging.getLogger(__name__)
MAX_CLAIMS = 4096  # worker-id claims kept before the expired ones are dropped
NOTE_S = 10.0  # at most one line per this many seconds about cancelled pushes
EVICT_AFTER_S = 0.5  # client time before a push's rate can get it evicted (a new one's is noise)
SPARE_THREADS = 4  # push threads per buffer.grpc_server_threads: the spare ones take new pushes
# A shard more than this past its worker's highest accepted one is refused: one seq of 10**12
# would otherwise make every later shard "below the highest", past the backlog cap. An honest
# writer is at most buffer.grpc_max_inflight (<= SEQ_WINDOW) ahead.
SEQ_WINDOW = 1024


@dataclasses.dataclass
class FsSpool(FsStore):
    """The trainer's side of a network ExperienceSink: shards received into the same
    experience/<worker>/<seq>.arrow the reader reads, spooled beside the worker folders (so a
    refused push never creates experience/<worker>/) under a temporary name of one push."""

    def path(self, worker_id: str, seq: int) -> str:
        """Where the shard is published; ValueError for an invalid worker id."""
        return self.layout.shard(worker_id, seq)

    def has(self, worker_id: str, seq: int) -> bool:
        return self.fs.exists(self.path(worker_id, seq))

    def writer(self, worker_id: str, seq: int, push: str):
        """A binary file to write the shard through; it appears (fsynced) only if the block
        ends without an exception (buffer.storage.atomic_writer)."""
        tmp = self.layout.spool_tmp(worker_id, seq, push)
        return atomic_writer(self.fs, self.path(worker_id, seq), tmp)


class _KeyLocks:
    """One lock per key, kept in the table while any push holds or waits for it (dropping it
    when its holder finishes would let a third push make a new lock and run beside a waiter)."""

    def __init__(self):
        self._guard = threading.Lock()
        self._locks: dict[str, list] = {}  # key -> [lock, pushes holding or waiting]

    @contextlib.contextmanager
    def hold(self, key: str):
        with self._guard:
            entry = self._locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._guard:
                entry[1] -= 1
                if not entry[1]:
                    del self._locks[key]


class _Refused(Exception):
    """A push that breaks the protocol (INVALID_ARGUMENT)."""


@dataclasses.dataclass(eq=False)  # kept in a set by identity
class _Stream:
    """One push in progress: whether it waits for the client's next message, since when; the
    bytes received and the seconds spent waiting for the client (its rate: the server's own
    time, writing or waiting for a lock, never counts against it); why it was cut, if it was."""

    context: Any  # a grpc.ServicerContext
    last: float
    waiting: bool = False
    cut: str = ""  # the stats key of the watch that cancelled it ("" while it runs)
    started: float = dataclasses.field(default_factory=time.monotonic)
    received: int = 0
    client_s: float = 0.0  # waiting for the client, before the current wait
    marks: collections.deque = dataclasses.field(default_factory=collections.deque)  # (client s, bytes)

    def client_time(self, now: float) -> float:
        return self.client_s + (now - self.last if self.waiting else 0.0)

    def window_rate(self, now: float, window: float) -> float | None:
        """Bytes/s over the latest `window` s of client time (None until it waited that long);
        called by the watch, which records a mark each tick."""
        t = self.client_time(now)
        self.marks.append((t, self.received))
        while len(self.marks) > 1 and self.marks[1][0] <= t - window:
            self.marks.popleft()
        t0, b0 = self.marks[0]
        return (self.received - b0) / (t - t0) if t - t0 >= window else None


@dataclasses.dataclass
class _Claim:
    """Which writer (WRITER_KEY metadata) uses a worker id, its pushes now, its last push."""

    writer: str
    active: int = 0
    last: float = 0.0


class _Servicer:
    def __init__(self, root: str, secret: str, cfg: BufferConfig, consumed, retired=None, cap=lambda: 0):
        fs, path = filesystem(root)
        self.spool = FsSpool(fs, RunLayout(path))
        self.expected = f"Bearer {secret}".encode()
        self.max_shard_bytes = cfg.grpc_max_shard_mb << 20
        self.cfg = cfg
        self.consumed = consumed  # callable -> the reader's ledger, for idempotence after pruning
        # Backpressure: samples spooled here minus samples the trainer retired (None: off). The
        # spool found at start is not counted, as if retired: the count starts at zero.
        self.retired, self.cap = retired, cap
        self.spooled_samples = retired() if retired is not None else 0
        self.key_locks = _KeyLocks()
        self._push_ids = itertools.count()
        self.lock = threading.Lock()  # guards claims, streams, spooled_samples, highest
        self.highest: dict[str, int] = {}  # worker -> its highest shard number spooled here
        self.claims: dict[str, _Claim] = {}
        self.streams: set[_Stream] = set()
        self.stats: collections.Counter[str] = collections.Counter()
        self._noted = -math.inf  # when a cancelled push was last logged

    def Push(self, request_iterator, context):
        if not authorized(context, self.expected):
            self.stats["refused"] += 1
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
        stream = _Stream(context, time.monotonic(), waiting=True)
        with self.lock:
            self.streams.add(stream)
        try:
            chunks = self._timed(stream, request_iterator)
            head = self._header(next(chunks, None), context)
            release = self._admit(head.worker_id, context)
            try:
                duplicate = self._locked_spool(head, chunks, context)
            finally:
                release()
            return pb.Ack(worker_id=head.worker_id, seq=head.seq, duplicate=duplicate)
        finally:
            with self.lock:
                self.streams.discard(stream)

    def _timed(self, stream: _Stream, request_iterator):
        """The request's messages, noting when each arrived; a cancelled stream (by the idle
        watch, or the client) ends the handler here, whichever way grpc reports it."""
        messages = iter(request_iterator)
        try:
            while True:
                stream.last, stream.waiting = time.monotonic(), True  # only the client's time counts
                try:
                    chunk = next(messages)
                except StopIteration:
                    break
                finally:
                    stream.waiting = False
                    stream.client_s += time.monotonic() - stream.last
                stream.received += _wire_size(chunk)
                yield chunk
        except grpc.RpcError:
            self.stats[stream.cut or "cancelled"] += 1
            raise
        if stream.cut:  # a cancelled stream may also just end
            self.stats[stream.cut] += 1
            stream.context.abort(grpc.StatusCode.CANCELLED, f"cancelled by the trainer ({stream.cut})")

    def watch_streams(self, stop: threading.Event) -> None:
        """Cancel every push silent for grpc_idle_timeout_s, slower than grpc_min_rate_bytes_s
        over grpc_min_rate_window_s, or older than grpc_stream_deadline_s: a stalled or
        trickling client must not hold one of the push threads. The handler's blocked read then
        raises; the temporary file of a partial shard is removed on the way out. gRPC's client
        sees CANCELLED (a server-side cancel carries no details): the log line and the stats key
        say which bound cut it."""
        cfg = self.cfg
        while not stop.wait(min(1.0, cfg.grpc_idle_timeout_s / 4, cfg.grpc_min_rate_window_s / 4)):
            now = time.monotonic()
            with self.lock:
                streams = [s for s in self.streams if not s.cut]
            if len(streams) > cfg.grpc_server_threads:  # those not evicted when the others came
                self.evict_slowest(len(streams) - cfg.grpc_server_threads)
            for s in streams:
                rate = s.window_rate(now, cfg.grpc_min_rate_window_s)
                if now - s.started > cfg.grpc_stream_deadline_s:
                    age = now - s.started
                    self._cut(s, "stream_deadlines", f"open for {age:.0f} s (buffer.grpc_stream_deadline_s)")
                elif s.waiting and now - s.last > cfg.grpc_idle_timeout_s:
                    self._cut(s, "idle_timeouts", f"silent for {now - s.last:.0f} s (buffer.grpc_idle_timeout_s)")
                elif s.waiting and rate is not None and rate < cfg.grpc_min_rate_bytes_s:
                    self._cut(s, "slow_streams", f"sending {rate:.0f} bytes/s (buffer.grpc_min_rate_bytes_s)")

    def evict_slowest(self, n: int = 1) -> None:
        """More than grpc_server_threads pushes run or wait, `n` too many (a new one arrived, or
        the watch found them): cancel the `n` slowest pushes waiting for their clients whose rate so far (after
        EVICT_AFTER_S of client time) is under grpc_min_rate_bytes_s, so that trickling clients
        cannot hold the threads honest ones need. Runs on grpc's polling thread: no blocking."""
        now, floor = time.monotonic(), self.cfg.grpc_min_rate_bytes_s
        with self.lock:
            rated = [
                (s.received / t, s)
                for s in self.streams
                if s.waiting and not s.cut and (t := s.client_time(now)) >= EVICT_AFTER_S
            ]
        for rate, s in sorted((x for x in rated if x[0] < floor), key=lambda x: x[0])[:n]:
            self._cut(s, "evicted", f"sending {rate:.0f} bytes/s while every push thread was busy")

    def _cut(self, stream: _Stream, key: str, why: str) -> None:
        """Cancel `stream`, counted under `key`; one line per NOTE_S (a flood of slow clients
        must not flood the log too)."""
        stream.cut = key
        now = time.monotonic()
        if now - self._noted >= NOTE_S:
            self._noted = now
            log.warning("cancelled a push %s (%s so far: %s)", why, key, self.stats[key] + 1)
        stream.context.cancel()

    def _admit(self, worker_id: str, context):
        """Refuse a second live writer of one worker id, and more than grpc_max_pushes_per_worker
        pushes of one id at once (both retried by an honest writer); returns the release."""
        writer = dict(context.invocation_metadata()).get(WRITER_KEY, "")
        now = time.monotonic()
        with self.lock:
            claim = self.claims.get(worker_id)
            if claim is not None and claim.writer != writer:
                age = now - claim.last
                if claim.active or age < self.cfg.grpc_claim_ttl_s:
                    self.stats["claim_refused"] += 1
                    context.abort(
                        grpc.StatusCode.ABORTED,
                        f"worker id {worker_id} is in use by another writer (its last "
                        f"push {age:.0f} s ago): give every worker its own worker.id; "
                        f"a restarted worker takes the id over "
                        f"{self.cfg.grpc_claim_ttl_s:.0f} s after the last push "
                        "(buffer.grpc_claim_ttl_s)",
                    )
                claim = None
            if claim is None:
                if len(self.claims) >= MAX_CLAIMS:  # ids invented by a client must not pile up
                    self.claims = {
                        w: c for w, c in self.claims.items() if c.active or now - c.last < self.cfg.grpc_claim_ttl_s
                    }
                claim = self.claims[worker_id] = _Claim(writer)
            if claim.active >= self.cfg.grpc_max_pushes_per_worker:
                self.stats["over_cap"] += 1
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"worker {worker_id} already has {claim.active} pushes in progress "
                    "(buffer.grpc_max_pushes_per_worker)",
                )
            claim.active += 1

        def release() -> None:
            with self.lock:
                claim.active -= 1
                claim.last = time.monotonic()

        return release

    def _locked_spool(self, head: pb.ShardHeader, chunks, context) -> bool:
        key = shard_key(head.worker_id, head.seq)
        with self.key_locks.hold(key):  # one push per (worker, seq) at a time; others in parallel
            return self._spool(head, key, chunks, context)

    def _header(self, first, context) -> pb.ShardHeader:
        if isinstance(first, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, first.reason)
        if first is None or isinstance(first, memoryview) or first.WhichOneof("part") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a push must start with a ShardHeader")
        head = first.header
        if head.schema_version != SCHEMA_VERSION:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"schema version {head.schema_version!r}, trainer reads {SCHEMA_VERSION!r}",
            )
        if head.size > self.max_shard_bytes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"shard of {head.size} bytes over buffer.grpc_max_shard_mb")
        try:
            self.spool.path(head.worker_id, head.seq)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return head

    def _spool(self, head: pb.ShardHeader, key: str, chunks, context) -> bool:
        """Write the chunks through a temporary file, hashing as they arrive; publish (fsync +
        rename) only a whole, undamaged shard. Column checks are the reader's, as for shards in
        a shared folder: one validation per shard, and bad content is quarantined the same way."""
        path = self.spool.path(head.worker_id, head.seq)
        if key in self.consumed() or self.spool.has(head.worker_id, head.seq):
            self.stats["duplicates"] += 1
            return True
        self._seq_bound(head, key, context)
        self._backpressure(head, key, context)
        verifier = StreamVerifier()
        try:  # spooled beside experience/<worker>/ (that folder appears with the first good
            # shard), under a temporary name of this push alone: a stray writer never truncates it
            push = f"{os.getpid()}.{next(self._push_ids)}"
            with self.spool.writer(head.worker_id, head.seq, push) as f:
                for chunk in chunks:
                    if isinstance(chunk, Undecodable):
                        raise _Refused(chunk.reason)
                    data = chunk_data(chunk)
                    if data is None:
                        raise IntegrityError("a second ShardHeader inside one push")
                    verifier.update(data)
                    if verifier.size > head.size:
                        break
                    f.write(data)
                if verifier.size != head.size:
                    raise IntegrityError(f"header says {head.size} bytes, received {verifier.size}")
                verifier.finish()
        except IntegrityError as e:  # damaged on the way: the worker's copy may be fine, resend
            self.stats["rejected"] += 1
            context.abort(grpc.StatusCode.DATA_LOSS, f"{key}: {e}")
        except OSError as e:  # the temporary is gone (atomic_writer); the worker retries later
            if not is_disk_full(e):
                raise
            self.stats["disk_full"] += 1
            log.warning("disk full at %s: refusing shards until there is space", path)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{key}: disk full at {path} on the trainer: retry later")
        except _Refused as e:  # not our protocol: resending the same bytes cannot help
            self.stats["rejected"] += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{key}: {e}")
        self.stats["spooled"] += 1
        samples = _declared_samples(path)
        with self.lock:  # handlers finish concurrently: an unlocked += loses counts (and the cap)
            self.spooled_samples += samples
            self.highest[head.worker_id] = max(head.seq, self.highest.get(head.worker_id, -1))
        return False

    def _seq_bound(self, head: pb.ShardHeader, key: str, context) -> None:
        """Refuse (INVALID_ARGUMENT, SeqOutOfWindow) a shard more than SEQ_WINDOW past its
        worker's highest accepted one: spooled here, consumed (the ledger) or in the spool."""
        top = self.highest.get(head.worker_id)
        if top is None:  # nothing spooled by this server yet (kept once one is: ids a client
            # invents must not grow the table)
            top = max([self._ledger_next(head.worker_id) - 1, *self._spooled_seqs(head.worker_id)])
        if head.seq > top + SEQ_WINDOW:
            self.stats["seq_out_of_window"] += 1
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"SeqOutOfWindow: {key}: seq {head.seq} is more than {SEQ_WINDOW} past the highest "
                f"accepted shard {top} of worker {head.worker_id}",
            )

    def _ledger_next(self, worker_id: str) -> int:
        ledger = self.consumed()
        return ledger.next_seq(worker_id) if hasattr(ledger, "next_seq") else 0

    def _spooled_seqs(self, worker_id: str) -> list[int]:
        folder = self.spool.layout.worker_shard_dir(worker_id)
        if not self.spool.fs.exists(folder):
            return []
        listed = (RunLayout.shard_seq(p) for p in self.spool.fs.ls(folder, detail=False))
        return [s for s in listed if s is not None]

    def _backpressure(self, head: pb.ShardHeader, key: str, context) -> None:
        """Refuse a new shard (RESOURCE_EXHAUSTED: the worker retries later) while the trainer
        has more samples spooled and not yet retired than the cap, as workers writing to a
        shared folder wait (buffer/control/backpressure.py): a trainer that stops consuming must stop
        the spool growing. A shard below one of its worker's spooled shards is always taken:
        the reader reads a worker's shards in order, so refusing it would hold back every
        shard after it until the reader's next full scan (buffer.full_scan_interval), and
        the spool's backlog with them (concurrent pushes arrive out of order)."""
        if self.retired is None or head.seq < self.highest.get(head.worker_id, -1):
            return
        backlog, cap = self.spooled_samples - self.retired(), self.cap()
        if backlog > cap:
            self.stats["backpressure"] += 1
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{key}: the trainer holds {backlog} samples not yet trained or dropped, "
                f"over its cap of {cap} (buffer.max_backlog_samples, or one step): "
                "retry later",
            )


def _wire_size(chunk) -> int:
    """Bytes of one received message, as far as a stream's rate goes."""
    if isinstance(chunk, memoryview):
        return len(chunk)
    return chunk.ByteSize() if isinstance(chunk, pb.ShardChunk) else 0


def _declared_samples(path: str) -> int:
    """Samples a spooled shard's writer recorded (its schema is the stream's first message)."""
    try:
        with pa.OSFile(path) as f:
            return int(pa.ipc.open_stream(f).schema.metadata[b"tandem.num_samples"])
    except (pa.ArrowException, OSError, KeyError, ValueError, TypeError):
        return 0  # the reader quarantines it; it retires what it can count


class ShardServer:
    """Owned by the trainer's rank 0; `stop()` ends it. With `retired` (the trainer's count of
    samples retired) it pushes back once more than max(buffer.max_backlog_samples,
    `step_samples()`) spooled samples are not retired yet."""

    def __init__(
        self, root: str, cfg: BufferConfig, consumed=lambda: (), retired=None, step_samples=lambda: 0, services=()
    ):
        self.servicer = _Servicer(
            root, token(cfg), cfg, consumed, retired, lambda: max(cfg.max_backlog_samples, step_samples())
        )
        # Each service runs on its own pool (buffer/channel.py ServicePool): the pushes' here,
        # the others' their own; the server's pool only answers what none of them claims.
        # pushes past grpc_server_threads evict the slowest, on spare threads: not queued
        # (in FIFO order) behind trickling clients that reconnect as fast as they are cut
        threads = cfg.grpc_server_threads
        self.pool = ServicePool(threads * SPARE_THREADS, "grpc-spool", self.servicer.evict_slowest, soft=threads)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grpc-other"),
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
        )
        push = grpc.stream_unary_rpc_method_handler(
            in_pool(self.servicer.Push, self.pool),
            request_deserializer=decode_chunk,
            response_serializer=pb.Ack.SerializeToString,
        )
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {"Push": push})])
        for add in services:  # more services on this server and port (buffer/run.py)
            add(self.server)  # before it starts: no client ever finds them missing
        creds = server_credentials(cfg)
        self.port = 0
        for host in bind_hosts(cfg.grpc_bind):
            port = cfg.grpc_bind.rpartition(":")[2] if not self.port else str(self.port)
            address = f"{host}:{port}"
            bound = self.server.add_secure_port(address, creds) if creds else self.server.add_insecure_port(address)
            if not bound:
                raise OSError(f"buffer.grpc_bind: cannot listen on {address} (from {cfg.grpc_bind!r})")
            self.port = bound
            if creds is None and not is_loopback(host):
                log.warning(
                    "WARNING: the experience gRPC server listens on %s WITHOUT TLS: the "
                    "token and every shard cross the network in clear. Set "
                    "buffer.grpc_tls_cert and buffer.grpc_tls_key (workers: "
                    "buffer.grpc_tls_ca)",
                    address,
                )
        self.server.start()
        self._stop_watch = threading.Event()
        threading.Thread(
            target=self.servicer.watch_streams, args=(self._stop_watch,), daemon=True, name="grpc-stream-watch"
        ).start()
        log.info("experience gRPC server listening on %s (port %d)", ", ".join(bind_hosts(cfg.grpc_bind)), self.port)

    def stop(self, grace_s: float = 5.0) -> None:
        self._stop_watch.set()
        self.server.stop(grace_s).wait(timeout=grace_s + 5)
        self.pool.shutdown(wait=False, cancel_futures=True)  # its calls ended with the server
