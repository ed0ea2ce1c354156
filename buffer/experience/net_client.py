"""A worker's side of experience over the network (`buffer.transport=grpc`), `GrpcSink`: the
network ExperienceSink of `buffer.writer.ShardWriter`. Shards are pushed concurrently by an owned
pool of `grpc_max_inflight` sender threads, at most that many unacknowledged at a time (the
writer blocks beyond that: flow control), each resent with the same (worker, seq) after any
failure, with backoff, until acknowledged by buffer/experience/net_server.py. Until then each
shard's bytes wait in the worker's own folder (outbox/<worker>/<seq>.arrow, written atomically
before the first push, removed on the acknowledgement): a restarted worker re-sends them, or
declares lost those it cannot (`recover`)."""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures

import grpc
import pyarrow as pa

from buffer.channel import MAX_MESSAGE_BYTES, WRITER_KEY, open_channel, token
from buffer.config import BufferConfig
from buffer.control.backpressure import NOTE_EVERY_S
from buffer.control.base import RunState
from buffer.experience.base import ExperienceSink
from buffer.experience.fs import FsExperienceSink
from buffer.layout import RunLayout
from buffer.storage import atomic_write
from protocol import experience_pb2 as pb
from protocol.experience import SCHEMA_VERSION, IntegrityError, payload
from protocol.shard_stream import PUSH_METHOD, encode_chunk

log = logging.getLogger(__name__)

_REFUSALS = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
)  # resending the same bytes cannot help


DAMAGED_RESENDS = 3


class GrpcSink(ExperienceSink):
    """The network ExperienceSink: shards go to the trainer over gRPC. Published shards are
    pushed concurrently by an owned pool of `grpc_max_inflight` sender threads; the claim, the
    resume listing and `has` are the worker's own folder's (`local`)."""

    def __init__(
        self, local: FsExperienceSink, cfg: BufferConfig, run: RunState, room: Callable[..., float] | None = None
    ):
        self.local, self.cfg, self.run = local, cfg, run
        # the run's backpressure on the run service's heartbeats and progress (buffer/run.py
        # binds buffer/control/backpressure.py's wait_for_room), as a shared-folder worker's
        self.room = room
        self.worker_id = local.worker_id
        self.secret = token(cfg)
        self.writer_key = uuid.uuid4().hex  # this writer's claim on its worker id
        self.unacked: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self.cond = threading.Condition()
        self.fatal = False  # the trainer refused a shard: retrying cannot help
        self.stopping = False
        self.last_error: str | None = None
        self._noted_full = -math.inf  # when the trainer's backpressure was last logged
        # when the trainer began refusing shards with RESOURCE_EXHAUSTED (its backlog cap, a full
        # disk, too many pushes at once); None again at the next acknowledgement (wait_for_room)
        self.held_since: float | None = None
        self.push = self._connect()
        self.senders = futures.ThreadPoolExecutor(cfg.grpc_max_inflight, thread_name_prefix="grpc-push")

    def _connect(self):
        self.channel = open_channel(
            self.cfg, self.cfg.grpc_address, [("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        )
        return self.channel.stream_unary(
            PUSH_METHOD, request_serializer=encode_chunk, response_deserializer=pb.Ack.FromString
        )

    def publish(self, seq: int, data: bytes) -> str:
        """Hand the shard to a sender; block while `grpc_max_inflight` await acknowledgement."""
        deadline = time.monotonic() + self.cfg.backlog_timeout_s
        with self.cond:
            while len(self.unacked) >= self.cfg.grpc_max_inflight and not self.fatal:
                if self.run.done():  # no trainer will take it: do not wait for one
                    log.warning("the run is finished (%s): shard %d not pushed", self.run.where(), seq)
                    return f"grpc://{self.cfg.grpc_address}/{self.worker_id}/{seq} (not pushed)"
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{len(self.unacked)} shards unacknowledged by "
                        f"{self.cfg.grpc_address} for {self.cfg.backlog_timeout_s:.0f} s;"
                        f" last error: {self.last_error}"
                    )
                self.cond.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            if self.fatal:
                raise RuntimeError(f"the trainer refused a shard: {self.last_error}")
        # Durable before any push: a kill from here on leaves it for the restarted worker.
        tmp = self.local.layout.outbox_tmp(self.worker_id, seq, os.getpid())
        atomic_write(self.local.fs, self._outbox(seq), data, tmp=tmp)
        self._send(seq, data)
        return f"grpc://{self.cfg.grpc_address}/{self.worker_id}/{seq}"

    def _send(self, seq: int, data: bytes) -> None:
        with self.cond:
            self.unacked[seq] = data
        self.senders.submit(self._push_until_acked, seq, data)

    def _outbox(self, seq: int) -> str:
        return self.local.layout.outbox_shard(self.worker_id, seq)

    def settled(self, beat_next_seq: int) -> int:
        return 0  # the heartbeat's next_seq counts shards never acknowledged

    def recover(self) -> list[int]:
        """Push again every shard of the outbox; remove and return those whose copy is damaged."""
        lost = []
        for seq in self.published():
            path = self._outbox(seq)
            try:
                data = self.local.fs.cat_file(path)
                payload(data)  # the trailer's sha256
            except (OSError, IntegrityError) as e:
                log.error("shard %d of %s cannot be re-sent (%s): declaring it lost", seq, self.worker_id, e)
                self.local.fs.rm(path)
                lost.append(seq)
                continue
            log.info("re-sending shard %d of %s from %s (not acknowledged before a restart)", seq, self.worker_id, path)
            self._send(seq, data)
        return lost

    def unsure_from(self, seq: int) -> int:
        with self.cond:  # a shard is published once acknowledged
            return min([seq, *self.unacked])

    def published(self) -> list[int]:
        """The outbox: shards pushed and not acknowledged yet (ascending)."""
        folder = self.local.layout.outbox_dir(self.worker_id)
        if not self.local.fs.exists(folder):
            return []
        listed = (RunLayout.shard_seq(p) for p in self.local.fs.ls(folder, detail=False))
        return sorted(s for s in listed if s is not None)

    def samples_in(self, seq: int) -> int:
        with self.local.fs.open(self._outbox(seq), "rb") as f:
            meta = pa.ipc.open_stream(f).schema.metadata
        return int(meta[b"tandem.num_samples"])

    def has(self, seq: int) -> bool:
        return self.local.has(seq)

    def read_claim(self) -> dict | None:
        return self.local.read_claim()

    def write_claim(self, claim: dict) -> None:
        self.local.write_claim(claim)

    def wait_for_room(
        self, limit: int, timeout_s: float, should_stop, on_wait=lambda: None, group_size: int = 1
    ) -> float:
        """Block while the run's backlog is over the cap, as a shared-folder worker does (`room`:
        every worker's samples written, from the heartbeats, less the trainer's retired ones),
        then while the trainer still refuses a shard of ours with RESOURCE_EXHAUSTED (its own
        copy of the cap, a full disk: net_server's `_backpressure`). Relying on the refusals
        alone let a worker run ahead by all `grpc_max_inflight` shards and the batches in hand,
        which aged while refused and were dropped as stale (CPU, 8 steps, `benchmarks/net26.py
        --cpu`: 3,072 samples dropped against 0 on the shared folder)."""
        start = time.monotonic()
        if self.room is not None:
            self.room(limit, timeout_s, should_stop, on_wait=on_wait, group_size=group_size)
        last_note, first = time.monotonic(), True
        while not should_stop():
            with self.cond:
                held = self.held_since is not None and bool(self.unacked) and not self.fatal
                if not held:
                    break
                refused_s = time.monotonic() - self.held_since
            now = time.monotonic()
            why = (
                f"the trainer at {self.cfg.grpc_address} has refused our shards for {refused_s:.0f} s "
                f"({len(self.unacked)} waiting; {self.last_error})"
            )
            if now - start > timeout_s:
                raise TimeoutError(f"{why}; waited {timeout_s:.0f} s (buffer.backlog_timeout_s): is it consuming?")
            if first or now - last_note >= NOTE_EVERY_S:
                log.info("%s: waiting for the trainer to train or drop samples", why)
                first, last_note = False, now
            on_wait()
            with self.cond:  # an acknowledgement notifies
                self.cond.wait(timeout=0.5)
        return time.monotonic() - start

    def where(self) -> str:
        return f"grpc://{self.cfg.grpc_address}"

    def _chunks(self, seq: int, data: bytes):
        yield pb.ShardChunk(
            header=pb.ShardHeader(worker_id=self.worker_id, seq=seq, size=len(data), schema_version=SCHEMA_VERSION)
        )
        step, view = self.cfg.grpc_chunk_kb << 10, memoryview(data)
        for start in range(0, len(data), step):
            yield view[start : start + step]  # encode_chunk frames it without another copy

    def _push_until_acked(self, seq: int, data: bytes) -> None:
        """One sender thread per in-flight shard, so hashing and fsync on the trainer overlap
        for consecutive shards. Retries with backoff until acknowledged or refused; a shard that
        arrives damaged (DATA_LOSS) is resent, but only DAMAGED_RESENDS times: past that the
        worker's own copy is the damaged one."""
        backoff, damaged = 0.2, 0
        while not self.stopping:
            try:
                self.push(
                    self._chunks(seq, data),
                    timeout=self.cfg.grpc_timeout_s,
                    metadata=[("authorization", f"Bearer {self.secret}"), (WRITER_KEY, self.writer_key)],
                )
            except grpc.RpcError as e:
                code = e.code()
                self.last_error = f"{code.name}: {e.details()}"
                damaged += code == grpc.StatusCode.DATA_LOSS
                if code in _REFUSALS or damaged > DAMAGED_RESENDS:
                    log.error("trainer refused shard %d: %s", seq, self.last_error)
                    with self.cond:  # not retryable: surfaced by the next publish or close
                        self.fatal = True
                        self.cond.notify_all()
                    return
                if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    log.warning("push of shard %d failed (%s); retrying in %.1f s", seq, self.last_error, backoff)
                else:
                    with self.cond:
                        self.held_since = self.held_since or time.monotonic()
                    if time.monotonic() - self._noted_full > 30:  # backpressure: normal, say so
                        log.info("the trainer is not taking shards yet (%s); retrying", self.last_error)
                        self._noted_full = time.monotonic()
                time.sleep(backoff)
                # the trainer's backpressure lifts as soon as it trains, and the worker waits for
                # it meanwhile (wait_for_room): look again within half a second
                backoff = min(backoff * 2, 0.5 if code == grpc.StatusCode.RESOURCE_EXHAUSTED else 10.0)
                continue
            try:
                self.local.fs.rm(self._outbox(seq))
            except FileNotFoundError:
                pass
            with self.cond:
                self.unacked.pop(seq, None)
                self.held_since = None
                self.cond.notify_all()
            return

    def close(self, timeout_s: float = 60.0) -> None:
        """Wait until every shard is acknowledged (bounded), then stop the senders: always (a
        sender left retrying would keep the process from exiting)."""
        try:
            deadline = time.monotonic() + timeout_s
            with self.cond:
                while self.unacked and not self.fatal and time.monotonic() < deadline:
                    if self.run.done():
                        log.warning(
                            "the run is finished (%s): %d shards not pushed", self.run.where(), len(self.unacked)
                        )
                        self.unacked.clear()
                        break
                    self.cond.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                left = len(self.unacked)
        finally:
            self.stopping = True
            self.senders.shutdown(wait=True)
            self.channel.close()
            self.local.close()  # the worker id's lock
        if self.fatal:
            raise RuntimeError(f"the trainer refused a shard ({left} unacknowledged): {self.last_error}")
        if left:
            raise TimeoutError(
                f"{left} shards still unacknowledged by {self.cfg.grpc_address} "
                f"after {timeout_s:.0f} s; last error: {self.last_error}"
            )
