"""The run service: what a worker, validator or pool supervisor without the trainer's run folder
asks the trainer over gRPC (`buffer.transport=grpc`).

Served by the trainer's rank 0 on the same gRPC server, port, token and TLS as the experience
stream (protocol/experience.proto), under the service name SERVICE. Each RPC is one method
`/<SERVICE>/<name>` of the table RPCS: a request and a reply dataclass, each encoded as one
msgpack map of its fields (`encode` / `decode`; no protoc step). A receiver ignores fields it
does not know and fills missing ones with their defaults, so either side may add a field with a
default; anything else (a renamed field, a changed meaning) is a new method name.

Every RPC is a whitelisted, unary operation on one store of the trainer's run
(buffer/control/base.py); nothing names a path. Weight files travel on the weight service beside
it (protocol/weights_wire.py). Status codes: UNAUTHENTICATED (token), INVALID_ARGUMENT (a message
that does not decode, a bad worker id or document), PERMISSION_DENIED (a heartbeat sent under
another worker's id), ABORTED (the worker id's heartbeat is another process's, for now),
RESOURCE_EXHAUSTED "disk full ..." (the trainer's disk); UNAVAILABLE while the trainer is not
serving (the client waits and retries).

`request_id` makes a call that changes state idempotent: the server answers a repeated id (a
retry after a lost reply) with the first call's reply instead of doing it again (a second
SyncClaim would claim slots the worker never fills).
"""

from __future__ import annotations

import dataclasses
import types
import typing
import uuid

import msgpack

SERVICE = "tandem.run.v1.Run"
SCHEMA = 1  # also in `x-tandem-run-schema` metadata: a server refuses another (FAILED_PRECONDITION)
SCHEMA_KEY = "x-tandem-run-schema"
MAX_DOC_BYTES = 1 << 20  # a pool state or validation result larger than this is refused
MAX_BEAT_BYTES = 32 << 10  # a heartbeat larger than this is refused (a worker's stays under 20 KiB:
# rollout/worker.py bounds its history and loads to HISTORY_ROWS rows)
MAX_REPLY_BYTES = 4 << 20  # the Heartbeats reply keeps under this (a client's receive limit: 4 MiB + framing)


class MessageError(ValueError):
    """A message that does not decode into its dataclass; the text says which field."""


def new_request_id() -> str:
    return uuid.uuid4().hex


# --- messages ------------------------------------------------------------------------------
@dataclasses.dataclass
class Empty:
    pass


@dataclasses.dataclass
class RunStateReply:
    run_id: str | None = None  # None until the trainer created the run (buffer/run_id.py)
    done: bool = False  # the trainer has finished its steps (ROOT/DONE)


@dataclasses.dataclass
class HeartbeatWrite:
    worker_id: str = ""  # a worker id (buffer.layout.check_worker_id); "" for the validator's
    beat: dict = dataclasses.field(default_factory=dict)  # JSON-able, <= MAX_BEAT_BYTES as JSON


@dataclasses.dataclass
class WorkerRef:
    worker_id: str = ""  # or a pool supervisor's id


@dataclasses.dataclass
class DocReply:
    """One JSON document of the run (a heartbeat, progress.json, weights/LATEST, a pool
    state), None when there is none yet."""

    doc: dict | None = None


@dataclasses.dataclass
class DocsReply:
    docs: list = dataclasses.field(default_factory=list)  # of dicts


@dataclasses.dataclass
class VersionRef:
    version: int = 0


@dataclasses.dataclass
class ClaimRequest:
    version: int = 0
    groups: int = 0  # slots of the version (weights/LATEST's sync_groups)
    want: int = 0
    worker_id: str = ""
    request_id: str = ""


@dataclasses.dataclass
class ShareRequest:
    groups: int = 0
    per_batch: int = 1


@dataclasses.dataclass
class Count:
    n: int = 0


@dataclasses.dataclass
class ClaimsReply:
    claims: dict = dataclasses.field(default_factory=dict)  # slot (int) -> worker id


@dataclasses.dataclass
class ValidationAnswer:
    result: dict = dataclasses.field(default_factory=dict)  # a ValidationResult's fields
    request_id: str = ""


@dataclasses.dataclass
class Flag:
    value: bool = False


@dataclasses.dataclass
class CommandsReply:
    commands: list = dataclasses.field(default_factory=list)  # protocol.control.Command fields
    errors: list = dataclasses.field(default_factory=list)  # why unreadable commands were skipped


@dataclasses.dataclass
class PoolStateWrite:
    supervisor_id: str = ""
    state: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class NewCommand:
    action: str = ""
    count: int = 1
    request_id: str = ""
    role: str = "rollout"  # protocol.control.ROLES: which pool the command is for


@dataclasses.dataclass
class CommandReply:
    id: str = ""
    action: str = ""
    count: int = 0
    where: str = ""  # the command's file on the trainer's disk, for launch.control's line
    role: str = ""  # empty from a trainer that predates roles (the client refuses that reply)


@dataclasses.dataclass
class RewardAnnounce:
    endpoint: dict = dataclasses.field(default_factory=dict)  # a protocol.reward.RewardEndpoint's fields


@dataclasses.dataclass(frozen=True)
class Rpc:
    request: type
    reply: type
    mutates: bool = False  # changes the run: answered once per request_id


# The whitelist: what a remote role may ask of the trainer's run; nothing else is served.
RPCS: dict[str, Rpc] = {
    # RunState
    "RunState": Rpc(Empty, RunStateReply),
    # HeartbeatStore (a worker writes only the id its process claimed: PERMISSION_DENIED else)
    "WriteHeartbeat": Rpc(HeartbeatWrite, Empty),
    "ReadHeartbeat": Rpc(WorkerRef, DocReply),
    "Heartbeats": Rpc(Empty, DocsReply),
    # ProgressStore (read only: the trainer writes it)
    "Progress": Rpc(Empty, DocReply),
    # WeightSource: LATEST and whether a version is still published; the files themselves come
    # from the weight service beside this one (buffer/weights/net_server.py, protocol/weights_wire.py)
    "WeightsPointer": Rpc(Empty, DocReply),
    "VersionExists": Rpc(VersionRef, Flag),
    # a reader lost the base of delta `version` (buffer/weights/delta.py): publish the next one
    # full (asking twice asks once: no request id needed)
    "RequestSnapshot": Rpc(VersionRef, Empty),
    # SyncClaims (the trainer opens and retires versions)
    "SyncClaim": Rpc(ClaimRequest, Count, mutates=True),
    "SyncShare": Rpc(ShareRequest, Count),
    "SyncClaims": Rpc(VersionRef, ClaimsReply),
    # ValidationStore, validator side (the trainer requests and reads results)
    "ValidationRequests": Rpc(Empty, DocsReply),
    "ValidationAnswer": Rpc(ValidationAnswer, Empty, mutates=True),
    "WriteValidatorBeat": Rpc(HeartbeatWrite, Empty),
    "ValidatorBeat": Rpc(Empty, DocReply),
    # ControlStore
    "ControlCommands": Rpc(Empty, CommandsReply),
    "AddCommand": Rpc(NewCommand, CommandReply, mutates=True),
    "ReadPoolState": Rpc(WorkerRef, DocReply),
    "WritePoolState": Rpc(PoolStateWrite, Empty),
    "PoolStates": Rpc(Empty, DocReply),
    # RewardAnnouncer / RewardEndpoints (buffer/reward/): reward servers and workers without the
    # run folder; an announcement replaces the server's endpoint (idempotent: no request id)
    "AnnounceReward": Rpc(RewardAnnounce, Empty),
    "WithdrawReward": Rpc(WorkerRef, Empty),
    "RewardEndpoints": Rpc(Empty, DocsReply),
}


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


# --- codec ---------------------------------------------------------------------------------
def encode(msg) -> bytes:
    return msgpack.packb(dataclasses.asdict(msg), use_bin_type=True)


def _matches(value, hint) -> bool:
    """Whether a decoded value fits a field's annotation (the types used above only)."""
    if hint is typing.Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or hint)


def decode(cls, raw: bytes):
    """`cls` from `encode`'s bytes; MessageError naming the field for anything else."""
    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise MessageError(f"{cls.__name__}: not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise MessageError(f"{cls.__name__}: expected a map, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            if not _matches(d[f.name], hints[f.name]):
                raise MessageError(f"{cls.__name__}.{f.name}: {type(d[f.name]).__name__} is not {hints[f.name]}")
            kwargs[f.name] = d[f.name]
    return cls(**kwargs)
