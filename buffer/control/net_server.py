"""The run service's server side: the trainer's rank 0 answers workers, validators and pools
that have no access to its run folder (`buffer.transport=grpc`; messages in
protocol/run_service.py, clients in buffer/control/net_client.py).

It runs on the experience ShardServer's grpc.Server (buffer/experience/net_server.py: same port,
token, TLS) and executes each call on the trainer's run folder stores (buffer/control/fs.py). Only the
operations of protocol.run_service.RPCS exist: a remote role reads the run's state, writes its own
heartbeat (the worker id's first writer holds it for buffer.grpc_claim_ttl_s after its last
write, as for shard pushes), claims sync slots, answers validation requests, reads and writes
pool state; it never names a path. Weight files are the weight service's (buffer/weights/net_server.py,
on the same server), which serves only the files of published versions. Calls that change the
run carry a request id and are done once per id.

After the trainer's last step (DONE) the server lingers, at most buffer.grpc_linger_s, until every
worker's and the validator's heartbeat says stopped: a worker learns that the run ended from the
service, not from a file it could see after the trainer is gone.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import threading
import time
from typing import Protocol

import grpc

from buffer.channel import WRITER_KEY, ServicePool, authorized, in_pool
from buffer.config import BufferConfig
from buffer.control.base import ControlStore, ProgressStore, RunState, SyncClaims, ValidationStore
from buffer.control.fs import FsHeartbeats
from buffer.layout import RunLayout, check_worker_id
from buffer.reward.fs import FsRewardEndpoints
from buffer.storage import is_disk_full
from buffer.weights.base import WeightSource
from protocol import run_service as rs
from protocol.reward import RewardEndpoint
from protocol.validation import ValidationResult
from protocol.weights import SYNC_GROUPS

log = logging.getLogger(__name__)
ANSWERS_KEPT = 4096  # replies of state-changing calls kept for retries of the same request id
STALE_BEAT_S = 120.0  # lingering ignores a heartbeat older than this (a worker killed outright)
NOTE_S = 10.0
MAX_REWARD_SERVERS = 1024  # reward endpoints the service keeps (live or stale) in the folder


class _Refuse(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


def _doc(value, what: str, limit: int = rs.MAX_DOC_BYTES) -> dict:
    """A JSON document a remote role may store: a dict, at most `limit` bytes as JSON."""
    try:
        size = len(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: not JSON ({e})") from None
    if size > limit:
        raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {size} bytes of JSON, over {limit}")
    return value


class ServedRun(Protocol):
    """What the run service serves: the stores of the trainer's run folder (buffer.run.TrainerRun)
    as the roles beside the trainer see them."""

    @property
    def files(self) -> RunLayout: ...
    @property
    def heartbeats(self) -> FsHeartbeats: ...  # the trainer's: it also drops expired ids' files
    @property
    def progress(self) -> ProgressStore: ...
    @property
    def state(self) -> RunState: ...
    @property
    def weights(self) -> WeightSource: ...
    @property
    def sync(self) -> SyncClaims: ...
    @property
    def control(self) -> ControlStore: ...
    @property
    def validation(self) -> ValidationStore: ...
    @property
    def reward(self) -> FsRewardEndpoints: ...


class RunService:
    """Serves `run` (the trainer's run folder) to remote roles; `handler()` goes on the
    grpc.Server, `linger()` before the server stops."""

    def __init__(self, run: ServedRun, cfg: BufferConfig, secret: str):
        self.run, self.cfg = run, cfg
        self.expected = f"Bearer {secret}".encode()
        self.lock = threading.Lock()
        self.writers: dict[str, tuple[str, float]] = {}  # worker id -> (writer key, last write)
        self.seen: dict[str, float] = {}  # worker id -> last heartbeat (<= grpc_max_worker_ids)
        self.seeded = False  # ids of the heartbeats on disk at start are counted from the first beat
        self.pool = ServicePool(cfg.grpc_max_workers, "grpc-run")
        self.answers: collections.OrderedDict[str, object] = collections.OrderedDict()
        self.running: dict[str, threading.Lock] = {}  # request id -> held while it executes
        self.stats: collections.Counter[str] = collections.Counter()

    # --- plumbing ----------------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        methods = {}
        for name, rpc in rs.RPCS.items():
            decode = (lambda cls: lambda raw: _decoded(cls, raw))(rpc.request)
            methods[name] = grpc.unary_unary_rpc_method_handler(
                in_pool(self._unary(name), self.pool), request_deserializer=decode, response_serializer=rs.encode
            )
        return grpc.method_handlers_generic_handler(rs.SERVICE, methods)

    def _check(self, request, context) -> None:
        if not authorized(context, self.expected):
            self.stats["refused"] += 1
            raise _Refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
        schema = dict(context.invocation_metadata()).get(rs.SCHEMA_KEY)
        if schema != str(rs.SCHEMA):
            raise _Refuse(
                grpc.StatusCode.FAILED_PRECONDITION, f"run-service schema {schema!r}, the trainer serves {rs.SCHEMA}"
            )
        if isinstance(request, rs.MessageError):
            raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, str(request))

    def _unary(self, name: str):
        do, mutates = getattr(self, f"_do_{name}"), rs.RPCS[name].mutates

        def handle(request, context):
            try:
                self._check(request, context)
                reply = (
                    self._once(request.request_id, lambda: do(request, context))
                    if mutates and request.request_id
                    else do(request, context)
                )
                self.stats[name] += 1
                return reply
            except Exception as e:  # noqa: BLE001 - every failure becomes a status code
                self._abort(name, e, context)

        return handle

    def _abort(self, name: str, e: Exception, context) -> None:
        if isinstance(e, _Refuse):
            code, details = e.code, e.details
        elif isinstance(e, FileNotFoundError):
            code, details = grpc.StatusCode.NOT_FOUND, str(e)
        elif is_disk_full(e):
            code, details = grpc.StatusCode.RESOURCE_EXHAUSTED, f"disk full on the trainer: {e}"
        elif isinstance(e, ValueError):  # a bad worker id, command, document
            code, details = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        else:
            log.exception("run service: %s failed", name)
            code, details = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
        self.stats[f"{name}:{code.name}"] += 1
        context.abort(code, details)

    def _once(self, request_id: str, do):
        """`do()` once per request id: a retry gets the first call's reply (and waits for it
        while the first still runs)."""
        with self.lock:
            if request_id in self.answers:
                return self.answers[request_id]
            gate = self.running.setdefault(request_id, threading.Lock())
        with gate:
            with self.lock:
                if request_id in self.answers:
                    return self.answers[request_id]
            reply = do()
            with self.lock:
                self.answers[request_id] = reply
                while len(self.answers) > ANSWERS_KEPT:
                    self.answers.popitem(last=False)
                self.running.pop(request_id, None)
            return reply

    def _claim_writer(self, worker_id: str, context) -> None:
        """A worker id's heartbeat belongs to the process (writer key) that wrote it last, until
        buffer.grpc_claim_ttl_s after that write (ABORTED: a restarted worker retries and takes
        it over then)."""
        writer = dict(context.invocation_metadata()).get(WRITER_KEY, "")
        now = time.monotonic()
        with self.lock:
            held = self.writers.get(worker_id)
            if held is not None and held[0] != writer and now - held[1] < self.cfg.grpc_claim_ttl_s:
                raise _Refuse(
                    grpc.StatusCode.ABORTED,
                    f"worker id {worker_id} is in use by another process (its last "
                    f"heartbeat {now - held[1]:.0f} s ago): give every worker its own "
                    "worker.id (a restarted worker takes it over after "
                    "buffer.grpc_claim_ttl_s)",
                )
            self.writers[worker_id] = (writer, now)

    # --- the operations (protocol.run_service.RPCS) ------------------------------------------
    def _do_RunState(self, request, context) -> rs.RunStateReply:
        return rs.RunStateReply(run_id=self.run.state.run_id(), done=self.run.state.done())

    def _do_WriteHeartbeat(self, request, context) -> rs.Empty:
        worker_id = check_worker_id(request.worker_id)
        beat = _doc(request.beat, f"heartbeat of {worker_id}", rs.MAX_BEAT_BYTES)
        if beat.get("worker_id", worker_id) != worker_id:
            raise _Refuse(
                grpc.StatusCode.PERMISSION_DENIED, f"a heartbeat of {beat.get('worker_id')!r} sent as {worker_id}'s"
            )
        self._count_id(worker_id)  # first: a refused id leaves nothing behind
        self._claim_writer(worker_id, context)
        self.run.heartbeats.write(worker_id, beat)
        return rs.Empty()

    def _count_id(self, worker_id: str) -> None:
        """At most grpc_max_worker_ids distinct ids keep a heartbeat (ids a client invents must
        not fill the disk, nor the Heartbeats reply): a new id past it takes the place of the
        one silent longest, if that one is silent for grpc_worker_id_ttl_s (its file goes),
        else it is refused (RESOURCE_EXHAUSTED: an honest worker retries)."""
        now, cap = time.monotonic(), self.cfg.grpc_max_worker_ids
        with self.lock:
            if not self.seeded:  # a restarted trainer counts the files its last run left
                self.seeded = True
                for beat in self.run.heartbeats.all():
                    self.seen.setdefault(str(beat.get("worker_id")), now)
            if worker_id not in self.seen and len(self.seen) >= cap:
                oldest = min(self.seen, key=self.seen.__getitem__)
                if now - self.seen[oldest] < self.cfg.grpc_worker_id_ttl_s:
                    self.stats["worker_ids_refused"] += 1
                    raise _Refuse(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{cap} worker ids hold a heartbeat already (buffer.grpc_max_worker_ids), none "
                        "silent for buffer.grpc_worker_id_ttl_s: retry later",
                    )
                del self.seen[oldest]
                self.writers.pop(oldest, None)
                self.stats["worker_ids_expired"] += 1
                with contextlib.suppress(ValueError, OSError):
                    self.run.heartbeats.remove(oldest)
            self.seen[worker_id] = now

    def _do_ReadHeartbeat(self, request, context) -> rs.DocReply:
        return rs.DocReply(self.run.heartbeats.read(check_worker_id(request.worker_id)))

    def _do_Heartbeats(self, request, context) -> rs.DocsReply:
        """Every heartbeat, or when they would not fit rs.MAX_REPLY_BYTES the smallest first
        (an honest worker's is a few KiB: large invented ones drop out first, not it)."""
        beats = self.run.heartbeats.all()
        sizes = [len(json.dumps(b)) for b in beats]
        if sum(sizes) <= rs.MAX_REPLY_BYTES:
            return rs.DocsReply(beats)
        kept, total = [], 0
        for size, beat in sorted(zip(sizes, beats, strict=True), key=lambda x: x[0]):
            if total + size > rs.MAX_REPLY_BYTES:
                break
            kept.append(beat)
            total += size
        left = len(beats) - len(kept)
        self.stats["heartbeats_left_out"] += left
        log.warning("Heartbeats reply: %d of %d left out (over %d bytes)", left, len(beats), rs.MAX_REPLY_BYTES)
        return rs.DocsReply(sorted(kept, key=lambda b: str(b.get("worker_id"))))

    def _do_Progress(self, request, context) -> rs.DocReply:
        return rs.DocReply(self.run.progress.read())

    def _do_WeightsPointer(self, request, context) -> rs.DocReply:
        return rs.DocReply(self.run.weights.pointer())

    def _do_VersionExists(self, request, context) -> rs.Flag:
        return rs.Flag(self.run.weights.exists(request.version))

    def _do_RequestSnapshot(self, request, context) -> rs.Empty:
        self.run.weights.request_snapshot(request.version)
        return rs.Empty()

    def version_dir(self, version: int) -> str | None:
        """The published folder of `version`, None when it is not (or no longer) published:
        what the weight service (buffer/weights/net_server.py) serves chunks from."""
        return self.run.files.version_dir(version) if self.run.weights.exists(version) else None

    def _do_SyncClaim(self, request, context) -> rs.Count:
        """A claim of at most grpc_max_claim_groups slots, and never of slots past what the
        trainer announced for the version (its LATEST pointer's sync_groups)."""
        worker_id = check_worker_id(request.worker_id)
        if min(request.version, request.groups, request.want) < 0:
            raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, "version, groups and want must be >= 0")
        cap = self.cfg.grpc_max_claim_groups
        if max(request.groups, request.want) > cap:
            self.stats["claims_over_cap"] += 1
            raise _Refuse(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a claim of groups={request.groups}, want={request.want}: over buffer.grpc_max_claim_groups={cap}",
            )
        groups = request.groups
        pointer = self.run.weights.pointer() or {}
        if pointer.get("version") == request.version and SYNC_GROUPS in pointer:
            groups = min(groups, int(pointer[SYNC_GROUPS]))
        return rs.Count(self.run.sync.claim(request.version, groups, request.want, worker_id))

    def _do_SyncShare(self, request, context) -> rs.Count:
        return rs.Count(self.run.sync.share(max(0, request.groups), max(1, request.per_batch)))

    def _do_SyncClaims(self, request, context) -> rs.ClaimsReply:
        return rs.ClaimsReply(self.run.sync.claims(request.version))

    def _do_ValidationRequests(self, request, context) -> rs.DocsReply:
        return rs.DocsReply([dataclasses.asdict(r) for r in self.run.validation.requests()])

    def _do_ValidationAnswer(self, request, context) -> rs.Empty:
        doc = _doc(request.result, "validation result")
        result = ValidationResult.from_json(json.dumps(doc), where="a validation result sent")
        if result.version not in self.run.validation.held():
            return rs.Empty()  # answered already (or never asked): nothing to release
        self.run.validation.answer(result)
        return rs.Empty()

    def _do_WriteValidatorBeat(self, request, context) -> rs.Empty:
        self.run.validation.write_beat(_doc(request.beat, "validator heartbeat"))
        return rs.Empty()

    def _do_ValidatorBeat(self, request, context) -> rs.DocReply:
        return rs.DocReply(self.run.validation.beat())

    def _do_ControlCommands(self, request, context) -> rs.CommandsReply:
        cmds, errors = self.run.control.commands()
        return rs.CommandsReply([dataclasses.asdict(c) for c in cmds], errors)

    def _do_AddCommand(self, request, context) -> rs.CommandReply:
        cmd, where = self.run.control.submit(request.action, request.count, request.role)
        return rs.CommandReply(cmd.id, cmd.action, cmd.count, where, cmd.role)

    def _do_ReadPoolState(self, request, context) -> rs.DocReply:
        return rs.DocReply(self.run.control.pool_state(check_worker_id(request.worker_id)))

    def _do_WritePoolState(self, request, context) -> rs.Empty:
        sid = check_worker_id(request.supervisor_id)
        self.run.control.save_pool_state(sid, _doc(request.state, f"pool state of {sid}"))
        return rs.Empty()

    def _do_PoolStates(self, request, context) -> rs.DocReply:
        return rs.DocReply(self.run.control.pool_states())

    def _do_AnnounceReward(self, request, context) -> rs.Empty:
        """A reward server's endpoint, in the trainer's folder (reward/<id>.json); at most
        MAX_REWARD_SERVERS ids (a client must not fill the disk with invented ones)."""
        doc = _doc(request.endpoint, "reward endpoint", rs.MAX_BEAT_BYTES)
        try:
            endpoint = RewardEndpoint.from_json(json.dumps(doc), where="a reward endpoint sent")
        except ValueError as e:
            raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        check_worker_id(endpoint.server_id)
        known = {e.server_id for e in self.run.reward.all()}
        if endpoint.server_id not in known and len(known) >= MAX_REWARD_SERVERS:
            raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"{MAX_REWARD_SERVERS} reward servers announced already")
        self.run.reward.announce(endpoint)
        return rs.Empty()

    def _do_WithdrawReward(self, request, context) -> rs.Empty:
        self.run.reward.withdraw(check_worker_id(request.worker_id))
        return rs.Empty()

    def _do_RewardEndpoints(self, request, context) -> rs.DocsReply:
        return rs.DocsReply([dataclasses.asdict(e) for e in self.run.reward.live()])

    # --- the end of the run ------------------------------------------------------------------
    def linger(self, timeout_s: float) -> None:
        """After DONE: wait (at most `timeout_s`) until every heartbeat newer than STALE_BEAT_S
        says stopped, so that remote roles can still ask whether the run ended."""
        if timeout_s <= 0 or not self.run.state.done():
            return
        deadline, noted = time.monotonic() + timeout_s, -NOTE_S
        while time.monotonic() < deadline:
            now = time.time()
            beats = [*self.run.heartbeats.all(), self.run.validation.beat() or {}]
            live = [
                b.get("worker_id", "validator")
                for b in beats
                if b and b.get("state") != "stopped" and now - b.get("last_beat", 0) < STALE_BEAT_S
            ]
            if not live:
                return
            if time.monotonic() - noted >= NOTE_S:
                log.info(
                    "run done: serving until %s stop (at most %.0f s more, buffer.grpc_linger_s)",
                    ", ".join(live),
                    deadline - time.monotonic(),
                )
                noted = time.monotonic()
            time.sleep(0.2)
        log.warning(
            "run done: stopped serving after buffer.grpc_linger_s=%.0f s with workers "
            "still running; they stop once they find the trainer gone for "
            "buffer.grpc_trainer_wait_s",
            timeout_s,
        )


def _decoded(cls, raw: bytes):
    """The request, or the MessageError saying why it is not one (refused with INVALID_ARGUMENT
    by the handler instead of failing inside gRPC's deserializer)."""
    try:
        return rs.decode(cls, raw)
    except rs.MessageError as e:
        return e
