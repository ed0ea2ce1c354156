"""Worker side of the filesystem transport: buffer whole groups, publish shards atomically."""
from __future__ import annotations

import logging
import os
import time

from buffer.config import BufferConfig
from buffer.layout import RunLayout
from buffer.storage import atomic_write, filesystem
from protocol.experience import Sample, check_rows, encode, to_table

log = logging.getLogger(__name__)


class ShardWriter:
    """Publishes `experience/<worker>/<seq>.arrow`, one shard per flush, seq contiguous from 0.

    A flush is triggered by sample count or by age (`flush_interval`), checked whenever a group
    is added or `maybe_flush` is called. Groups are never split across shards.
    """

    def __init__(self, root: str, worker_id: str, cfg: BufferConfig):
        self.fs, root_path = filesystem(root)
        self.layout = RunLayout(root_path)
        self.worker_id = worker_id
        self.cfg = cfg
        self.dir = self.layout.worker_shard_dir(worker_id)
        self.fs.makedirs(self.dir, exist_ok=True)
        self.seq = self._next_seq()
        self.pending: list[Sample] = []
        self.oldest_pending: float | None = None
        self.samples_written = 0
        self.shards_written = 0

    def _next_seq(self) -> int:
        """Resume after a restart: continue after the highest published shard."""
        seqs = [RunLayout.shard_seq(p) for p in self.fs.ls(self.dir, detail=False)]
        return max((s for s in seqs if s is not None), default=-1) + 1

    def add_group(self, group: list[Sample]) -> str | None:
        check_rows(group)
        if not self.pending:
            self.oldest_pending = time.monotonic()
        self.pending.extend(group)
        return self.maybe_flush()

    def maybe_flush(self) -> str | None:
        if not self.pending:
            return None
        too_old = time.monotonic() - self.oldest_pending >= self.cfg.flush_interval
        if len(self.pending) >= self.cfg.flush_samples or too_old:
            return self.flush()
        return None

    def flush(self) -> str | None:
        if not self.pending:
            return None
        table = to_table(self.pending, {"tandem.worker_id": self.worker_id,
                                        "tandem.shard_seq": self.seq,
                                        "tandem.created_at": time.time()})
        path = self.layout.shard(self.worker_id, self.seq)
        atomic_write(self.fs, path, encode(table),
                     tmp=self.layout.shard_tmp(self.worker_id, self.seq, os.getpid()))
        self.samples_written += len(self.pending)
        self.shards_written += 1
        log.info("published %s (%d samples)", path, len(self.pending))
        self.pending = []
        self.seq += 1
        return path
