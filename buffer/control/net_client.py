"""The control plane's stores over the network (`buffer.transport=grpc`), as a worker, the
validator or a pool sees them.

Each method is one call to the trainer's run service (protocol/run_service.py, served by
buffer/control/net_server.py on the trainer's rank 0, beside the experience stream: same address,
token, TLS) through buffer/channel.py's RunClient (deadlines, retries, errors). Only the
operations of the roles beside the trainer exist here (buffer/control/base.py); the trainer's
own (its progress, the end of the run, opening sync versions, validation requests) are the run
folder's.
"""

from __future__ import annotations

import dataclasses
import json

from buffer.channel import RunClient
from buffer.control.base import ControlStore, HeartbeatStore, ProgressStore, RunState, SyncClaims, ValidationStore
from protocol import run_service as rs
from protocol.control import Command, ControlError
from protocol.validation import ValidationRequest, ValidationResult


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

    def where(self) -> str:
        return f"the run state at {self.client.address}"


class NetSyncClaims(SyncClaims):
    def __init__(self, client: RunClient):
        self.client = client

    def claim(self, version: int, groups: int, want: int, worker_id: str) -> int:
        # one request id for all retries: a claim whose reply was lost is not made twice
        return self.client.call("SyncClaim", rs.ClaimRequest(version, groups, want, worker_id, rs.new_request_id())).n

    def share(self, groups: int, per_batch: int) -> int:
        return self.client.call("SyncShare", rs.ShareRequest(groups, per_batch)).n

    def claims(self, version: int) -> dict[int, str]:
        return {int(k): v for k, v in self.client.call("SyncClaims", rs.VersionRef(version)).claims.items()}


class NetControl(ControlStore):
    def __init__(self, client: RunClient):
        self.client = client

    def commands(self) -> tuple[list[Command], list[str]]:
        reply = self.client.call("ControlCommands")
        known = {f.name for f in dataclasses.fields(Command)}  # a newer trainer may send more
        return [Command(**{k: v for k, v in c.items() if k in known}) for c in reply.commands], list(reply.errors)

    def submit(self, action: str, count: int, role: str = "rollout") -> tuple[Command, str]:
        reply = self.client.call("AddCommand", rs.NewCommand(action, count, rs.new_request_id(), role))
        if reply.role != role:  # a trainer from before roles ignores the field: say so, not a wrong pool
            raise ControlError(f"the trainer at {self.client.address} does not know pool roles; upgrade it")
        return Command(reply.id, reply.action, reply.count, reply.role), f"{reply.where} at {self.client.address}"

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

    def held(self) -> list[int]:
        return [r.version for r in self.requests()]

    def requests(self) -> list[ValidationRequest]:
        return [
            ValidationRequest.from_json(json.dumps(d), where=f"a request from {self.client.address}")
            for d in self.client.call("ValidationRequests").docs
        ]

    def answer(self, result: ValidationResult) -> None:
        self.client.call("ValidationAnswer", rs.ValidationAnswer(dataclasses.asdict(result), rs.new_request_id()))

    def write_beat(self, beat: dict) -> None:
        self.client.call("WriteValidatorBeat", rs.HeartbeatWrite("", beat))

    def beat(self) -> dict | None:
        return self.client.call("ValidatorBeat").doc

    def where(self) -> str:
        return f"validation requests at {self.client.address}"
