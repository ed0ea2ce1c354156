"""Worker side of experience: buffer whole groups, encode shards, hand them to the run's
ExperienceSink (a shared folder or gRPC: buffer/experience/base.py). On the top floor of buffer/
beside buffer/run.py, whose factory `ShardWriter.at` uses."""

from __future__ import annotations

import logging
import threading
import time
import types

import pyarrow as pa

from buffer.config import BufferConfig
from buffer.experience.base import ExperienceSink
from buffer.run import setup_worker_run
from buffer.storage import when_space
from protocol.experience import DECLARED_LOST_KEY, Sample, check_rows, encode, to_table

log = logging.getLogger(__name__)


class ShardWriter:
    """Publishes one worker's shards through its ExperienceSink, one per flush, seq contiguous.

    Each shard is `protocol.experience.encode` output (IPC stream + sha256 trailer); the sink
    makes it reach the trainer whole or not at all (filesystem: temp, fsync, rename into
    `experience/<worker>/<seq>.arrow`; gRPC: pushed until acknowledged).

    A flush is triggered by sample count or by age (`flush_interval`), checked whenever a group
    is added or `maybe_flush` is called. Groups are never split across shards. The writer names
    groups and samples after the shard they land in (`<worker>/<seq>/<group>/<k>`).

    Restarts never reuse a shard number, even one the trainer consumed and retention deleted
    (the trainer would skip the new shard as consumed: its samples lost). Before publishing shard
    N the writer durably claims it (the sink's claim, `workers/<worker>.claim` in the worker's own
    folder): `next_seq` N+1, `fill_from` the
    lowest number that may still be unpublished (N; over gRPC the oldest unacknowledged shard)
    and `samples_before`. A restarted writer continues after the claim (for a run without one:
    after its last heartbeat `resume`, plus any shard published after it). A number in
    [fill_from, next_seq) that is not on disk was either never published (the kill came first)
    or consumed (only consumed shards are deleted, archived or quarantined); the restarted writer
    publishes an empty shard under it, which closes the gap the trainer's ledger would otherwise
    wait on for ever, and which the trainer skips if the number was consumed. So shard keys and
    sample ids are unique across restarts.

    Over gRPC "published" means acknowledged: a heartbeat's next_seq proves nothing there
    (`sink.settled`), and the shards the trainer never acknowledged wait in the worker's outbox:
    the restarted writer re-sends them (`sink.recover`), and publishes each it cannot (a damaged
    copy) as an empty shard marked `tandem.declared_lost`, counted by the trainer.
    """

    def __init__(
        self,
        sink: ExperienceSink,
        worker_id: str,
        cfg: BufferConfig,
        resume: dict | None = None,
        run_id: str | None = None,
    ):
        self.sink = sink
        self.worker_id = worker_id
        self.cfg = cfg
        self._lock = threading.RLock()  # the worker flushes by age from another thread
        self.pending: list[Sample] = []
        self.pending_groups = 0
        self.oldest_pending: float | None = None
        self.shards_written = 0
        self.run_id = run_id  # stamped on every shard; the worker sets it once the run exists
        # Samples of each shard this writer published from the oldest that may still be
        # unpublished (over gRPC: unacknowledged) on: a claim's samples_before leaves them out,
        # since a restart counts them when it lists them.
        self._unsure_samples: dict[int, int] = {}
        self._resume(resume or {})

    @classmethod
    def at(cls, root: str, worker_id: str, cfg: BufferConfig, resume: dict | None = None) -> ShardWriter:
        """A writer into the run at `root` over `cfg.transport` (tests, benchmarks)."""
        run = setup_worker_run(types.SimpleNamespace(root=root, buffer=cfg))
        return cls(run.sink(worker_id), worker_id, cfg, resume, run_id=run.state.run_id())

    def _resume(self, beat: dict) -> None:
        claim = self.sink.read_claim() or {}
        if claim:  # samples before `base` are counted; shards from `base` on are listed
            base, counted = int(claim["fill_from"]), int(claim["samples_before"])
        else:
            base, counted = int(beat.get("next_seq", 0)), int(beat.get("samples_written", 0))
        listed = [s for s in self.sink.published() if s >= base]
        for seq in listed:  # published after the claim or heartbeat, before a crash
            try:
                self._unsure_samples[seq] = n = self.sink.samples_in(seq)
                counted += n
            except (OSError, pa.ArrowException, KeyError, ValueError, TypeError) as e:
                # damaged, or quarantined/pruned meanwhile: never reuse its name, count nothing
                log.warning("cannot count the samples of shard %d of %s: %s", seq, self.worker_id, e)
        self._lost = self.sink.recover()  # listed, but cannot be handed over again
        # The heartbeat counts only published shards: never less than what it says.
        self.samples_written = max(counted, int(beat.get("samples_written", 0)))
        claimed = int(claim.get("next_seq", 0))
        self.seq = max([base, claimed, int(beat.get("next_seq", 0)), *(s + 1 for s in listed)])
        published = self.sink.settled(int(beat.get("next_seq", 0)))
        self._gaps = [s for s in range(max(base, published), claimed) if s not in set(listed)]

    def _claim(self, seq: int) -> None:
        """Durably reserve `seq` before its shard can appear anywhere (see the class doc)."""
        fill_from = self.sink.unsure_from(seq)
        self._unsure_samples = {s: n for s, n in self._unsure_samples.items() if s >= fill_from}
        self.sink.write_claim(
            {
                "next_seq": seq + 1,
                "fill_from": fill_from,
                "samples_before": self.samples_written - sum(self._unsure_samples.values()),
            }
        )

    def _fill_gaps(self) -> None:
        """Empty shards under the numbers a killed predecessor claimed but may not have
        published (see the class doc); before this writer's first own shard."""
        for seq in self._gaps:
            if not self.sink.has(seq):
                self.sink.publish(seq, self._encode(seq, []))
                log.info(
                    "published an empty shard %d of %s: claimed before a restart, not published", seq, self.worker_id
                )
        self._gaps = []
        while self._lost:  # one at a time: a full disk retries only what is left
            seq = self._lost[0]
            self.sink.publish(seq, self._encode(seq, [], declared_lost=True))
            log.warning("declared shard %d of %s lost (its copy could not be re-sent)", seq, self.worker_id)
            self._lost.pop(0)

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

    def close(self, timeout_s: float = 60.0) -> None:
        """Flush, then close the sink (over gRPC: wait up to `timeout_s` for the
        acknowledgements), also when the flush fails (a sender left retrying would keep the
        process from exiting)."""
        try:
            self.flush()
        finally:
            self.sink.close(timeout_s)

    def _encode(self, seq: int, samples: list[Sample], declared_lost: bool = False) -> bytes:
        meta: dict[str, object] = {
            "tandem.worker_id": self.worker_id,
            "tandem.shard_seq": seq,
            "tandem.num_samples": len(samples),
            "tandem.created_at": time.time(),
        }
        if self.run_id is not None:
            meta["tandem.run_id"] = self.run_id
        if declared_lost:
            meta[DECLARED_LOST_KEY.decode()] = 1
        if samples:
            versions = [s.weight_version for s in samples]
            meta |= {"tandem.min_weight_version": min(versions), "tandem.max_weight_version": max(versions)}
        return encode(to_table(samples, meta))

    def flush(self) -> str | None:
        with self._lock:
            return self._flush()

    def _flush(self) -> str | None:
        if not self.pending:
            return None
        if self._gaps or self._lost:
            when_space(self._fill_gaps, self.sink.where())
        data = self._encode(self.seq, self.pending)

        def claim_and_publish() -> str:
            self._claim(self.seq)
            return self.sink.publish(self.seq, data)

        # On a full disk the samples wait here, in memory, until there is space again.
        path = when_space(claim_and_publish, self.sink.where())
        self.samples_written += len(self.pending)
        self._unsure_samples[self.seq] = len(self.pending)
        self.shards_written += 1
        log.info("published %s (%d samples)", path, len(self.pending))
        self.pending = []
        self.pending_groups = 0
        self.seq += 1
        return path
