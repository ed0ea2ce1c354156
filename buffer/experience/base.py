"""Experience, the workers' producer side and the trainer's consumer side.

A worker's `buffer.writer.ShardWriter` hands each encoded shard to its `ExperienceSink`; the
trainer's `ExperienceSource` (buffer/experience/reader.py) reads the shards of every worker
exactly once into groups for its steps. Media: the run folder (buffer/experience/fs.py, shards
renamed into experience/<worker>/) and the network (buffer/experience/net_client.py pushes
shards to buffer/experience/net_server.py on the trainer, which spools them into the same
folder the reader reads).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from buffer.control.base import ShouldStop


class WorkerIdInUse(RuntimeError):
    """Another live process writes shards under this worker id; the message names it."""


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
    def settled(self, beat_next_seq: int) -> int:
        """Below which shard number a previous writer's heartbeat `next_seq` says every shard
        reached the trainer: that number on a filesystem (the heartbeat names published shards
        only), 0 over gRPC (it counts shards never acknowledged)."""

    @abc.abstractmethod
    def recover(self) -> list[int]:
        """At a restart, hand over again what a previous writer of this worker published that the
        trainer may not have (over gRPC: the outbox); returns the shard numbers it cannot
        (damaged copies), which the writer declares lost. A filesystem has nothing to resend."""

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
    def wait_for_room(
        self,
        limit: int,
        timeout_s: float,
        should_stop: ShouldStop,
        on_wait: Callable[[], object] = lambda: None,
        group_size: int = 1,
    ) -> float:
        """Block while the worker may not produce more (backpressure): while the run's backlog
        (samples written by all workers - samples the trainer retired) is above max(`limit`,
        one trainer step of `group_size`-sample groups), from the run folder or the run
        service; over gRPC also while the trainer refuses our shards (RESOURCE_EXHAUSTED).
        Calls `on_wait()` every poll; returns seconds waited; raises TimeoutError after `timeout_s`."""

    @abc.abstractmethod
    def where(self) -> str:
        """Where shards go (a folder or an address), for messages."""

    @abc.abstractmethod
    def close(self, timeout_s: float = 60.0) -> None:
        """After the writer's last flush: wait (at most `timeout_s`) until every shard has reached the
        trainer, then release threads and channels. Raises when shards were refused or are
        still unacknowledged at the deadline (never when the run has ended meanwhile)."""


class ExperienceSource(abc.ABC):
    """The trainer's side: every worker's shards, each consumed exactly once."""

    @abc.abstractmethod
    def next_batch(
        self, num_groups: int, current_version: int, timeout_s: float, on_wait: Callable[[], object] = lambda: None
    ) -> list:
        """The oldest `num_groups` whole groups within the staleness bound of
        `current_version`, waiting up to `timeout_s` (TimeoutError after), calling `on_wait()`
        after every poll."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop watching for new shards."""
