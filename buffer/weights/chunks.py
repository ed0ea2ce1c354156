"""Chunks of weight versions as a gRPC server sends them: the trainer (all of a published
version, buffer/weights/net_server.py) and every worker's peer server (the chunks it has verified
so far, buffer/weights/net_client.py) answer the same Chunk method, each through a
`ChunkServicer` of its `Holding`s, with a bounded number of sends at once and an optional cap on
the upload rate."""
from __future__ import annotations

import collections
import os
import random
import threading
import time
from collections.abc import Callable

import grpc

from buffer.channel import MAX_MESSAGE_BYTES, authorized
from buffer.config import BufferConfig
from protocol.weights_wire import SERVICE, ChunkList, ChunkReply, ChunkRequest, WireError, from_bitmap

# Chunks (<= 4 MiB) fit the experience stream's limit; a chunk list (32 bytes a chunk: 2 MiB
# for 256 GB in 4 MiB chunks) is the largest message a worker receives.
# Chunks (<= 4 MiB) fit the experience stream's limit; a chunk list (32 bytes a chunk: 2 MiB
# for 256 GB in 4 MiB chunks) is the largest message a worker receives.
OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


_PACE_BYTES = 256 << 10  # the uplink model's packet: concurrent replies interleave at this grain


REDIRECT = -1  # a ChunkReply's index: every chunk asked for is with live peers, ask them


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
        self.served = collections.Counter()  # chunk -> times sent
        self.recent: dict[str, dict[int, float]] = {}  # peer -> chunk -> when sent to it

    def read(self, index: int) -> bytes:
        pos, offset, length = self.chunks.locate(index)
        with self.lock:
            fd = os.open(os.path.join(self.folder, self.chunks.files[pos].name), os.O_RDONLY)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def pick(self, want: set[int], peer: str, window_s: float,
             covered: Callable[[], set[int]] = set) -> int | None:
        """The chunk of `want` this holder has sent least often, preferring those not sent to
        `peer` within `window_s` (its request for them may still be on the way back). A chunk
        sent before is only sent again when it is not in `covered()` (held by, or just sent
        to, a live peer the requester can use); REDIRECT when every one is."""
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
            if all(self.served[i] for i in options):
                elsewhere = covered()
                options = [i for i in options if i not in elsewhere]
                if not options:
                    return REDIRECT
            best = min(options, key=lambda i: (i in sent, self.served[i], random.random()))
            self.served[best] += 1
            sent[best] = now
            return best


class ChunkServicer:
    """The Chunk method, served from `holding(version)`; shared by the trainer and the peers."""

    def __init__(self, holding: Callable[[int], Holding | None], secret: str, cfg: BufferConfig,
                 max_waiting: int, covered=None):
        self.holding = holding
        self.max_waiting, self.waiting = max_waiting, 0
        self.covered = covered  # (version, requester, its peers to avoid) -> chunks peers cover
        self.expected = f"Bearer {secret}".encode()
        self.cfg = cfg
        self.uplink = _Uplink(cfg.weights_upload_mb_s * 1e6)
        self.slots = threading.BoundedSemaphore(cfg.weights_send_slots)
        self.stats = collections.Counter()
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
            covered = set
            if self.covered is not None and req.peers:
                covered = lambda: self.covered(req.version, req.peer_id, set(req.avoid))  # noqa: E731
            index = held.pick(from_bitmap(req.want, held.chunks.total), req.peer_id,
                              self.cfg.weights_chunk_timeout_s, covered)
            if index == REDIRECT:
                self.count(redirects=1)
                return ChunkReply(req.version, REDIRECT, b"").encode()
        if index is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"v{req.version}: no chunk asked for is held here")
        try:
            data = held.read(index)
        except OSError as e:  # pruned meanwhile (trainer) or the folder went away (peer)
            context.abort(grpc.StatusCode.NOT_FOUND, f"v{req.version} chunk {index}: {e}")
        self.uplink.send(len(data))
        self.count(chunks=1, bytes=len(data))
        return ChunkReply(req.version, index, data).encode()

    def handlers(self, **more) -> grpc.GenericRpcHandler:
        methods = {"Chunk": self.Chunk, **more}
        return grpc.method_handlers_generic_handler(SERVICE, {
            name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in methods.items()})
