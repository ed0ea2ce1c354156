"""The trainer's ExperienceSource on the run folder: discover shards, consume each once, batch
groups (shards pushed over the network are spooled into the same folder and read alike).

Discovery always polls (`poll_interval`); with `discovery=auto` a watchdog observer also wakes the
reader as soon as a shard is renamed into place on this node. Across nodes on NFS/Lustre no
events arrive, so the poll is what guarantees progress; events only cut latency.

Cost of a poll. Each worker publishes `experience/<worker>/<seq>.arrow` with seq contiguous, so
the reader remembers per worker the next seq it expects and only probes for that file (one stat
per worker, plus one per new shard) after listing the small top folder for new workers. Every
`full_scan_interval` seconds (and on the first poll, and when `consumed` is replaced, e.g. on a
trainer resume) it lists every worker folder once, which catches gaps in a sequence; the missing
seqs a listing saw below a worker's newest shard are probed on every poll after it (over gRPC,
concurrent pushes and retries land out of order, so such gaps fill within seconds). The consumed
ledger (buffer.ledger.Ledger: per worker a high-water mark plus the few seqs above it) is always
the judge of what is new, so probing and full listings never change what is read: each shard
exactly once.

Integrity. Every shard is checked (sha256 trailer, schema version and column types, row
invariants, token ids within `vocab_size`, finite values, and that the writer's recorded worker
and seq match where the file is). A rejected shard is counted in stats['bad_shards'], moved to
`quarantine/<worker>/` with a `.reason.txt` beside it (stats['quarantined_shards']), recorded as
consumed, and the reader carries on.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable

import pyarrow as pa

from buffer.config import BufferConfig
from buffer.control.backpressure import NOTE_EVERY_S, backlog, describe_workers
from buffer.control.fs import FsHeartbeats, FsProgress
from buffer.experience.base import ExperienceSource
from buffer.layout import SHARD_SUFFIX, RunLayout, check_worker_id
from buffer.ledger import Ledger, as_ledger, shard_key
from buffer.storage import atomic_write, filesystem, is_local, stop_watch, watch
from protocol.experience import (
    DECLARED_LOST_KEY,
    RUN_ID_KEY,
    GroupRef,
    Sample,
    SchemaError,
    from_table,
    group_digest,
    load_shard,
)

log = logging.getLogger(__name__)

MAX_READ_ATTEMPTS = 5  # a shard that cannot be read this many times in a row is rejected
MAX_GAPS = 4096  # missing seqs of one worker probed on every poll (older ones: full listings)


@dataclasses.dataclass
class Group:
    """All samples of one prompt draw: the unit of GRPO advantage and of batching."""

    group_id: str
    weight_version: int
    samples: list[Sample]
    # The file holding it (its shard, or the pool file of the checkpoint that saved it): where
    # the other trainer ranks read it (read_groups).
    source: str | None = None

    def ref(self) -> GroupRef:
        if self.source is None:
            raise ValueError(f"group {self.group_id}: no file holds it, so no rank can read it")
        return GroupRef(self.source, self.group_id, group_digest(self.samples))


class ExperienceReader(ExperienceSource):
    def __init__(
        self,
        root: str,
        cfg: BufferConfig,
        max_staleness: int,
        consumed=None,
        vocab_size: int | None = None,
        run_id: str | None = None,
    ):
        self.fs, root_path = filesystem(root)
        self.layout = RunLayout(root_path)
        self.heartbeats, self.progress = FsHeartbeats(self.fs, self.layout), FsProgress(self.fs, self.layout)
        self.cfg = cfg
        self.max_staleness = max_staleness
        self.vocab_size = vocab_size  # token ids must be < this (the trainer's model vocab)
        self.run_id = run_id  # shards must carry it (None: not checked, e.g. buffer tools)
        self.pool: collections.deque[Group] = collections.deque()
        self.stats: collections.Counter[str] = collections.Counter()
        self._local = is_local(self.fs)
        self._next: dict[str, int] | None = None  # per worker: the next seq to probe for
        self._gaps: dict[str, set[int]] = {}  # per worker: missing seqs below its newest shard
        self._last_full = -math.inf
        self._pending: dict[str, tuple[int, str]] = {}  # discovered, not yet consumed: (seq, path)
        self._failures: dict[str, int] = {}  # key -> failed reads in a row
        self._ignored: set[str] = set()  # folder names under experience/ that are not worker ids
        self.consumed = consumed  # "<worker>/<seq>" of every shard read (or rejected)
        self._wake = threading.Event()
        self._observer = None
        self.fs.makedirs(self.layout.experience_dir, exist_ok=True)
        if cfg.discovery == "auto" and self._local:
            self._start_watch()

    @property
    def consumed(self) -> Ledger:
        return self._consumed

    @consumed.setter
    def consumed(self, ledger) -> None:
        """Accepts a Ledger (copied), its to_json() dict, a list/set of keys, or None.
        Replacing the ledger (trainer resume) makes the next poll a full listing."""
        self._consumed = as_ledger(ledger)
        self._next = None
        self._gaps = {}
        self._pending = {}

    def _start_watch(self) -> None:
        def wake(event) -> None:  # a shard renamed into place (or a new worker folder)
            if event.event_type in ("created", "moved"):
                self._wake.set()

        self._observer = watch(self.layout.experience_dir, wake, recursive=True)

    def close(self) -> None:
        if self._observer is not None:
            stop_watch(self._observer)
            self._observer = None

    # --- discovery ---------------------------------------------------------------------------
    def discover(self) -> list[tuple[str, str]]:
        """(key, path) of published shards not yet consumed, oldest first per worker."""
        now = time.monotonic()
        if self._next is None or now - self._last_full >= self.cfg.full_scan_interval:
            found = self._full_scan()
            self._last_full = now
        else:
            found = self._probe()
        # shards found earlier but not consumed yet (discover() without ingesting, read retries)
        pending = self._pending
        pending.update(found)
        for key in [k for k in pending if k in self._consumed]:
            del pending[key]
        out = sorted((seq, key, path) for key, (seq, path) in pending.items())
        return [(key, path) for _, key, path in out]

    def _ledger_next(self) -> dict[str, int]:
        ledger = self._consumed
        return {worker: ledger.next_seq(worker) for worker in ledger.workers()}

    def _worker_dirs(self) -> list[str]:
        root = self.layout.experience_dir
        try:
            if self._local:
                with os.scandir(root) as it:
                    names = [e.name for e in it if e.is_dir()]
            else:
                names = [
                    e["name"].rstrip("/").rsplit("/", 1)[-1]
                    for e in self.fs.ls(root, detail=True)
                    if e["type"] == "directory"
                ]
        except FileNotFoundError:
            return []
        workers = []
        for name in names:
            if name in self._ignored:
                continue
            try:
                workers.append(check_worker_id(name))
            except ValueError:
                self._ignored.add(name)
                log.warning("ignoring %s/%s: not a worker folder name", root, name)
        return workers

    def _list_worker(self, worker: str, nxt: dict[str, int], found: dict) -> None:
        wdir = self.layout.worker_shard_dir(worker)
        try:
            names = (
                os.listdir(wdir)
                if self._local
                else [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(wdir, detail=False)]
            )
        except (FileNotFoundError, NotADirectoryError):
            return
        start = top = nxt.get(worker, 0)
        present = set()
        for name in names:
            seq = RunLayout.shard_seq(name)
            if seq is None:
                continue
            top = max(top, seq + 1)
            present.add(seq)
            if not self._consumed.has(worker, seq):  # no key string per old shard name
                found[shard_key(worker, seq)] = (seq, f"{wdir}/{name}")
        nxt[worker] = top
        gaps = self._gaps.setdefault(worker, set())
        gaps.update(
            s for s in range(max(start, top - MAX_GAPS), top) if s not in present and not self._consumed.has(worker, s)
        )

    def _full_scan(self) -> dict[str, tuple[int, str]]:
        """List every worker folder (first poll, after a ledger change, and periodically)."""
        nxt = self._ledger_next() if self._next is None else dict(self._next)
        found: dict[str, tuple[int, str]] = {}
        for worker in self._worker_dirs():
            self._list_worker(worker, nxt, found)
        self._next = nxt
        self.stats["full_scans"] += 1
        return found

    def _probe(self) -> dict[str, tuple[int, str]]:
        """Stat each known worker's next expected shard (and the ones after it that exist)."""
        nxt = self._next
        found: dict[str, tuple[int, str]] = {}
        for worker in self._worker_dirs():
            if worker not in nxt:  # a new worker: list its folder once
                self._list_worker(worker, nxt, found)
        exists = os.path.exists if self._local else self.fs.exists
        for worker, gaps in self._gaps.items():
            for seq in sorted(gaps):
                if self._consumed.has(worker, seq) or exists(path := self.layout.shard(worker, seq)):
                    gaps.discard(seq)
                    if not self._consumed.has(worker, seq):
                        found[shard_key(worker, seq)] = (seq, path)
        for worker, seq in nxt.items():
            start = seq
            while True:
                path = self.layout.shard(worker, seq)
                if not exists(path):
                    break
                if not self._consumed.has(worker, seq):
                    found[shard_key(worker, seq)] = (seq, path)
                seq += 1
            if seq != start:
                nxt[worker] = seq
        return found

    # --- reading and checking ----------------------------------------------------------------
    def _ingest(self, key: str, path: str, current_version: int) -> None:
        worker, seq = RunLayout.parse_shard_key(key)
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:  # removed between listing and reading: nothing to consume
            self._pending.pop(key, None)
            self._failures.pop(key, None)
            self.stats["vanished_shards"] += 1
            log.warning("shard %s disappeared before it was read", path)
            return
        except OSError as e:  # e.g. an NFS hiccup: leave it unconsumed, the next poll retries
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            self.stats["read_retries"] += 1
            if failures < MAX_READ_ATTEMPTS:
                log.warning("could not read shard %s (%s); will retry", path, e)
                return
            self._consume(key)
            self._reject(worker, seq, path, e, size=None)
            return
        self._consume(key)
        try:
            table = load_shard(data, self.vocab_size)
            check_origin(table.schema.metadata or {}, worker, seq, path, self.run_id)
            check_rows_origin(table, worker, self.stats)
            check_not_future(table, current_version)
            samples = from_table(table)
        except (SchemaError, pa.ArrowException, ValueError, TypeError, KeyError) as e:
            self._reject(worker, seq, path, e, size=len(data), data=data)
            return
        self.stats["shards_read"] += 1
        if DECLARED_LOST_KEY in (table.schema.metadata or {}):  # its writer could not re-send it
            self.stats["declared_lost_shards"] += 1
            log.error("shard %s was declared lost by its worker (unacknowledged, its copy damaged)", key)
        groups: dict[str, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        for gid, members in groups.items():
            self.pool.append(Group(gid, members[0].weight_version, members, path))
            self.stats["group_size"] = max(self.stats["group_size"], len(members))

    def _consume(self, key: str) -> None:
        self._consumed.add(key)
        self._pending.pop(key, None)
        self._failures.pop(key, None)

    def _reject(
        self, worker: str, seq: int, path: str, err: Exception, size: int | None, data: bytes | None = None
    ) -> None:
        """Count a bad shard and its samples (retired: workers' backpressure must not wait for
        them) and move it to quarantine/ with a reason file; never raises."""
        self.stats["bad_shards"] += 1
        self.stats["quarantined_samples"] += _declared_samples(data, path)
        reason = f"{type(err).__name__}: {err}"
        log.error("rejected shard %s: %s", path, reason)
        try:
            dest = quarantine(self.fs, self.layout, worker, seq, path, reason, size)
        except OSError as e:
            log.error("could not move %s to quarantine (%s); it stays in place, skipped as consumed", path, e)
            return
        self.stats["quarantined_shards"] += 1
        log.error("moved %s to %s", path, dest)

    def _drop_stale(self, current_version: int) -> None:
        keep: collections.deque[Group] = collections.deque()
        for g in self.pool:
            if current_version - g.weight_version > self.max_staleness:
                self.stats["dropped_stale_samples"] += len(g.samples)
            else:
                keep.append(g)
        self.pool = keep

    def next_batch(
        self,
        num_groups: int,
        current_version: int,
        timeout_s: float,
        on_wait: Callable[[], object] = lambda: None,
        note_every_s: float = NOTE_EVERY_S,
    ) -> list[Group]:
        """The oldest `num_groups` groups within the staleness bound; waits up to `timeout_s`,
        calling `on_wait` after every poll (the trainer reports its progress from there), with a
        log line every `note_every_s` saying what it has, needs, and who produces."""
        start = time.monotonic()
        last_note = start
        before = collections.Counter(self.stats)
        while True:
            self._drop_stale(current_version)
            for key, path in self.discover():
                if len(self.pool) >= num_groups:
                    break  # the rest waits on disk: memory holds one step, not the backlog
                self._ingest(key, path, current_version)
                self._drop_stale(current_version)
            if len(self.pool) >= num_groups:
                batch = [self.pool.popleft() for _ in range(num_groups)]
                self.stats["consumed_samples"] += sum(len(g.samples) for g in batch)
                return batch
            on_wait()
            now = time.monotonic()
            if now - start >= timeout_s:
                raise TimeoutError(
                    f"waited {timeout_s:.0f} s (trainer.data_timeout_s) for "
                    + self._why_waiting(num_groups, before)
                    + f" Workers: {describe_workers(self.heartbeats)}"
                )
            if now - last_note >= note_every_s:
                log.info(
                    "waiting for experience: have %d/%d groups (%d samples; %d shards read, "
                    "%d stale samples dropped, %d bad shards) after %.0f s of %.0f; workers: %s",
                    len(self.pool),
                    num_groups,
                    sum(len(g.samples) for g in self.pool),
                    self.stats["shards_read"],
                    self.stats["dropped_stale_samples"],
                    self.stats["bad_shards"],
                    now - start,
                    timeout_s,
                    describe_workers(self.heartbeats),
                )
                last_note = now
            self._wake.wait(min(self.cfg.poll_interval, timeout_s - (now - start)))
            self._wake.clear()

    def _why_waiting(self, num_groups: int, before: collections.Counter) -> str:
        """What a waiting trainer sees: what it has, what it threw away while waiting, and what
        the workers say they wrote."""
        dropped = self.stats["dropped_stale_samples"] - before["dropped_stale_samples"]
        bad = self.stats["bad_shards"] - before["bad_shards"]
        try:
            size = f"{backlog(self.heartbeats, self.progress)} samples"
        except OSError as e:
            size = f"unknown ({e})"
        return (
            f"{num_groups} groups, have {len(self.pool)} in {self.layout.experience_dir}; "
            f"during this wait {dropped} samples dropped as stale (trainer.max_staleness="
            f"{self.max_staleness}) and {bad} shards quarantined; the workers' backlog "
            f"(written, not yet retired, per {self.layout.workers_dir}) is {size}. Are "
            f"rollout workers running, and do they reload new weights?"
        )


def read_groups(root: str, refs: list[GroupRef], vocab_size: int | None = None) -> list[Group]:
    """The groups `refs` name, in order, read from the run folder at `root` by a trainer rank
    that did not read the shards itself: each file read once and checked in full (trailer,
    schema, values), each group against the digest rank 0 took of it."""
    fs, _ = filesystem(root)
    files: dict[str, dict[str, list[Sample]]] = {}
    out = []
    for ref in refs:
        if ref.path not in files:
            try:
                table = load_shard(fs.cat_file(ref.path), vocab_size)
            except (OSError, SchemaError, pa.ArrowException) as e:
                raise RuntimeError(
                    f"cannot read group {ref.group_id} from {ref.path} ({type(e).__name__}: {e}); every trainer "
                    "rank reads its own groups, so every rank must see the run folder"
                ) from e
            files[ref.path] = {}
            for s in from_table(table):
                files[ref.path].setdefault(s.group_id, []).append(s)
        samples = files[ref.path].get(ref.group_id)
        if samples is None or group_digest(samples) != ref.digest:
            raise RuntimeError(
                f"group {ref.group_id} in {ref.path} is not the group trainer rank 0 dealt "
                f"({'absent' if samples is None else 'digest differs'}): the file changed after rank 0 read it"
            )
        out.append(Group(ref.group_id, samples[0].weight_version, samples, ref.path))
    return out


def _declared_samples(data: bytes | None, path: str) -> int:
    """The sample count a rejected shard's writer recorded, if its schema still parses (the
    IPC stream starts with it, so flipped bytes further on or a cut end leave it readable)."""
    try:
        meta = pa.ipc.open_stream(pa.py_buffer(data)).schema.metadata or {}
        return int(meta[b"tandem.num_samples"])
    except (pa.ArrowException, KeyError, ValueError, TypeError, OSError):
        log.warning(
            "the sample count of %s is unreadable: the backlog the workers see stays higher by its samples", path
        )
        return 0


def check_origin(meta: dict, worker: str, seq: int, path: str, run_id: str | None = None) -> None:
    """A shard must sit where its writer put it, and carry the run's id when `run_id` is given
    (catches files copied in from elsewhere, e.g. leftovers of another run)."""
    name = path.rsplit("/", 1)[-1]
    if name != f"{seq:09d}{SHARD_SUFFIX}":
        raise SchemaError(f"file name {name!r} is not a name a ShardWriter gives")
    w = meta.get(b"tandem.worker_id")
    q = meta.get(b"tandem.shard_seq")
    if (w is not None and w.decode() != worker) or (q is not None and q.decode() != str(seq)):
        raise SchemaError(
            f"foreign shard: written by worker {w and w.decode()} as seq {q and q.decode()}, found as {worker}/{seq}"
        )
    if run_id is not None:
        got = meta.get(RUN_ID_KEY)
        if got is None:
            raise SchemaError(
                f"no run id: written for another run (or by a tandem without run ids); this run is {run_id}"
            )
        if got.decode() != run_id:
            raise SchemaError(f"from another run: run id {got.decode()}, this run is {run_id}")


def check_rows_origin(table: pa.Table, worker: str, stats: collections.Counter | None = None) -> None:
    """Every row must be the shard's worker's: its worker_id, and a sample id under it. A shard
    re-encoded under another worker's key (or without its metadata) would otherwise hand the
    trainer the same sample ids twice. Counted in stats['foreign_row_shards']."""
    import pyarrow.compute as pc

    wrong_worker = pc.sum(pc.not_equal(table.column("worker_id"), worker)).as_py() or 0
    wrong_id = pc.sum(pc.invert(pc.starts_with(table.column("sample_id"), f"{worker}/"))).as_py() or 0
    if wrong_worker or wrong_id:
        if stats is not None:
            stats["foreign_row_shards"] += 1
        raise SchemaError(
            f"foreign rows: {wrong_worker} rows name another worker and {wrong_id} sample ids are"
            f" not under {worker}/, in a shard of {worker}"
        )


def check_not_future(table: pa.Table, current_version: int) -> None:
    """No sample may name a weight version the trainer has not published yet."""
    import pyarrow.compute as pc

    newest = pc.max(table.column("weight_version")).as_py()
    if newest is not None and newest > current_version:
        raise SchemaError(
            f"weight version {newest} is newer than the trainer's newest published "
            f"version v{current_version} (experience of another run?)"
        )


def quarantine(fs, layout: RunLayout, worker: str, seq: int, path: str, reason: str, size: int | None = None) -> str:
    """Move a rejected shard to quarantine/<worker>/ beside `<name>.reason.txt`; returns the
    new path. The reason file is written first, so a quarantined shard always has one."""
    dup = 0
    while fs.exists(dest := layout.quarantine_shard(worker, seq, dup)):
        dup += 1
    text = (
        f"shard: {path}\nkey: {shard_key(worker, seq)}\n"
        f"size_bytes: {size if size is not None else 'unknown'}\n"
        f"rejected_at: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
        f"reason: {reason}\n"
    )
    atomic_write(fs, layout.quarantine_reason(dest), text.encode())
    fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
    fs.mv(path, dest)
    return dest
