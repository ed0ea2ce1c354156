"""The run's control plane: heartbeats, the trainer's progress, the run's identity and end,
synchronous-mode claims, pool commands, validation requests and results.

Each store has the interface of the roles beside the trainer (a worker, the validator, a pool,
launch.control), implemented on the run folder (buffer/control/fs.py) and over the trainer's run
service (buffer/control/net_client.py, served by buffer/control/net_server.py), and where the
trainer does more, a trainer-side interface over it that only the run folder implements
(`ProgressWriter`, `RunStateWriter`, `SyncRounds`, `ValidationRequests`): a role is handed only
the side it may use. Every method that waits has a timeout; every dict crossing a store is
JSON-serialisable (it may travel over the network as it is). Times are unix seconds
(`time.time()`) unless named `*_s` (a duration in seconds). Versions are the trainer's weight
version numbers (int >= 0).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from protocol.control import Command
from protocol.validation import ValidationRequest, ValidationResult

ShouldStop = Callable[[], bool]


class HeartbeatStore(abc.ABC):
    """One heartbeat per worker: a small dict the worker replaces every batch (worker_id,
    state, weight_version, samples_written, last_beat (unix s), ...; see rollout/worker.py)."""

    @abc.abstractmethod
    def write(self, worker_id: str, beat: dict) -> None:
        """Replace `worker_id`'s heartbeat atomically. OSError on a full disk (callers skip it)."""

    @abc.abstractmethod
    def read(self, worker_id: str) -> dict | None:
        """`worker_id`'s last heartbeat, None when it has none."""

    @abc.abstractmethod
    def all(self) -> list[dict]:
        """Every worker's last heartbeat that can be read now (ordered by worker id)."""

    @abc.abstractmethod
    def where(self, worker_id: str | None = None) -> str:
        """Where heartbeats live (of one worker, or all), for messages."""


class ProgressStore(abc.ABC):
    """The trainer's consumption report, read by workers for backpressure and by
    launch.status: {"samples_retired", "version", "batch_groups", "time", "step",
    "total_steps"} (buffer/control/backpressure.py)."""

    @abc.abstractmethod
    def read(self) -> dict | None:
        """The last report, None before the first."""

    def retired(self) -> int:
        """Samples the trainer reported retired (trained on, dropped or quarantined)."""
        return int((self.read() or {}).get("samples_retired", 0))

    @abc.abstractmethod
    def where(self) -> str:
        """For messages."""


class ProgressWriter(ProgressStore):
    """The trainer's side of its report."""

    @abc.abstractmethod
    def write(self, progress: dict) -> None:
        """Replace the report atomically."""


class RunState(abc.ABC):
    """The run's identity and end."""

    @abc.abstractmethod
    def run_id(self) -> str | None:
        """The run id (stamped on every shard), None before the trainer created it."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the trainer has finished its steps (the DONE marker)."""

    @abc.abstractmethod
    def where(self) -> str:
        """For messages."""


class RunStateWriter(RunState):
    """The trainer's side: it ends the run."""

    @abc.abstractmethod
    def mark_done(self, info: dict) -> None:
        """Record the end of the run (atomically, waiting for space on a full disk)."""


class SyncClaims(abc.ABC):
    """Synchronous rollouts (trainer.max_staleness=0, buffer/control/sync.py): the group slots
    of each version, claimed exactly once across all workers."""

    @abc.abstractmethod
    def claim(self, version: int, groups: int, want: int, worker_id: str) -> int:
        """Claim up to `want` of `version`'s `groups` slots for `worker_id`; how many it got
        (0: all taken, or the version is retired)."""

    @abc.abstractmethod
    def share(self, groups: int, per_batch: int) -> int:
        """Slots one worker claims at a time: an equal share among the live workers, in
        [1, per_batch]."""

    @abc.abstractmethod
    def claims(self, version: int) -> dict[int, str]:
        """Slot -> worker id of every claim of `version` (named when a batch never comes)."""


class SyncRounds(SyncClaims):
    """The trainer's side: it opens each version's slots and retires the old ones."""

    @abc.abstractmethod
    def open_version(self, version: int) -> None:
        """Make `version` claimable, before weights/LATEST names it."""

    @abc.abstractmethod
    def retire_before(self, version: int) -> int:
        """Make the versions older than `version` unclaimable; returns how many."""

    @abc.abstractmethod
    def where(self, version: int) -> str:
        """Where `version`'s claims are, for messages."""


class ControlStore(abc.ABC):
    """Pool commands in (launch.control, or a hand-written control file), pool state out."""

    @abc.abstractmethod
    def commands(self) -> tuple[list[Command], list[str]]:
        """Every command given so far (the hand-written file's, then control.d/'s in id order)
        and an error message for each unreadable one (the pool logs them)."""

    @abc.abstractmethod
    def submit(self, action: str, count: int, role: str = "rollout") -> tuple[Command, str]:
        """launch.control: record a new command for the `role`'s pool under the next free id,
        never overwriting a concurrent one; returns it and where it went. protocol.control.ControlError when no
        id is free."""

    @abc.abstractmethod
    def pool_state(self, supervisor_id: str) -> dict | None:
        """A pool supervisor's saved state (applied command ids, target, workers), or None."""

    @abc.abstractmethod
    def save_pool_state(self, supervisor_id: str, state: dict) -> None:
        """Replace it atomically (before the commands it records take effect)."""

    @abc.abstractmethod
    def pool_states(self) -> dict[str, dict]:
        """Supervisor id -> state, for launch.status."""

    def on_change(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` soon after a command arrives, where the store can tell (only
        shortens the pool's polling); returns a function that stops it."""
        return lambda: None

    @abc.abstractmethod
    def where(self) -> str:
        """For messages."""


class ValidationStore(abc.ABC):
    """Validation requests from the trainer, results from rollout.validate (schemas in
    protocol/validation.py); an open request keeps its weight version published. This is the
    validator's side."""

    @abc.abstractmethod
    def held(self) -> list[int]:
        """Versions with an open request, oldest first."""

    @abc.abstractmethod
    def requests(self) -> list[ValidationRequest]:
        """Validator: the open requests, oldest version first (a malformed one is answered as
        skipped)."""

    @abc.abstractmethod
    def answer(self, result: ValidationResult) -> None:
        """Validator: publish `result`, then release its version (close the request)."""

    @abc.abstractmethod
    def write_beat(self, beat: dict) -> None:
        """Validator: replace its heartbeat ({"state", "weight_version", "answered",
        "last_beat", ...}). OSError on a full disk."""

    @abc.abstractmethod
    def beat(self) -> dict | None:
        """The validator's last heartbeat, None when it has none."""

    @abc.abstractmethod
    def where(self) -> str:
        """For messages."""


class ValidationRequests(ValidationStore):
    """The trainer's side: it asks for validations and reads their results."""

    @abc.abstractmethod
    def request(self, version: int, step: int) -> None:
        """Ask for `version` (published at trainer step `step`) to be validated."""

    @abc.abstractmethod
    def result(self, version: int) -> ValidationResult | None:
        """`version`'s result once answered, else None. ValidationFormatError when it cannot be
        parsed."""
