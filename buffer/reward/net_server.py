"""A reward server's gRPC side (protocol/reward.py): the token, TLS and message bounds of the run's
other servers (buffer/channel.py), calls on their own thread pool, and one owned scoring thread.

A Score call is tokenised on its handler thread and queued; the scoring thread takes every
queued group (at most `gather_tokens` tokens of them at once: the groups of several workers share
micro-batches), scores them (the scorer micro-batches by its token budget) and answers each
call. At most `max_queued` groups wait: one more is refused with RESOURCE_EXHAUSTED (the client
retries, on another server where there is one). `drain()` refuses new calls (UNAVAILABLE: the
client goes elsewhere or waits) and finishes the queued ones.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from concurrent import futures
from typing import NoReturn, Protocol

import grpc

from buffer.channel import ServicePool, authorized, in_pool, is_loopback, server_credentials
from buffer.config import BufferConfig
from protocol import reward as rw

log = logging.getLogger(__name__)


class Scorer(Protocol):
    """What the server scores with (rollout.reward_model.RewardScorer)."""

    max_length: int

    def encode(self, messages: list[dict], response: str) -> list[int]: ...
    def score_rows(self, rows: list) -> list[float]: ...


@dataclasses.dataclass
class _Job:
    rows: list[list[int]]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    scores: list[float] | None = None
    error: str = ""


class RewardService:
    """Serves `scorer` (whose model has checksum `scorer_id`) to the run's workers."""

    def __init__(
        self,
        scorer: Scorer,
        row_type,
        scorer_id: str,
        server_id: str,
        secret: str,
        threads: int = 8,
        max_queued: int = 256,
        gather_tokens: int = 65536,
        info: dict | None = None,
    ):
        self.scorer, self.row_type, self.scorer_id, self.server_id = scorer, row_type, scorer_id, server_id
        self.expected = f"Bearer {secret}".encode()
        self.max_queued, self.gather_tokens = max_queued, gather_tokens
        self.info = info or {}
        self.pool = ServicePool(threads, "grpc-reward")
        self.queue: collections.deque[_Job] = collections.deque()
        self.cond = threading.Condition()
        self.draining = False
        self.busy = 0  # jobs taken by the scoring thread, not answered yet
        self.stats: collections.Counter[str] = collections.Counter()
        self._stop = False
        self.thread = threading.Thread(target=self._score_loop, name="reward-scorer", daemon=True)
        self.thread.start()

    def handler(self) -> grpc.GenericRpcHandler:
        methods = {}
        for name, rpc in rw.RPCS.items():
            decode = (lambda cls: lambda raw: _decoded(cls, raw))(rpc.request)
            methods[name] = grpc.unary_unary_rpc_method_handler(
                in_pool(getattr(self, f"_do_{name}"), self.pool),
                request_deserializer=decode,
                response_serializer=rw.encode,
            )
        return grpc.method_handlers_generic_handler(rw.SERVICE, methods)

    def _refuse(self, context, code: grpc.StatusCode, details: str) -> NoReturn:
        self.stats[code.name] += 1
        context.abort(code, details)
        raise AssertionError("grpc's abort raises")

    def _check(self, request, context) -> None:
        if not authorized(context, self.expected):
            self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
        schema = dict(context.invocation_metadata()).get(rw.SCHEMA_KEY)
        if schema != str(rw.SCHEMA):
            self._refuse(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"reward schema {schema!r}, this server serves {rw.SCHEMA}",
            )
        if isinstance(request, rw.MessageError):
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(request))

    def _do_Info(self, request, context) -> rw.InfoReply:
        self._check(request, context)
        return rw.InfoReply(server_id=self.server_id, scorer=self.scorer_id, **self.info)

    def _do_Score(self, request, context) -> rw.ScoreReply:
        self._check(request, context)
        try:
            rw.check_request(request)
        except rw.MessageError as e:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.draining:
            self._refuse(context, grpc.StatusCode.UNAVAILABLE, f"reward server {self.server_id} is draining")
        job = _Job([self.scorer.encode(request.messages, r) for r in request.responses])
        with self.cond:
            if len(self.queue) >= self.max_queued:
                self._refuse(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"reward server {self.server_id}: {self.max_queued} groups queued already",
                )
            self.queue.append(job)
            self.cond.notify_all()
        while not job.done.wait(0.5):  # the client's deadline ends the call: drop the job's answer
            if not context.is_active():
                self.stats["abandoned"] += 1
                return rw.ScoreReply()
        if job.error:
            self._refuse(context, grpc.StatusCode.INTERNAL, job.error)
        self.stats["groups"] += 1
        return rw.ScoreReply(scores=list(job.scores or []), scorer=self.scorer_id)

    def _take(self) -> list[_Job]:
        """Queued jobs up to gather_tokens (at least one), waiting for the first."""
        with self.cond:
            while not self.queue and not self._stop:
                self.cond.wait(0.5)
            jobs: list[_Job] = []
            tokens = 0
            while self.queue and (not jobs or tokens + sum(map(len, self.queue[0].rows)) <= self.gather_tokens):
                job = self.queue.popleft()
                jobs.append(job)
                tokens += sum(map(len, job.rows))
            self.busy += len(jobs)
            return jobs

    def _score_loop(self) -> None:
        while not self._stop:
            jobs = self._take()
            if not jobs:
                continue
            rows: list = []
            spans: list[tuple[int, int]] = []
            for job in jobs:
                spans.append((len(rows), len(job.rows)))
                rows += [self.row_type(len(rows) + k, ids) for k, ids in enumerate(job.rows)]
            t0 = time.monotonic()
            try:
                scores = self.scorer.score_rows(rows)
            except Exception as e:  # noqa: BLE001 - one failed batch answers its calls, the server goes on
                log.exception("reward server %s: scoring %d rows failed", self.server_id, len(rows))
                for job in jobs:
                    job.error = f"scoring failed: {type(e).__name__}: {e}"
            else:
                for job, (start, n) in zip(jobs, spans):
                    job.scores = scores[start : start + n]
                self.stats["rows"] += len(rows)
                self.stats["score_ms"] += int(1000 * (time.monotonic() - t0))
            for job in jobs:
                job.done.set()
            with self.cond:
                self.busy -= len(jobs)
                self.cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Refuse new calls, finish the queued ones (at most `timeout_s`); True when all were."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while (self.queue or self.busy) and time.monotonic() < deadline:
                self.cond.wait(0.2)
            return not (self.queue or self.busy)

    def close(self) -> None:
        self._stop = True
        with self.cond:
            self.cond.notify_all()
        self.thread.join(timeout=30)
        self.pool.shutdown(wait=False, cancel_futures=True)


def serve(service: RewardService, buffer: BufferConfig, host: str, port: int) -> tuple[grpc.Server, int]:
    """A started grpc.Server with `service` on host:port (0: a free port), TLS from
    buffer.grpc_tls_cert/key; its port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grpc-other"),
        options=[("grpc.max_receive_message_length", rw.MAX_REQUEST_BYTES)],
    )
    server.add_generic_rpc_handlers([service.handler()])
    creds = server_credentials(buffer)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    if not bound:
        raise OSError(f"reward server: cannot listen on {address}")
    if creds is None and not is_loopback(host):
        log.warning(
            "WARNING: the reward server listens on %s WITHOUT TLS: the token and every prompt and "
            "response cross the network in clear. Set buffer.grpc_tls_cert and buffer.grpc_tls_key",
            address,
        )
    server.start()
    return server, bound


def _decoded(cls, raw: bytes):
    try:
        return rw.decode(cls, raw)
    except rw.MessageError as e:
        return e
