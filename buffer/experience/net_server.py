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
import os
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import pyarrow as pa

from buffer.channel import MAX_MESSAGE_BYTES, WRITER_KEY, authorized, bind_hosts, is_loopback, server_credentials, token
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
    """One push in progress: whether it waits for the client's next message, since when."""

    context: Any  # a grpc.ServicerContext
    last: float
    waiting: bool = False
    idled: bool = False


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
                yield chunk
        except grpc.RpcError:
            self.stats["idle_timeouts" if stream.idled else "cancelled"] += 1
            raise
        if stream.idled:  # a cancelled stream may also just end
            self.stats["idle_timeouts"] += 1
            stream.context.abort(grpc.StatusCode.CANCELLED, "no data for buffer.grpc_idle_timeout_s")

    def watch_idle(self, stop: threading.Event) -> None:
        """Cancel every push silent for grpc_idle_timeout_s: a stalled client must not hold one
        of the server's threads. The handler's blocked read then raises; the temporary file of
        a partial shard is removed on the way out."""
        idle = self.cfg.grpc_idle_timeout_s
        while not stop.wait(min(1.0, idle / 4)):
            now = time.monotonic()
            with self.lock:
                stalled = [s for s in self.streams if s.waiting and not s.idled and now - s.last > idle]
            for s in stalled:
                s.idled = True
                log.warning("cancelled a push silent for %.0f s (buffer.grpc_idle_timeout_s)", now - s.last)
                s.context.cancel()

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
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.grpc_server_threads, thread_name_prefix="grpc-spool"),
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
        )
        push = grpc.stream_unary_rpc_method_handler(
            self.servicer.Push, request_deserializer=decode_chunk, response_serializer=pb.Ack.SerializeToString
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
            target=self.servicer.watch_idle, args=(self._stop_watch,), daemon=True, name="grpc-idle-watch"
        ).start()
        log.info("experience gRPC server listening on %s (port %d)", ", ".join(bind_hosts(cfg.grpc_bind)), self.port)

    def stop(self, grace_s: float = 5.0) -> None:
        self._stop_watch.set()
        self.server.stop(grace_s).wait(timeout=grace_s + 5)
