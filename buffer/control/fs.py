"""The control plane's stores on the run folder (buffer/layout.py) on a shared filesystem (local,
NFS, Lustre; any fsspec URL where noted): with `buffer.transport=fs` every role uses these; with
`grpc` the trainer does, and serves them to the others (buffer/control/net_server.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable

import fsspec

from buffer.control.base import (
    ControlStore,
    HeartbeatStore,
    ProgressWriter,
    RunStateWriter,
    SyncRounds,
    ValidationRequests,
)
from buffer.layout import RunLayout
from buffer.storage import (
    atomic_write,
    atomic_write_json,
    create_new,
    is_local,
    read_json,
    stop_watch,
    watch,
    when_space,
)
from protocol import control
from protocol.validation import ValidationFormatError, ValidationRequest, ValidationResult

log = logging.getLogger(__name__)

LIVE_BEAT_S = 300.0  # a heartbeat newer than this counts its worker in a sync share (launch.status's
# silent-after); a dead worker only shrinks the others' chunks for a while, never loses groups
MAX_SUBMIT_ATTEMPTS = 1000  # command ids taken by concurrent launch.control calls


@dataclasses.dataclass
class FsStore:
    """A store on the run folder: its filesystem and its layout."""

    fs: fsspec.AbstractFileSystem
    layout: RunLayout


class FsHeartbeats(FsStore, HeartbeatStore):
    """workers/<worker>.json, one small file per worker."""

    def write(self, worker_id: str, beat: dict) -> None:
        atomic_write_json(self.fs, self.layout.heartbeat(worker_id), beat)

    def read(self, worker_id: str) -> dict | None:
        return read_json(self.fs, self.layout.heartbeat(worker_id))

    def remove(self, worker_id: str) -> None:
        """Drop `worker_id`'s heartbeat (the run service's bound on worker ids); none is fine."""
        path = self.layout.heartbeat(worker_id)
        if self.fs.exists(path):
            self.fs.rm(path)

    def all(self) -> list[dict]:
        out = []
        if self.fs.exists(self.layout.workers_dir):
            for path in sorted(self.fs.ls(self.layout.workers_dir, detail=False)):
                if RunLayout.heartbeat_worker(path) is None:
                    continue
                try:
                    beat = json.loads(self.fs.cat_file(path))
                except (FileNotFoundError, ValueError):
                    continue  # a heartbeat being replaced or removed; the next look sees it
                if isinstance(beat, dict):
                    out.append(beat)
        return out

    def where(self, worker_id: str | None = None) -> str:
        return self.layout.heartbeat(worker_id) if worker_id else self.layout.workers_dir


class FsProgress(FsStore, ProgressWriter):
    """progress.json."""

    def write(self, progress: dict) -> None:
        atomic_write_json(self.fs, self.layout.progress, progress)

    def read(self) -> dict | None:
        return read_json(self.fs, self.layout.progress)

    def where(self) -> str:
        return self.layout.progress


class FsRunState(FsStore, RunStateWriter):
    """run.json (the run id) and the DONE marker."""

    def run_id(self) -> str | None:
        info = read_json(self.fs, self.layout.run_info)
        return None if info is None else str(info["run_id"])

    def ensure_run_id(self) -> str:
        """The run's id, created now if the folder has none. Only the lock holder calls this."""
        run_id = self.run_id()
        if run_id is None:
            run_id = uuid.uuid4().hex
            atomic_write_json(
                self.fs,
                self.layout.run_info,
                {"run_id": run_id, "host": socket.gethostname(), "created_at": time.time()},
            )
        return run_id

    def done(self) -> bool:
        return self.fs.exists(self.layout.done_marker)

    def done_info(self) -> dict | None:
        """What the trainer recorded in DONE ({"steps", "version"}), None before the end."""
        return read_json(self.fs, self.layout.done_marker)

    def mark_done(self, info: dict) -> None:
        when_space(lambda: atomic_write_json(self.fs, self.layout.done_marker, info), self.layout.done_marker)

    def where(self) -> str:
        return self.layout.done_marker


@dataclasses.dataclass
class FsSyncClaims(SyncRounds):
    """sync/v<version>/<slot>, created exclusively (O_CREAT|O_EXCL: exactly one creator wins, on
    a local disk and on NFSv3+/Lustre): a mounted filesystem only (buffer/control/sync.py)."""

    layout: RunLayout
    heartbeats: HeartbeatStore

    def open_version(self, version: int) -> None:
        os.makedirs(self.layout.sync_version_dir(version), exist_ok=True)

    def retire_before(self, version: int) -> int:
        # Renamed away before removal: a late claim finds no folder (an rmtree alone could let
        # a claim in between its unlink and its rmdir).
        folder = self.layout.sync_dir
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return 0
        retired = 0
        for name in names:
            old = RunLayout.version_of(name)
            if old is None or old >= version:
                continue
            trash = os.path.join(folder, f".retired-{name}-{os.getpid()}")
            try:
                os.rename(os.path.join(folder, name), trash)
            except FileNotFoundError:
                continue
            shutil.rmtree(trash, ignore_errors=True)
            retired += 1
        return retired

    def claims(self, version: int) -> dict[int, str]:
        folder = self.layout.sync_version_dir(version)
        out: dict[int, str] = {}
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return out
        for name in names:
            if name.isdigit():
                try:
                    with open(os.path.join(folder, name)) as f:
                        out[int(name)] = f.read().strip()
                except FileNotFoundError:
                    continue
        return out

    def claim(self, version: int, groups: int, want: int, worker_id: str) -> int:
        folder = self.layout.sync_version_dir(version)
        try:
            taken = set(os.listdir(folder))
        except FileNotFoundError:
            return 0
        got = 0
        for slot in range(groups):
            if got == want:
                break
            path = self.layout.sync_claim(version, slot)
            if os.path.basename(path) in taken:
                continue
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:  # another worker was first
                continue
            except FileNotFoundError:  # retired meanwhile: the trainer has moved on
                break
            with os.fdopen(fd, "w") as f:
                f.write(worker_id + "\n")
            got += 1
        return got

    def share(self, groups: int, per_batch: int, now: float | None = None) -> int:
        # Balance only: correctness never depends on it, a worker claims again while slots are left.
        now = time.time() if now is None else now
        live = sum(
            1
            for b in self.heartbeats.all()
            if b.get("state") != "stopped" and now - b.get("last_beat", 0) < LIVE_BEAT_S
        )
        return max(1, min(per_batch, math.ceil(groups / max(live, 1))))

    def where(self, version: int) -> str:
        return self.layout.sync_version_dir(version)


@dataclasses.dataclass
class FsControl(FsStore, ControlStore):
    """control.json (by hand), control.d/<id>.json (launch.control), pool/<supervisor>.json."""

    def _read(self, path: str, parse, errors: list[str]) -> list[control.Command]:
        try:
            return parse(self.fs.cat_file(path))  # bytes: control.parse judges the encoding
        except FileNotFoundError:
            return []
        except control.ControlError as e:
            errors.append(str(e))
            return []

    def _command_names(self) -> list[str]:
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.layout.control_dir, detail=False))
        except FileNotFoundError:
            return []

    def commands(self) -> tuple[list[control.Command], list[str]]:
        errors: list[str] = []
        where = self.layout.control
        cmds = self._read(where, lambda text: control.parse(text, where), errors)
        for name in self._command_names():
            if name.endswith(".json"):
                path, cid = f"{self.layout.control_dir}/{name}", name[: -len(".json")]
                cmds += self._read(
                    path, lambda text, cid=cid, path=path: [control.parse_command_file(text, cid, path)], errors
                )
        return cmds, errors

    def _taken_ids(self) -> set[str]:
        ids = {n[: -len(".json")] for n in self._command_names() if n.endswith(".json")}
        try:
            ids |= {c.id for c in control.parse(self.fs.cat_file(self.layout.control), self.layout.control)}
        except FileNotFoundError:
            pass
        except control.ControlError as e:
            self._set_aside(e)
        return ids

    def _set_aside(self, e: control.ControlError) -> None:
        """A control.json that is no command list (a bad hand edit) would block every new
        command: it is moved to control.json.damaged-<unix time> (kept for whoever wrote it)
        and replaced by an empty list; a warning names both."""
        aside = f"{self.layout.control}.damaged-{time.time():.0f}"
        try:
            self.fs.mv(self.layout.control, aside)
        except FileNotFoundError:  # another launch.control moved it first
            return
        atomic_write_json(self.fs, self.layout.control, {"commands": []})
        log.warning("%s; moved it to %s and started an empty one (its commands are not applied)", e, aside)

    def submit(self, action: str, count: int, role: str = "rollout") -> tuple[control.Command, str]:
        # The id is allocated by creating the file under the next free name without overwriting
        # (create_new): concurrent commands never share an id and none is lost.
        for _ in range(MAX_SUBMIT_ATTEMPTS):
            text, cmd = control.new_command(control.next_id(self._taken_ids()), action, count, role)
            path = self.layout.control_command(cmd.id)
            if create_new(self.fs, path, text.encode()):
                return cmd, path
        raise control.ControlError(
            f"no free command id in {self.layout.control_dir} after {MAX_SUBMIT_ATTEMPTS} attempts"
        )

    def pool_state(self, supervisor_id: str) -> dict | None:
        return read_json(self.fs, self.layout.pool_state(supervisor_id))

    def save_pool_state(self, supervisor_id: str, state: dict) -> None:
        atomic_write_json(self.fs, self.layout.pool_state(supervisor_id), state)

    def pool_states(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        try:
            names = sorted(self.fs.ls(self.layout.pool_dir, detail=False))
        except FileNotFoundError:
            return out
        for path in names:
            sid = RunLayout.heartbeat_worker(path)  # same naming rule: <id>.json
            state = read_json(self.fs, path) if sid else None
            if sid and isinstance(state, dict):
                out[sid] = state
        return out

    def on_change(self, callback: Callable[[], None]) -> Callable[[], None]:
        # Filesystem events wake the pool early on this node; polling covers other nodes.
        if not is_local(self.fs):
            return lambda: None
        self.fs.makedirs(self.layout.root, exist_ok=True)
        observer = watch(self.layout.root, lambda _event: callback(), recursive=False)
        return lambda: stop_watch(observer)

    def where(self) -> str:
        return self.layout.control_dir


@dataclasses.dataclass
class FsValidation(FsStore, ValidationRequests):
    """validation/requests/v<N>.json, validation/v<N>.json, validation/validator.json. The
    result is written atomically before the request is removed: a crash in between leaves a
    request whose result exists, which `requests` releases without evaluating it again."""

    def _versions(self, folder: str) -> list[int]:
        try:
            names = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        return sorted(v for v in map(RunLayout.validation_version, names) if v is not None)

    def request(self, version: int, step: int) -> None:
        req = ValidationRequest(version=version, step=step, requested_at=time.time())
        path = self.layout.validation_request(version)  # on a full disk: wait for space
        when_space(lambda: atomic_write(self.fs, path, req.to_json().encode()), path)

    def result(self, version: int) -> ValidationResult | None:
        path = self.layout.validation_result(version)
        try:
            text = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return ValidationResult.from_json(text, where=path)

    def held(self) -> list[int]:
        return self._versions(self.layout.validation_requests_dir)

    def requests(self) -> list[ValidationRequest]:
        out = []
        for version in self.held():
            path = self.layout.validation_request(version)
            if self.fs.exists(self.layout.validation_result(version)):
                self._release(version)
                continue
            try:
                out.append(ValidationRequest.from_json(self.fs.cat_file(path), where=path))
            except FileNotFoundError:
                continue  # answered meanwhile
            except ValidationFormatError as e:
                log.warning("%s", e)
                self.answer(
                    ValidationResult(version=version, step=-1, metrics={}, skipped=str(e), finished_at=time.time())
                )
        return out

    def answer(self, result: ValidationResult) -> None:
        path = self.layout.validation_result(result.version)  # on a full disk: wait for space
        when_space(lambda: atomic_write(self.fs, path, result.to_json().encode()), path)
        self._release(result.version)

    def _release(self, version: int) -> None:
        try:
            self.fs.rm_file(self.layout.validation_request(version))
        except FileNotFoundError:
            pass

    def write_beat(self, beat: dict) -> None:
        atomic_write_json(self.fs, self.layout.validator_heartbeat, beat)

    def beat(self) -> dict | None:
        return read_json(self.fs, self.layout.validator_heartbeat)

    def where(self) -> str:
        return self.layout.validation_requests_dir
