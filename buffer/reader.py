"""Trainer side of the filesystem transport: discover shards, consume each once, batch groups.

Discovery always polls (`poll_interval`); with `discovery=auto` a watchdog observer also wakes the
reader as soon as a shard is renamed into place on this node. Across nodes on NFS/Lustre no
events arrive, so the poll is what guarantees progress; events only cut latency.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import pyarrow as pa

from buffer.config import BufferConfig
from buffer.layout import RunLayout
from buffer.storage import filesystem, is_local
from protocol.experience import Sample, SchemaError, check_rows, decode, from_table

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Group:
    """All samples of one prompt draw: the unit of GRPO advantage and of batching."""
    group_id: str
    weight_version: int
    samples: list[Sample]


class _Wake:
    """watchdog handler: any created/moved file under experience/ wakes the reader."""

    def __init__(self, event: threading.Event):
        self.event = event

    def dispatch(self, event) -> None:
        if event.event_type in ("created", "moved"):
            self.event.set()


class ExperienceReader:
    def __init__(self, root: str, cfg: BufferConfig, max_staleness: int,
                 consumed: set[str] | None = None):
        self.fs, root_path = filesystem(root)
        self.layout = RunLayout(root_path)
        self.cfg = cfg
        self.max_staleness = max_staleness
        self.consumed: set[str] = set(consumed or ())  # "<worker>/<seq>" of every shard read
        self.pool: collections.deque[Group] = collections.deque()
        self.stats = collections.Counter()
        self._wake = threading.Event()
        self._observer = None
        self.fs.makedirs(self.layout.experience_dir, exist_ok=True)
        if cfg.discovery == "auto" and is_local(self.fs):
            self._start_watch()

    def _start_watch(self) -> None:
        from watchdog.observers import Observer
        observer = Observer()
        observer.schedule(_Wake(self._wake), self.layout.experience_dir, recursive=True)
        observer.daemon = True
        observer.start()
        self._observer = observer

    def close(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None

    def discover(self) -> list[tuple[str, str]]:
        """(key, path) of published shards not yet consumed, oldest first per worker."""
        found = []
        for wdir in self.fs.ls(self.layout.experience_dir, detail=False):
            worker = wdir.rstrip("/").rsplit("/", 1)[-1]
            for path in self.fs.ls(wdir, detail=False):
                seq = RunLayout.shard_seq(path)
                key = f"{worker}/{seq}"
                if seq is not None and key not in self.consumed:
                    found.append((seq, key, path))
        found.sort()
        return [(key, path) for _, key, path in found]

    def _ingest(self, key: str, path: str) -> None:
        try:
            data = self.fs.cat_file(path)
        except OSError as e:  # e.g. an NFS hiccup: leave it unconsumed, the next poll retries
            self.stats["read_retries"] += 1
            log.warning("could not read shard %s (%s); will retry", path, e)
            return
        self.consumed.add(key)
        try:
            samples = from_table(decode(data))
            check_rows(samples)
        except (pa.ArrowInvalid, SchemaError) as e:
            self.stats["bad_shards"] += 1
            log.error("skipping unreadable shard %s: %s", path, e)
            return
        self.stats["shards_read"] += 1
        groups: dict[str, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        for gid, members in groups.items():
            self.pool.append(Group(gid, members[0].weight_version, members))

    def _drop_stale(self, current_version: int) -> None:
        keep = collections.deque()
        for g in self.pool:
            if current_version - g.weight_version > self.max_staleness:
                self.stats["dropped_stale_samples"] += len(g.samples)
            else:
                keep.append(g)
        self.pool = keep

    def next_batch(self, num_groups: int, current_version: int, timeout_s: float) -> list[Group]:
        """The oldest `num_groups` groups within the staleness bound; waits up to `timeout_s`."""
        start = time.monotonic()
        last_note = start
        while True:
            for key, path in self.discover():
                self._ingest(key, path)
            self._drop_stale(current_version)
            if len(self.pool) >= num_groups:
                batch = [self.pool.popleft() for _ in range(num_groups)]
                self.stats["consumed_samples"] += sum(len(g.samples) for g in batch)
                return batch
            now = time.monotonic()
            if now - start >= timeout_s:
                raise TimeoutError(
                    f"waited {timeout_s:.0f} s for {num_groups} groups of experience in "
                    f"{self.layout.experience_dir}: have {len(self.pool)} "
                    f"({self.stats['shards_read']} shards read so far). Are rollout workers "
                    f"running? Their heartbeats are in {self.layout.workers_dir}")
            if now - last_note >= 30:
                log.info("waiting for experience: %d/%d groups after %.0f s",
                         len(self.pool), num_groups, now - start)
                last_note = now
            self._wake.wait(min(self.cfg.poll_interval, timeout_s - (now - start)))
            self._wake.clear()
