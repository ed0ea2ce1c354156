"""Worker side of the filesystem transport: buffer whole groups, publish shards atomically."""
from __future__ import annotations

import logging
import os
import time

import pyarrow as pa

from buffer.config import BufferConfig
from buffer.layout import RunLayout
from buffer.storage import atomic_write, filesystem
from protocol.experience import Sample, check_rows, encode, to_table

log = logging.getLogger(__name__)


class ShardWriter:
    """Publishes `experience/<worker>/<seq>.arrow`, one shard per flush, seq contiguous.

    Each shard is `protocol.experience.encode` output (IPC stream + sha256 trailer), written to a
    temporary name, fsynced and renamed into place, so readers see all of it or nothing.

    A flush is triggered by sample count or by age (`flush_interval`), checked whenever a group
    is added or `maybe_flush` is called. Groups are never split across shards. The writer names
    groups and samples after the shard they land in (`<worker>/<seq>/<group>/<k>`), so ids stay
    unique across worker restarts. `resume` is the worker's last heartbeat: a restarted writer
    continues its sequence and its sample count from there (plus any shard published after it),
    even when consumed shards have been deleted.
    """

    def __init__(self, root: str, worker_id: str, cfg: BufferConfig, resume: dict | None = None):
        self.fs, root_path = filesystem(root)
        self.layout = RunLayout(root_path)
        self.worker_id = worker_id
        self.cfg = cfg
        self.dir = self.layout.worker_shard_dir(worker_id)
        self.fs.makedirs(self.dir, exist_ok=True)
        self.pending: list[Sample] = []
        self.pending_groups = 0
        self.oldest_pending: float | None = None
        self.shards_written = 0
        self._resume(resume or {})

    def _resume(self, beat: dict) -> None:
        next_seq = int(beat.get("next_seq", 0))
        self.samples_written = int(beat.get("samples_written", 0))
        listed = [RunLayout.shard_seq(p) for p in self.fs.ls(self.dir, detail=False)]
        listed = sorted(s for s in listed if s is not None and s >= next_seq)
        for seq in listed:  # published after the last heartbeat, before a crash
            try:
                with self.fs.open(self.layout.shard(self.worker_id, seq), "rb") as f:
                    meta = pa.ipc.open_stream(f).schema.metadata
                self.samples_written += int(meta[b"tandem.num_samples"])
            except (OSError, pa.ArrowException, KeyError, ValueError, TypeError) as e:
                # damaged, or quarantined/pruned meanwhile: never reuse its name, count nothing
                log.warning("cannot count the samples of shard %d of %s: %s", seq, self.worker_id, e)
        self.seq = max([next_seq, *(s + 1 for s in listed)])

    def add_group(self, group: list[Sample]) -> str | None:
        check_rows(group)
        group_id = f"{self.worker_id}/{self.seq}/{self.pending_groups}"
        for k, s in enumerate(group):
            s.group_id, s.sample_id = group_id, f"{group_id}/{k}"
        if not self.pending:
            self.oldest_pending = time.monotonic()
        self.pending.extend(group)
        self.pending_groups += 1
        return self.maybe_flush()

    def maybe_flush(self) -> str | None:
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

    def flush(self) -> str | None:
        if not self.pending:
            return None
        versions = [s.weight_version for s in self.pending]
        table = to_table(self.pending, {"tandem.worker_id": self.worker_id,
                                        "tandem.shard_seq": self.seq,
                                        "tandem.num_samples": len(self.pending),
                                        "tandem.min_weight_version": min(versions),
                                        "tandem.max_weight_version": max(versions),
                                        "tandem.created_at": time.time()})
        path = self._publish(self.seq, encode(table))
        self.samples_written += len(self.pending)
        self.shards_written += 1
        log.info("published %s (%d samples)", path, len(self.pending))
        self.pending = []
        self.pending_groups = 0
        self.seq += 1
        return path
