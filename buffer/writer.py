"""Worker side of the filesystem transport: buffer whole groups, publish shards atomically."""
from __future__ import annotations

import logging
import os
import threading
import time

import pyarrow as pa

from buffer.config import BufferConfig
from buffer.layout import RunLayout
from buffer.run_id import read_run_id
from buffer.storage import atomic_write, atomic_write_json, filesystem, read_json, when_space
from protocol.experience import Sample, check_rows, encode, to_table

log = logging.getLogger(__name__)


class ShardWriter:
    """Publishes `experience/<worker>/<seq>.arrow`, one shard per flush, seq contiguous.

    Each shard is `protocol.experience.encode` output (IPC stream + sha256 trailer), written to a
    temporary name, fsynced and renamed into place, so readers see all of it or nothing.

    A flush is triggered by sample count or by age (`flush_interval`), checked whenever a group
    is added or `maybe_flush` is called. Groups are never split across shards. The writer names
    groups and samples after the shard they land in (`<worker>/<seq>/<group>/<k>`).

    Restarts never reuse a shard number, even one the trainer consumed and retention deleted
    (the trainer would skip the new shard as consumed: its samples lost). Before publishing shard
    N the writer durably claims it in `workers/<worker>.claim`: `next_seq` N+1, `fill_from` the
    lowest number that may still be unpublished (N; over gRPC the oldest unacknowledged shard)
    and `samples_before`. A restarted writer continues after the claim (for a run without one:
    after its last heartbeat `resume`, plus any shard published after it). A number in
    [fill_from, next_seq) that is not on disk was either never published (the kill came first)
    or consumed (only consumed shards are deleted, archived or quarantined); the restarted writer
    publishes an empty shard under it, which closes the gap the trainer's ledger would otherwise
    wait on for ever, and which the trainer skips if the number was consumed. So shard keys and
    sample ids are unique across restarts.
    """

    def __init__(self, root: str, worker_id: str, cfg: BufferConfig, resume: dict | None = None):
        self.fs, root_path = filesystem(root)
        self.layout = RunLayout(root_path)
        self.worker_id = worker_id
        self.cfg = cfg
        self.dir = self.layout.worker_shard_dir(worker_id)
        self.fs.makedirs(self.dir, exist_ok=True)
        self._lock = threading.RLock()  # the worker flushes by age from another thread
        self.pending: list[Sample] = []
        self.pending_groups = 0
        self.oldest_pending: float | None = None
        self.shards_written = 0
        self.run_id = read_run_id(self.fs, self.layout)  # the worker sets it once the run exists
        self._resume(resume or {})

    def _resume(self, beat: dict) -> None:
        claim = read_json(self.fs, self.layout.seq_claim(self.worker_id)) or {}
        if claim:  # samples before `base` are counted; shards from `base` on are listed
            base, counted = int(claim["fill_from"]), int(claim["samples_before"])
        else:
            base, counted = int(beat.get("next_seq", 0)), int(beat.get("samples_written", 0))
        listed = [RunLayout.shard_seq(p) for p in self.fs.ls(self.dir, detail=False)]
        listed = sorted(s for s in listed if s is not None and s >= base)
        for seq in listed:  # published after the claim or heartbeat, before a crash
            try:
                with self.fs.open(self.layout.shard(self.worker_id, seq), "rb") as f:
                    meta = pa.ipc.open_stream(f).schema.metadata
                counted += int(meta[b"tandem.num_samples"])
            except (OSError, pa.ArrowException, KeyError, ValueError, TypeError) as e:
                # damaged, or quarantined/pruned meanwhile: never reuse its name, count nothing
                log.warning("cannot count the samples of shard %d of %s: %s", seq, self.worker_id, e)
        # The heartbeat counts only published shards: never less than what it says.
        self.samples_written = max(counted, int(beat.get("samples_written", 0)))
        claimed = int(claim.get("next_seq", 0))
        self.seq = max([base, claimed, int(beat.get("next_seq", 0)), *(s + 1 for s in listed)])
        published = int(beat.get("next_seq", 0))  # the heartbeat names only published shards
        self._gaps = [s for s in range(max(base, published), claimed) if s not in set(listed)]

    def _claim(self, seq: int) -> None:
        """Durably reserve `seq` before its shard can appear anywhere (see the class doc)."""
        atomic_write_json(self.fs, self.layout.seq_claim(self.worker_id), {
            "next_seq": seq + 1, "fill_from": self._unsure_from(seq),
            "samples_before": self.samples_written})

    def _unsure_from(self, seq: int) -> int:
        """The lowest shard number that may still be unpublished once `seq` is being published."""
        return seq

    def _fill_gaps(self) -> None:
        """Empty shards under the numbers a killed predecessor claimed but may not have
        published (see the class doc); before this writer's first own shard."""
        for seq in self._gaps:
            if not any(self.fs.exists(p) for p in (self.layout.shard(self.worker_id, seq),
                                                   self.layout.archive_shard(self.worker_id, seq))):
                self._publish(seq, self._encode(seq, []))
                log.info("published an empty shard %d of %s: claimed before a restart, not on "
                         "disk", seq, self.worker_id)
        self._gaps = []

    def add_group(self, group: list[Sample]) -> str | None:
        check_rows(group)
        with self._lock:
            return self._add_group(group)

    def _add_group(self, group: list[Sample]) -> str | None:
        group_id = f"{self.worker_id}/{self.seq}/{self.pending_groups}"
        for k, s in enumerate(group):
            s.group_id, s.sample_id = group_id, f"{group_id}/{k}"
        if not self.pending:
            self.oldest_pending = time.monotonic()
        self.pending.extend(group)
        self.pending_groups += 1
        return self.maybe_flush()

    def maybe_flush(self) -> str | None:
        with self._lock:
            if not self.pending:
                return None
            too_old = time.monotonic() - self.oldest_pending >= self.cfg.flush_interval
            if len(self.pending) >= self.cfg.flush_samples or too_old:
                return self.flush()
            return None

    def _publish(self, seq: int, data: bytes) -> str:
        """Make one shard visible to the trainer; the gRPC writer overrides this."""
        path = self.layout.shard(self.worker_id, seq)
        atomic_write(self.fs, path, data, tmp=self.layout.shard_tmp(self.worker_id, seq, os.getpid()))
        return path

    def close(self) -> None:
        self.flush()

    def _encode(self, seq: int, samples: list[Sample]) -> bytes:
        meta = {"tandem.worker_id": self.worker_id, "tandem.shard_seq": seq,
                "tandem.num_samples": len(samples), "tandem.created_at": time.time()}
        if self.run_id is not None:
            meta["tandem.run_id"] = self.run_id
        if samples:
            versions = [s.weight_version for s in samples]
            meta |= {"tandem.min_weight_version": min(versions),
                     "tandem.max_weight_version": max(versions)}
        return encode(to_table(samples, meta))

    def flush(self) -> str | None:
        with self._lock:
            return self._flush()

    def _flush(self) -> str | None:
        if not self.pending:
            return None
        if self._gaps:
            when_space(self._fill_gaps, self.dir)
        data = self._encode(self.seq, self.pending)
        # On a full disk the samples wait here, in memory, until there is space again.
        path = when_space(lambda: (self._claim(self.seq), self._publish(self.seq, data))[1],
                          self.dir)
        self.samples_written += len(self.pending)
        self.shards_written += 1
        log.info("published %s (%d samples)", path, len(self.pending))
        self.pending = []
        self.pending_groups = 0
        self.seq += 1
        return path
