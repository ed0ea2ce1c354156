"""Experience on the run folder, a worker's side: its shards renamed into
experience/<worker>/<seq>.arrow (`FsExperienceSink`), where the trainer's reader
(buffer/experience/reader.py) finds them, as it finds those pushed over the network (spooled into
the same place by buffer/experience/net_server.py)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import pyarrow as pa

from buffer.control.base import ShouldStop
from buffer.control.fs import FsStore
from buffer.experience.base import ExperienceSink, WorkerIdInUse
from buffer.layout import RunLayout
from buffer.storage import LockHeld, atomic_write, atomic_write_json, hold_lock, is_local, read_json, release_lock


@dataclasses.dataclass
class FsExperienceSink(FsStore, ExperienceSink):
    """experience/<worker>/<seq>.arrow, written to a temporary name, fsynced and renamed into
    place (readers see all of it or nothing); the claim in workers/<worker>.claim. `room` is the
    run's backpressure (buffer/control/backpressure.py's wait_for_room on every worker's
    heartbeat and the trainer's progress, as buffer/run.py binds it)."""

    worker_id: str
    room: Callable[..., float]
    lock_wait_s: float = 30.0  # buffer.worker_lock_wait_s

    def __post_init__(self) -> None:
        self.dir = self.layout.worker_shard_dir(self.worker_id)
        self._hold_worker_id()
        self.fs.makedirs(self.dir, exist_ok=True)

    def _hold_worker_id(self) -> None:
        """One live writer per worker id: two would overwrite each other's shards (os.replace)
        and claims. workers/<worker>.lock, held for the process's life."""
        if not is_local(self.fs):
            return  # an object store has no locks; its runs use one writer per id by config
        try:
            hold_lock(self.layout.worker_lock(self.worker_id), f"worker id {self.worker_id}", self.lock_wait_s)
        except LockHeld as e:
            raise WorkerIdInUse(
                f"worker id {self.worker_id} is in use by another live worker, pid "
                f"{e.holder.get('pid', '?')} on host {e.holder.get('host', '?')}: give every worker its "
                f"own worker.id ({e})"
            ) from None

    def publish(self, seq: int, data: bytes) -> str:
        path = self.layout.shard(self.worker_id, seq)
        atomic_write(self.fs, path, data, tmp=self.layout.shard_tmp(self.worker_id, seq, os.getpid()))
        return path

    def unsure_from(self, seq: int) -> int:
        return seq

    def settled(self, beat_next_seq: int) -> int:
        return beat_next_seq

    def recover(self) -> list[int]:
        return []

    def published(self) -> list[int]:
        listed = (RunLayout.shard_seq(p) for p in self.fs.ls(self.dir, detail=False))
        return sorted(s for s in listed if s is not None)

    def samples_in(self, seq: int) -> int:
        with self.fs.open(self.layout.shard(self.worker_id, seq), "rb") as f:
            meta = pa.ipc.open_stream(f).schema.metadata
        return int(meta[b"tandem.num_samples"])

    def has(self, seq: int) -> bool:
        return any(
            self.fs.exists(p)
            for p in (self.layout.shard(self.worker_id, seq), self.layout.archive_shard(self.worker_id, seq))
        )

    def read_claim(self) -> dict | None:
        return read_json(self.fs, self.layout.seq_claim(self.worker_id))

    def write_claim(self, claim: dict) -> None:
        atomic_write_json(self.fs, self.layout.seq_claim(self.worker_id), claim)

    def wait_for_room(
        self,
        limit: int,
        timeout_s: float,
        should_stop: ShouldStop,
        on_wait: Callable[[], object] = lambda: None,
        group_size: int = 1,
    ) -> float:
        return self.room(limit, timeout_s, should_stop, on_wait=on_wait, group_size=group_size)

    def close(self, timeout_s: float = 60.0) -> None:
        # every shard was renamed into place by `publish`; the worker id is free again
        if is_local(self.fs):
            release_lock(self.layout.worker_lock(self.worker_id))

    def where(self) -> str:
        return self.dir
