"""The gRPC transport (`buffer.transport=grpc`) for clusters without a shared filesystem.

Trainer side, `ShardServer`: receives shards (service in protocol/experience.proto), checks the
token, the schema version, the checksum and every column (the same `load_shard` the reader
uses), then spools the bytes atomically into the run's own `experience/<worker>/<seq>.arrow` on
the trainer's disk, and only then acknowledges. The filesystem reader consumes the spool, so
both transports share one reader and its exactly-once ledger; a trainer crash loses nothing it
acknowledged.

Worker side, `GrpcShardWriter`: the `ShardWriter` interface; published shards are pushed
concurrently by an owned pool of `grpc_max_inflight` sender threads, at most that many
unacknowledged at a time (the writer blocks beyond that: flow control), each resent with the same
(worker, seq) after any failure, with backoff, until acknowledged. Resends are idempotent on the
server, which handles different shards in parallel.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent import futures

import grpc

from buffer.config import BufferConfig
from buffer.layout import RunLayout
from buffer.storage import atomic_write, filesystem
from buffer.writer import ShardWriter
from protocol import experience_pb2 as pb
from protocol import experience_pb2_grpc as pb_grpc
from protocol.experience import SCHEMA_VERSION, SchemaError, load_shard

log = logging.getLogger(__name__)
TOKEN_ENV = "TANDEM_GRPC_TOKEN"


def token(cfg: BufferConfig) -> str:
    """The shared secret: `buffer.grpc_token_file`, else $TANDEM_GRPC_TOKEN; required."""
    if cfg.grpc_token_file:
        with open(cfg.grpc_token_file) as f:
            value = f.read().strip()
    else:
        value = os.environ.get(TOKEN_ENV, "")
    if not value:
        raise ValueError(f"buffer.transport=grpc needs a shared token: set buffer.grpc_token_file "
                         f"or ${TOKEN_ENV}")
    return value


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


class _Servicer(pb_grpc.ExperienceServicer):
    def __init__(self, root: str, secret: str, vocab_size: int | None, consumed):
        self.fs, root_path = filesystem(root)
        self.layout = RunLayout(root_path)
        self.secret = secret
        self.vocab_size = vocab_size
        self.consumed = consumed  # callable -> the reader's ledger, for idempotence after pruning
        self.lock = threading.Lock()  # guards key_locks
        self.key_locks: dict[str, threading.Lock] = {}
        self.stats = collections.Counter()

    def Push(self, request, context):
        meta = dict(context.invocation_metadata())
        if meta.get("authorization") != f"Bearer {self.secret}":
            self.stats["refused"] += 1
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
        if request.schema_version != SCHEMA_VERSION:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"schema version {request.schema_version!r}, trainer reads {SCHEMA_VERSION!r}")
        try:
            path = self.layout.shard(request.worker_id, request.seq)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        key = f"{request.worker_id}/{request.seq}"
        with self.lock:
            key_lock = self.key_locks.setdefault(key, threading.Lock())
        with key_lock:  # one push per (worker, seq) at a time; different shards in parallel
            if key in self.consumed() or self.fs.exists(path):
                self.stats["duplicates"] += 1
                return pb.Ack(worker_id=request.worker_id, seq=request.seq, duplicate=True)
            try:
                load_shard(request.data, self.vocab_size)
            except SchemaError as e:
                self.stats["rejected"] += 1
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{key}: {e}")
            atomic_write(self.fs, path, request.data,
                         tmp=self.layout.shard_tmp(request.worker_id, request.seq, os.getpid()))
            self.stats["spooled"] += 1
        with self.lock:
            self.key_locks.pop(key, None)
        return pb.Ack(worker_id=request.worker_id, seq=request.seq, duplicate=False)


class ShardServer:
    """Owned by the trainer's rank 0; `stop()` ends it."""

    def __init__(self, root: str, cfg: BufferConfig, vocab_size: int | None = None,
                 consumed=lambda: ()):
        limit = cfg.grpc_max_message_mb << 20
        self.servicer = _Servicer(root, token(cfg), vocab_size, consumed)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                  options=[("grpc.max_receive_message_length", limit),
                                           ("grpc.max_send_message_length", limit)])
        pb_grpc.add_ExperienceServicer_to_server(self.servicer, self.server)
        if cfg.grpc_tls_cert:
            creds = grpc.ssl_server_credentials([(_read(cfg.grpc_tls_key), _read(cfg.grpc_tls_cert))])
            self.port = self.server.add_secure_port(cfg.grpc_bind, creds)
        else:
            self.port = self.server.add_insecure_port(cfg.grpc_bind)
        if not self.port:
            raise OSError(f"buffer.grpc_bind: cannot listen on {cfg.grpc_bind}")
        self.server.start()
        log.info("experience gRPC server listening on %s (port %d)", cfg.grpc_bind, self.port)

    def stop(self, grace_s: float = 5.0) -> None:
        self.server.stop(grace_s).wait(timeout=grace_s + 5)


class GrpcShardWriter(ShardWriter):
    """A ShardWriter whose shards go to the trainer over gRPC instead of a shared folder."""

    def __init__(self, root: str, worker_id: str, cfg: BufferConfig, resume: dict | None = None):
        super().__init__(root, worker_id, cfg, resume)
        self.secret = token(cfg)
        self.unacked: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self.cond = threading.Condition()
        self.fatal = False  # the trainer refused a shard: retrying cannot help
        self.stopping = False
        self.last_error: str | None = None
        self.stub = self._connect()
        self.senders = futures.ThreadPoolExecutor(cfg.grpc_max_inflight, thread_name_prefix="grpc-push")

    def _connect(self):
        limit = self.cfg.grpc_max_message_mb << 20
        options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
        if self.cfg.grpc_tls_ca:
            creds = grpc.ssl_channel_credentials(root_certificates=_read(self.cfg.grpc_tls_ca))
            self.channel = grpc.secure_channel(self.cfg.grpc_address, creds, options)
        else:
            self.channel = grpc.insecure_channel(self.cfg.grpc_address, options)
        return pb_grpc.ExperienceStub(self.channel)

    def _publish(self, seq: int, data: bytes) -> str:
        """Hand the shard to a sender; block while `grpc_max_inflight` await acknowledgement."""
        deadline = time.monotonic() + self.cfg.backlog_timeout_s
        with self.cond:
            while len(self.unacked) >= self.cfg.grpc_max_inflight and not self.fatal:
                if not self.cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"{len(self.unacked)} shards unacknowledged by "
                                       f"{self.cfg.grpc_address} for {self.cfg.backlog_timeout_s:.0f} s;"
                                       f" last error: {self.last_error}")
            if self.fatal:
                raise RuntimeError(f"the trainer refused a shard: {self.last_error}")
            self.unacked[seq] = data
        self.senders.submit(self._push_until_acked, seq, data)
        return f"grpc://{self.cfg.grpc_address}/{self.worker_id}/{seq}"

    def _push_until_acked(self, seq: int, data: bytes) -> None:
        """One sender thread per in-flight shard, so validation and fsync on the trainer overlap
        for consecutive shards. Retries with backoff until acknowledged or refused."""
        backoff = 0.2
        shard = pb.Shard(worker_id=self.worker_id, seq=seq, data=data, schema_version=SCHEMA_VERSION)
        while not self.stopping:
            try:
                self.stub.Push(shard, timeout=self.cfg.grpc_timeout_s,
                               metadata=[("authorization", f"Bearer {self.secret}")])
            except grpc.RpcError as e:
                code = e.code()
                self.last_error = f"{code.name}: {e.details()}"
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.INVALID_ARGUMENT):
                    log.error("trainer refused shard %d: %s", seq, self.last_error)
                    with self.cond:  # not retryable: surfaced by the next publish or close
                        self.fatal = True
                        self.cond.notify_all()
                    return
                log.warning("push of shard %d failed (%s); retrying in %.1f s", seq, self.last_error, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            with self.cond:
                self.unacked.pop(seq, None)
                self.cond.notify_all()
            return

    def close(self, timeout_s: float = 60.0) -> None:
        """Flush, wait until every shard is acknowledged (bounded), stop the senders."""
        self.flush()
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.unacked and not self.fatal:
                if not self.cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    break
            left = len(self.unacked)
        self.stopping = True
        self.senders.shutdown(wait=True)
        self.channel.close()
        if left:
            raise TimeoutError(f"{left} shards still unacknowledged by {self.cfg.grpc_address} "
                               f"after {timeout_s:.0f} s; last error: {self.last_error}")
