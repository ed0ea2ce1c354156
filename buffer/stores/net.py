"""Network implementations of the worker/validator/pool-side stores (`buffer.transport=grpc`).

Each method is one call to the trainer's run service (protocol/run_service.py, served by
buffer/run_service.py on the trainer's rank 0, beside the experience stream: same address,
token, TLS). The process's own `root` is a local folder that holds only what is its own: the
weight cache (ROOT/weights/v<N>/), its shard-number claim (workers/<id>.claim) and its logs;
nothing of the trainer's run folder is read or written by path.

Every call has a deadline (buffer.grpc_call_timeout_s). While the trainer cannot be reached
(not started yet, restarting: UNAVAILABLE), or is busy (DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED,
ABORTED), a call is retried with backoff (0.2 s doubling to 5 s), saying every 30 s what it waits
for, for at most buffer.grpc_trainer_wait_s; then TimeoutError. A refusal that retrying cannot
change (a bad token, a malformed request) raises RunServiceError at once; NOT_FOUND (a weight
version pruned) raises FileNotFoundError, as the filesystem stores do.

Weights: `NetWeightSource.fetch(version)` hands the version to buffer/weights_net.py's
WeightFetcher (chunks checked against the trainer's chunk list, from the trainer or from other
workers, resumable; every file against the manifest; renamed into ROOT/weights/v<N>/ whole).
The newest buffer.grpc_cache_versions versions are kept, and at most one partial fetch (`_prune`).
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import os
import shutil
import threading
import time
import uuid
from typing import Callable

import grpc

from buffer.config import BufferConfig
from buffer.grpc_transport import (MAX_MESSAGE_BYTES, WRITER_KEY, GrpcSink, ShardServer,
                                   open_channel, token)
from buffer.layout import RunLayout
from buffer.run import Run, register
from buffer.run_service import RunService
from buffer.storage import is_local
from buffer.stores.base import (ControlStore, HeartbeatStore, ProgressStore, RunState, SyncClaims,
                                ValidationStore, WeightSource)
from buffer.stores.fs_run import FsRun
from buffer.weights_net import PARTIAL, WeightFetcher, add_weight_service, discard_partial
from protocol import run_service as rs
from protocol.control import Command
from protocol.validation import ValidationRequest, ValidationResult

log = logging.getLogger(__name__)

RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED)
NOTE_S = 30.0  # a waiting call says so at least this often
MAX_BACKOFF_S = 5.0
DISK_FULL = "disk full"  # how the service words RESOURCE_EXHAUSTED for a full disk: not retried


class RunServiceError(RuntimeError):
    """The trainer's run service refused a call; retrying the same call cannot help."""


def _trainer_only(what: str):
    raise RuntimeError(f"{what} is the trainer's: a process with buffer.transport=grpc only "
                       "reads it through the run service")


class RunClient:
    """One channel to the run service at buffer.grpc_address; `call` with a deadline and
    retries. Every call carries the token, the schema and this process's writer key (its claim
    on the worker id whose heartbeat it writes)."""

    def __init__(self, cfg: BufferConfig):
        self.cfg = cfg
        self.address = cfg.grpc_address
        self.channel = open_channel(cfg, cfg.grpc_address,
                                    [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        self.metadata = (("authorization", f"Bearer {token(cfg)}"),
                         (rs.SCHEMA_KEY, str(rs.SCHEMA)), (WRITER_KEY, uuid.uuid4().hex))
        self._stubs: dict[str, Callable] = {}

    def _stub(self, name: str):
        if name not in self._stubs:
            self._stubs[name] = self.channel.unary_unary(
                rs.method(name), request_serializer=rs.encode,
                response_deserializer=functools.partial(rs.decode, rs.RPCS[name].reply))
        return self._stubs[name]

    def call(self, name: str, request=None):
        """The reply to one unary call, retried while the trainer is unreachable or busy."""
        request = rs.RPCS[name].request() if request is None else request
        stub = self._stub(name)
        return self._retrying(name, lambda: stub(request, timeout=self.cfg.grpc_call_timeout_s,
                                                metadata=self.metadata))

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
                now = time.monotonic()
                start = now if start is None else start
                waited = now - start
                if waited > self.cfg.grpc_trainer_wait_s:
                    raise TimeoutError(
                        f"the trainer's run service at {self.address} did not answer {what} for "
                        f"{waited:.0f} s ({code.name}: {details}; buffer.grpc_trainer_wait_s): "
                        "is the trainer running?") from None
                if noted is None or now - noted >= NOTE_S:
                    log.warning("waiting for the trainer's run service at %s (%s: %s: %s): "
                                "%.0f s of %.0f (buffer.grpc_trainer_wait_s)", self.address, what,
                                code.name, details, waited, self.cfg.grpc_trainer_wait_s)
                    noted = now
                time.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            if noted is not None:
                log.info("the trainer's run service at %s answers again (%s, after %.0f s)",
                         self.address, what, time.monotonic() - start)
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


class NetHeartbeats(HeartbeatStore):
    def __init__(self, client: RunClient):
        self.client = client

    def write(self, worker_id: str, beat: dict) -> None:
        self.client.call("WriteHeartbeat", rs.HeartbeatWrite(worker_id, beat))

    def read(self, worker_id: str) -> dict | None:
        return self.client.call("ReadHeartbeat", rs.WorkerRef(worker_id)).doc

    def all(self) -> list[dict]:
        return self.client.call("Heartbeats").docs

    def where(self, worker_id: str | None = None) -> str:
        return f"heartbeat{' of ' + worker_id if worker_id else 's'} at {self.client.address}"


class NetProgress(ProgressStore):
    def __init__(self, client: RunClient):
        self.client = client

    def write(self, progress: dict) -> None:
        _trainer_only("progress.json")

    def read(self) -> dict | None:
        return self.client.call("Progress").doc

    def where(self) -> str:
        return f"the trainer's progress at {self.client.address}"


class NetRunState(RunState):
    """The run id and DONE; both are kept once known (neither changes again), so a worker
    that learned the run ended needs no trainer to stop."""

    def __init__(self, client: RunClient):
        self.client = client
        self._run_id: str | None = None
        self._done = False

    def _ask(self) -> None:
        reply = self.client.call("RunState")
        self._run_id = self._run_id or reply.run_id
        self._done = self._done or reply.done

    def run_id(self) -> str | None:
        if self._run_id is None:
            self._ask()
        return self._run_id

    def done(self) -> bool:
        if not self._done:
            self._ask()
        return self._done

    def mark_done(self, info: dict) -> None:
        _trainer_only("the end of the run (DONE)")

    def where(self) -> str:
        return f"the run state at {self.client.address}"


class NetSyncClaims(SyncClaims):
    def __init__(self, client: RunClient):
        self.client = client

    def claim(self, version: int, groups: int, want: int, worker_id: str) -> int:
        # one request id for all retries: a claim whose reply was lost is not made twice
        return self.client.call("SyncClaim", rs.ClaimRequest(version, groups, want, worker_id,
                                                             rs.new_request_id())).n

    def share(self, groups: int, per_batch: int) -> int:
        return self.client.call("SyncShare", rs.ShareRequest(groups, per_batch)).n

    def claims(self, version: int) -> dict[int, str]:
        return {int(k): v for k, v in self.client.call("SyncClaims", rs.VersionRef(version)).claims.items()}

    def open_version(self, version: int) -> None:
        _trainer_only("opening a version for claims")

    def retire_before(self, version: int) -> int:
        _trainer_only("retiring claims")


class NetControl(ControlStore):
    def __init__(self, client: RunClient):
        self.client = client

    def commands(self) -> tuple[list[Command], list[str]]:
        reply = self.client.call("ControlCommands")
        return [Command(**c) for c in reply.commands], list(reply.errors)

    def submit(self, action: str, count: int) -> tuple[Command, str]:
        reply = self.client.call("AddCommand", rs.NewCommand(action, count, rs.new_request_id()))
        return Command(reply.id, reply.action, reply.count), f"{reply.where} at {self.client.address}"

    def pool_state(self, supervisor_id: str) -> dict | None:
        return self.client.call("ReadPoolState", rs.WorkerRef(supervisor_id)).doc

    def save_pool_state(self, supervisor_id: str, state: dict) -> None:
        self.client.call("WritePoolState", rs.PoolStateWrite(supervisor_id, state))

    def pool_states(self) -> dict[str, dict]:
        return self.client.call("PoolStates").doc or {}

    def where(self) -> str:
        return f"pool commands at {self.client.address}"


class NetValidation(ValidationStore):
    def __init__(self, client: RunClient):
        self.client = client

    def request(self, version: int, step: int) -> None:
        _trainer_only("requesting validation")

    def result(self, version: int) -> ValidationResult | None:
        _trainer_only("reading validation results")

    def held(self) -> list[int]:
        return [r.version for r in self.requests()]

    def requests(self) -> list[ValidationRequest]:
        return [ValidationRequest.from_json(json.dumps(d), where=f"a request from {self.client.address}")
                for d in self.client.call("ValidationRequests").docs]

    def answer(self, result: ValidationResult) -> None:
        self.client.call("ValidationAnswer", rs.ValidationAnswer(dataclasses.asdict(result),
                                                                 rs.new_request_id()))

    def write_beat(self, beat: dict) -> None:
        self.client.call("WriteValidatorBeat", rs.HeartbeatWrite("", beat))

    def beat(self) -> dict | None:
        return self.client.call("ValidatorBeat").doc

    def where(self) -> str:
        return f"validation requests at {self.client.address}"


class NetWeightSource(WeightSource):
    """LATEST from the run service; versions fetched into `local`'s weights/ by the weight
    service's fetcher (buffer/weights_net.py: chunked, verified, resumable, from peers too),
    made on the first fetch (its peer server is of no use to a process that never fetches)."""

    def __init__(self, client: RunClient, local: FsRun, keep: int):
        self.client, self.local, self.keep = client, local, keep
        self.layout: RunLayout = local.files
        self._fetcher = None
        self._verified: set[int] = set()  # cache folders this process fetched or checked
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
        if version in self._verified or (bg is not None and (bg[0] == version or bg[1].is_alive())):
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
        return version in self._verified or (bg is not None and bg[0] == version
                                              and not bg[1].is_alive())

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

    def _fetch(self, version: int) -> str:
        folder = self.layout.version_dir(version)
        if version in self._verified and os.path.isdir(folder):
            return folder
        if self._fetcher is None:
            self._fetcher = WeightFetcher(self.client.address, token(self.client.cfg), self.client.cfg)
        t0 = time.monotonic()
        self._fetcher.fetch(version, folder)  # a folder already there is checked, else fetched
        self._verified.add(version)
        log.info("weight version %d in %s (%.2f s)", version, folder, time.monotonic() - t0)
        self._prune()
        return folder

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
        for version in complete[:-self.keep]:
            shutil.rmtree(self.layout.version_dir(version), ignore_errors=True)
            self._verified.discard(version)
        for version in partials - {None, resumable}:
            discard_partial(self.layout.version_dir(version))


def open_net_run(root: str, buffer: BufferConfig) -> Run:
    """The Run of a worker, validator or pool with only its own folder `root` (local)."""
    local = FsRun.at(root, buffer)
    if not is_local(local.fs):
        raise ValueError(f"root={root}: with buffer.transport=grpc the root is this process's "
                         "own local folder (weight cache, claim file, logs), not a URL")
    os.makedirs(local.files.weights_dir, exist_ok=True)
    client = RunClient(buffer)
    state = NetRunState(client)

    def make_sink(worker_id: str) -> GrpcSink:  # shards pushed; the claim file in `root`
        return GrpcSink(local.make_sink(worker_id), buffer, state)
    return Run(root=root, transport="grpc",
               weights=NetWeightSource(client, local, buffer.grpc_cache_versions),
               heartbeats=NetHeartbeats(client), progress=NetProgress(client), state=state,
               sync=NetSyncClaims(client), control=NetControl(client),
               validation=NetValidation(client),
               make_sink=make_sink)


class RunServer:
    """The trainer's rank 0 with buffer.transport=grpc: one grpc.Server (buffer.grpc_bind, the
    token, TLS) with the experience stream (ShardServer), the run service on `run` and the
    weight service of its published versions. `hooks`: see FsRun.serve. `stop()` first
    lingers after the run's end (buffer.grpc_linger_s), so that workers learn of it."""

    def __init__(self, run: FsRun, buffer: BufferConfig, **hooks):
        secret = token(buffer)
        self.run_service = RunService(run, buffer, secret)
        self.weights = None

        def add_weights(server) -> None:
            self.weights = add_weight_service(server, self.run_service.version_dir, secret, buffer)
        self.shards = ShardServer(run.root, buffer, **hooks, services=[
            lambda server: server.add_generic_rpc_handlers([self.run_service.handler()]),
            add_weights])
        self.server, self.port, self.linger_s = self.shards.server, self.shards.port, buffer.grpc_linger_s
        self.servicer = self.shards.servicer  # the experience stream's (its stats)
        log.info("run service and weight service on port %d beside the experience stream", self.port)

    def stop(self, grace_s: float = 5.0) -> None:
        try:
            self.run_service.linger(self.linger_s)
        finally:
            self.shards.stop(grace_s)


register("grpc", open_net_run, server=RunServer)
