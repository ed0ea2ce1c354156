"""The interfaces of a run's stores, as each role sees them.

A role gets its stores from its `buffer.run.Run` and never learns where they live: on a shared
folder (buffer/stores/fs.py) or behind the trainer's run service (buffer/stores/net.py). Every
method that waits has a timeout; every dict crossing a store is JSON-serialisable (it may travel
over the network as it is). Times are unix seconds (`time.time()`) unless named `*_s` (a
duration in seconds). Versions are the trainer's weight version numbers (int >= 0), `seq` a
worker's shard sequence number (int >= 0).

Worker/validator/pool-side stores (a filesystem and a network implementation each):
ExperienceSink, WeightSource, HeartbeatStore, ProgressStore, RunState, SyncClaims, ControlStore,
ValidationStore. Trainer-only stores (experience reading, weight publishing, checkpoints, metric
files) have a filesystem implementation only and are reached through the trainer's `Run` too.
"""
from __future__ import annotations

import abc
import logging
import os
import time
from typing import Callable

from protocol.control import Command
from protocol.validation import ValidationRequest, ValidationResult
from protocol.weights import WeightManifest

log = logging.getLogger(__name__)

ShouldStop = Callable[[], bool]


class ExperienceSink(abc.ABC):
    """Where one worker's encoded shards go (`protocol.experience.encode` output: Arrow IPC
    stream + sha256 trailer). `buffer.writer.ShardWriter` does the batching, sequence claims and
    encoding, and hands each finished shard to its sink."""

    @abc.abstractmethod
    def publish(self, seq: int, data: bytes) -> str:
        """Make shard `seq` (bytes `data`) reach the trainer, or start to: the filesystem sink
        writes it atomically (temp, fsync, rename); the gRPC sink hands it to a sender and blocks
        while `buffer.grpc_max_inflight` shards await acknowledgement. Returns where it went
        (a path or URL, for log lines). Raises OSError (disk full: the caller retries), or
        RuntimeError/TimeoutError when the trainer refused or never acknowledged."""

    @abc.abstractmethod
    def unsure_from(self, seq: int) -> int:
        """The lowest shard number that may still be unpublished once `seq` is being
        published (`seq` on a filesystem; over gRPC the oldest unacknowledged shard)."""

    @abc.abstractmethod
    def published(self) -> list[int]:
        """Shard numbers of this worker visible where the sink publishes (ascending), for a
        restarted writer's resume; a sink that cannot list (network) returns []."""

    @abc.abstractmethod
    def samples_in(self, seq: int) -> int:
        """Samples recorded in published shard `seq`'s metadata (`tandem.num_samples`).
        Raises OSError/ValueError when it cannot be read (gone or damaged)."""

    @abc.abstractmethod
    def has(self, seq: int) -> bool:
        """Whether shard `seq` was published and is still known (live or archived); a sink
        that cannot tell returns False (the writer then republishes an empty shard, which the
        trainer skips if the number was consumed)."""

    @abc.abstractmethod
    def read_claim(self) -> dict | None:
        """The writer's durable claim of its next shard numbers ({"next_seq", "fill_from",
        "samples_before"}), kept in the worker's own folder; None when there is none."""

    @abc.abstractmethod
    def write_claim(self, claim: dict) -> None:
        """Durably replace the claim (atomic write, fsynced) before shard `next_seq - 1`
        can appear anywhere."""

    @abc.abstractmethod
    def wait_for_room(self, limit: int, timeout_s: float, should_stop: ShouldStop,
                      on_wait: Callable[[], object] = lambda: None, group_size: int = 1) -> float:
        """Block while the worker may not produce more (backpressure): on a filesystem while
        the run's backlog (samples written by all workers - samples the trainer retired) is
        above max(`limit`, one trainer step of `group_size`-sample groups); over gRPC at once
        (unacknowledged pushes bound the worker instead). Calls `on_wait()` every poll;
        returns seconds waited; raises TimeoutError after `timeout_s`."""

    @abc.abstractmethod
    def where(self) -> str:
        """Where shards go (a folder or an address), for messages."""

    @abc.abstractmethod
    def close(self, timeout_s: float = 60.0) -> None:
        """After the writer's last flush: wait (at most `timeout_s`) until every shard has reached the
        trainer, then release threads and channels. Raises when shards were refused or are
        still unacknowledged at the deadline (never when the run has ended meanwhile)."""


class WeightSource(abc.ABC):
    """The trainer's weight versions as a worker or the validator reads them."""

    @abc.abstractmethod
    def pointer(self) -> dict | None:
        """weights/LATEST: {"version": int, "step": int, plus what the trainer announced with it
        (protocol.weights.SYNC_GROUPS)}; None before the first version."""

    def latest(self) -> int | None:
        """The newest published version, None before the first."""
        pointer = self.pointer()
        return None if pointer is None else int(pointer["version"])

    @abc.abstractmethod
    def fetch(self, version: int) -> str:
        """A LOCAL HF model folder (config, tokenizer, safetensors, manifest.json) holding
        `version`, every file checked against the version's manifest. The filesystem source
        returns the run's own folder; the network one streams it into the worker's cache.
        Raises FileNotFoundError or protocol.weights.ManifestError when the version is gone
        (pruned) or does not match its manifest."""

    def ready(self, version: int) -> bool:
        """Whether `fetch(version)` would return without waiting for a transfer. The filesystem
        source always is; the network one starts fetching each new version it sees in
        `pointer()` in the background, so a worker keeps generating while the bytes arrive."""
        return True

    def close(self) -> None:
        """A clean stop: ends background work (the network source cancels a fetch in flight).
        The filesystem source has none."""

    @abc.abstractmethod
    def exists(self, version: int) -> bool:
        """Whether `version` is still published (not pruned): tells a version pruned while it
        loaded (retry with a newer one) from a damaged newest version (an error)."""

    def files(self, version: int) -> list[str]:
        """Local paths of `version`'s safetensors files (sorted by name) after `fetch`: what an
        engine loads in place (vLLM's worker processes open them themselves)."""
        folder = self.fetch(version)
        where = os.path.join(folder, "manifest.json")
        with open(where) as f:
            manifest = WeightManifest.from_json(f.read(), where=where)
        return [os.path.join(folder, name) for name in sorted({t.file for t in manifest.tensors.values()})]

    def wait_latest(self, timeout_s: float, should_stop: ShouldStop = lambda: False,
                    poll_s: float = 0.5, note_every_s: float = 30.0) -> int | None:
        """The newest published version, waiting up to `timeout_s` for the first; None as soon
        as `should_stop()` says so. A log line when it starts waiting, then every
        `note_every_s`; TimeoutError after `timeout_s`."""
        start, last_note = time.monotonic(), None
        while (v := self.latest()) is None:
            if should_stop():
                return None
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise TimeoutError(f"no weight version appeared in {self.where()} within "
                                   f"{timeout_s:.0f} s: has the trainer started?")
            if last_note is None or time.monotonic() - last_note >= note_every_s:
                log.info("waiting for the first weight version in %s (%.0f s of %.0f)",
                         self.where(), waited, timeout_s)
                last_note = time.monotonic()
            time.sleep(poll_s)
        return v

    @abc.abstractmethod
    def where(self) -> str:
        """Where versions come from, for messages (a path or an address)."""


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
    "total_steps"} (buffer/backpressure.py)."""

    @abc.abstractmethod
    def write(self, progress: dict) -> None:
        """Trainer: replace the report atomically."""

    @abc.abstractmethod
    def read(self) -> dict | None:
        """The last report, None before the first."""

    @abc.abstractmethod
    def where(self) -> str:
        """For messages."""


class RunState(abc.ABC):
    """The run's identity and end."""

    @abc.abstractmethod
    def run_id(self) -> str | None:
        """The run id (stamped on every shard), None before the trainer created it."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the trainer has finished its steps (the DONE marker)."""

    @abc.abstractmethod
    def mark_done(self, info: dict) -> None:
        """Trainer: record the end of the run (atomically, waiting for space on a full disk)."""

    @abc.abstractmethod
    def where(self) -> str:
        """For messages."""


class SyncClaims(abc.ABC):
    """Synchronous rollouts (trainer.max_staleness=0, buffer/sync.py): the group slots of each
    version, claimed exactly once across all workers."""

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

    @abc.abstractmethod
    def open_version(self, version: int) -> None:
        """Trainer: make `version` claimable, before weights/LATEST names it."""

    @abc.abstractmethod
    def retire_before(self, version: int) -> int:
        """Trainer: make the versions older than `version` unclaimable; returns how many."""


class ControlStore(abc.ABC):
    """Pool commands in (launch.control, or a hand-written control file), pool state out."""

    @abc.abstractmethod
    def commands(self) -> tuple[list[Command], list[str]]:
        """Every command given so far (the hand-written file's, then control.d/'s in id order)
        and an error message for each unreadable one (the pool logs them)."""

    @abc.abstractmethod
    def submit(self, action: str, count: int) -> tuple[Command, str]:
        """launch.control: record a new command under the next free id, never overwriting a
        concurrent one; returns it and where it went. protocol.control.ControlError when no
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
    protocol/validation.py); an open request keeps its weight version published."""

    @abc.abstractmethod
    def request(self, version: int, step: int) -> None:
        """Trainer: ask for `version` (published at trainer step `step`) to be validated."""

    @abc.abstractmethod
    def result(self, version: int) -> ValidationResult | None:
        """Trainer: `version`'s result once answered, else None. ValidationFormatError when it
        cannot be parsed."""

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
