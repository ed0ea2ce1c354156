"""What every gRPC medium of the run shares (`buffer.transport=grpc`): the token, channels and
server credentials (TLS), the hosts a server binds, and `RunClient`, the unary-call client of the
trainer's run service (protocol/run_service.py) with its deadlines and retries.

Every call of a RunClient has a deadline (buffer.grpc_call_timeout_s). While the trainer cannot be
reached (not started yet, restarting: UNAVAILABLE), or is busy (DEADLINE_EXCEEDED,
RESOURCE_EXHAUSTED, ABORTED), a call is retried with backoff (0.2 s doubling to 5 s), saying every
30 s what it waits for, for at most buffer.grpc_trainer_wait_s; then TimeoutError. A refusal that
retrying cannot change (a bad token, a malformed request) raises RunServiceError at once;
NOT_FOUND (a weight version pruned) raises FileNotFoundError, as the filesystem stores do.
"""

from __future__ import annotations

import errno
import functools
import hmac
import ipaddress
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

import grpc

from buffer.config import BufferConfig
from protocol import run_service as rs

log = logging.getLogger(__name__)
TOKEN_ENV = "TANDEM_GRPC_TOKEN"


WRITER_KEY = "x-tandem-writer"  # metadata: one random id per writer, its claim on a worker id


# One chunk (buffer.grpc_chunk_kb <= 4 MiB) plus protobuf framing; shards themselves are bounded
# by buffer.grpc_max_shard_mb, checked against the header before any byte is written.
MAX_MESSAGE_BYTES = (4 << 20) + (64 << 10)


RECONNECT_MAX_MS = 2000


def token(cfg: BufferConfig) -> str:
    """The shared secret: `buffer.grpc_token_file`, else $TANDEM_GRPC_TOKEN; required."""
    if cfg.grpc_token_file:
        with open(cfg.grpc_token_file) as f:
            value = f.read().strip()
    else:
        value = os.environ.get(TOKEN_ENV, "")
    if not value:
        raise ValueError(f"buffer.transport=grpc needs a shared token: set buffer.grpc_token_file or ${TOKEN_ENV}")
    return value


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def authorized(context, expected: bytes) -> bool:
    """Whether a call carries `expected` (b"Bearer <token>") as its authorization, compared
    in constant time."""
    given = dict(context.invocation_metadata()).get("authorization", "")
    return hmac.compare_digest(given.encode(), expected)


def open_channel(cfg: BufferConfig, address: str, options: list | None = None) -> grpc.Channel:
    """A channel to `address` (the trainer's buffer.grpc_address, or a peer's), TLS-verified
    against buffer.grpc_tls_ca when it is set. It reconnects by itself, at most RECONNECT_MAX_MS
    apart: a restarted trainer is found again within seconds (gRPC's default backoff grows to
    two minutes)."""
    options = [
        *(options or []),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
    ]
    if cfg.grpc_tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=_read(cfg.grpc_tls_ca))
        return grpc.secure_channel(address, creds, options)
    return grpc.insecure_channel(address, options)


def server_credentials(cfg: BufferConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of a server from buffer.grpc_tls_cert/key, None without TLS."""
    if not cfg.grpc_tls_cert:
        return None
    return grpc.ssl_server_credentials([(_read(cfg.grpc_tls_key), _read(cfg.grpc_tls_cert))])


def bind_hosts(bind: str) -> list[str]:
    """Hosts to listen on for `buffer.grpc_bind`: its host, or for ':PORT' this node's address
    (what its hostname resolves to, how other nodes reach it) and loopback."""
    host = bind.rpartition(":")[0]
    if host:
        return [host]
    try:
        node = socket.gethostbyname(socket.gethostname())
    except OSError:
        log.warning("cannot resolve this node's hostname %s: listening on loopback only", socket.gethostname())
        return ["127.0.0.1"]
    return list(dict.fromkeys([node, "127.0.0.1"]))


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


RETRIED = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
)


NOTE_S = 30.0  # a waiting call says so at least this often


MAX_BACKOFF_S = 5.0


DISK_FULL = "disk full"  # how the service words RESOURCE_EXHAUSTED for a full disk: not retried


class RunServiceError(RuntimeError):
    """The trainer's run service refused a call; retrying the same call cannot help."""


class Interrupted(Exception):
    """A call waiting for an unreachable trainer gave up because the process is stopping."""


class RunClient:
    """One channel to the run service at buffer.grpc_address; `call` with a deadline and
    retries. Every call carries the token, the schema and this process's writer key (its claim
    on the worker id whose heartbeat it writes)."""

    def __init__(self, cfg: BufferConfig):
        self.cfg = cfg
        self.address = cfg.grpc_address
        self.channel = open_channel(cfg, cfg.grpc_address, [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        self.metadata = (
            ("authorization", f"Bearer {token(cfg)}"),
            (rs.SCHEMA_KEY, str(rs.SCHEMA)),
            (WRITER_KEY, uuid.uuid4().hex),
        )
        self._stubs: dict[str, Callable] = {}
        self._interrupted = False  # a plain flag: set from a signal handler (no lock taken)

    def interrupt(self) -> None:
        """A signal came: calls waiting for an unreachable trainer raise Interrupted at once
        (now and from now on) instead of retrying for buffer.grpc_trainer_wait_s. Safe in a
        signal handler (it only sets a flag)."""
        self._interrupted = True

    def _stub(self, name: str):
        if name not in self._stubs:
            self._stubs[name] = self.channel.unary_unary(
                rs.method(name),
                request_serializer=rs.encode,
                response_deserializer=functools.partial(rs.decode, rs.RPCS[name].reply),
            )
        return self._stubs[name]

    def call(self, name: str, request=None):
        """The reply to one unary call, retried while the trainer is unreachable or busy."""
        request = rs.RPCS[name].request() if request is None else request
        stub = self._stub(name)
        return self._retrying(name, lambda: stub(request, timeout=self.cfg.grpc_call_timeout_s, metadata=self.metadata))

    def _retrying(self, what: str, attempt: Callable[[], object]):
        """`attempt()`, again after each retryable failure (backoff, a line every NOTE_S s),
        for at most buffer.grpc_trainer_wait_s."""
        start = noted = None
        backoff = 0.2
        while True:
            try:
                out = attempt()
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
                if code not in RETRIED or details.startswith(DISK_FULL):
                    raise self._error(what, code, details) from None
                if self._interrupted:
                    raise Interrupted(
                        f"stopping: the trainer's run service at {self.address} did not answer {what} "
                        f"({code.name}: {details}) and a signal asked this process to stop"
                    ) from None
                now = time.monotonic()
                start = now if start is None else start
                waited = now - start
                if waited > self.cfg.grpc_trainer_wait_s:
                    raise TimeoutError(
                        f"the trainer's run service at {self.address} did not answer {what} for "
                        f"{waited:.0f} s ({code.name}: {details}; buffer.grpc_trainer_wait_s): "
                        "is the trainer running?"
                    ) from None
                if noted is None or now - noted >= NOTE_S:
                    log.warning(
                        "waiting for the trainer's run service at %s (%s: %s: %s): "
                        "%.0f s of %.0f (buffer.grpc_trainer_wait_s)",
                        self.address,
                        what,
                        code.name,
                        details,
                        waited,
                        self.cfg.grpc_trainer_wait_s,
                    )
                    noted = now
                until = time.monotonic() + backoff
                while not self._interrupted and time.monotonic() < until:  # a signal ends the wait
                    time.sleep(0.05)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            if noted is not None:
                log.info(
                    "the trainer's run service at %s answers again (%s, after %.0f s)",
                    self.address,
                    what,
                    time.monotonic() - start,
                )
            return out

    def _error(self, what: str, code, details: str) -> Exception:
        text = f"the trainer's run service at {self.address} refused {what}: {code.name}: {details}"
        if code == grpc.StatusCode.NOT_FOUND:
            return FileNotFoundError(text)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # DISK_FULL: callers skip or wait
            return OSError(errno.ENOSPC, text)
        if code == grpc.StatusCode.UNIMPLEMENTED:
            text += " (a trainer older than this worker: upgrade it, or use buffer.transport=fs)"
        return RunServiceError(text)
