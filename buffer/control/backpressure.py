"""Backpressure: rollout workers must not run arbitrarily far ahead of the trainer.

backlog = (samples all workers have published, from their heartbeats)
        - (samples the trainer has retired: trained on, dropped as stale, or quarantined with
           their shard; from progress.json)
Reading one small file per worker keeps the cost proportional to the number of workers.

The trainer rewrites progress.json while it waits for experience too (`progress_report`), not
only per step: samples it drops as stale or quarantines while waiting must free room at once,
or workers wait for the trainer while the trainer waits for them. It also records the groups
one step takes (`batch_groups`): a worker's cap is never below one step's worth of its own
groups, so a step larger than `buffer.max_backlog_samples` still fills.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from buffer.control.base import HeartbeatStore, ProgressStore

log = logging.getLogger(__name__)
NOTE_EVERY_S = 30.0  # a waiting side says why at least this often


def retired(stats) -> int:
    """Samples the trainer is done with, from its reader's counters."""
    return stats["consumed_samples"] + stats["dropped_stale_samples"] + stats["quarantined_samples"]


def progress_report(
    stats, version: int, batch_groups: int, step: int | None = None, total_steps: int | None = None
) -> dict:
    """The trainer's ProgressStore entry; `step`, `total_steps`: the trainer's, for launch.status."""
    return {
        "samples_retired": retired(stats),
        "version": version,
        "batch_groups": batch_groups,
        "time": time.time(),
        "step": step,
        "total_steps": total_steps,
    }


def describe_workers(heartbeats: HeartbeatStore, now: float | None = None) -> str:
    """One phrase per worker for wait messages: id, state, age of its last heartbeat."""
    now = time.time() if now is None else now
    parts = [
        f"{b.get('worker_id', '?')} {b.get('state', '?')} (heartbeat {now - float(b.get('last_beat', 0)):.0f} s ago)"
        for b in heartbeats.all()
    ]
    return ", ".join(parts) if parts else f"no heartbeats in {heartbeats.where()}"


def _written(heartbeats: HeartbeatStore) -> int:
    return sum(int(b.get("samples_written", 0)) for b in heartbeats.all())


def backlog(heartbeats: HeartbeatStore, progress: ProgressStore) -> int:
    return _written(heartbeats) - int((progress.read() or {}).get("samples_retired", 0))


def wait_for_room(
    heartbeats: HeartbeatStore,
    progress: ProgressStore,
    limit: int,
    timeout_s: float,
    should_stop: Callable[[], bool],
    poll_s: float = 0.5,
    on_wait: Callable[[], object] = lambda: None,
    group_size: int = 1,
) -> float:
    """Block while the backlog exceeds the cap: `limit`, or one trainer step of `group_size`
    groups if that is more. Calls `on_wait` every poll (the worker's age-based flush); returns
    seconds waited."""
    start = last_note = time.monotonic()
    first = True
    while not should_stop():
        report = progress.read() or {}
        written, gone = _written(heartbeats), int(report.get("samples_retired", 0))
        cap = max(limit, int(report.get("batch_groups", 0)) * group_size)
        if written - gone <= cap:
            break
        now = time.monotonic()
        why = (
            f"backlog {written - gone} samples > {cap} (buffer.max_backlog_samples={limit}, "
            f"one trainer step: {report.get('batch_groups', '?')} groups of {group_size}): "
            f"{written} written by all workers, {gone} retired by the trainer, whose last "
            f"progress ({progress.where()}, version {report.get('version', '-')}) is "
            + (f"{time.time() - report['time']:.0f} s old" if "time" in report else "not there yet")
        )
        if now - start > timeout_s:
            raise TimeoutError(
                f"{why}; waited {timeout_s:.0f} s (buffer.backlog_timeout_s): is the trainer running and consuming?"
            )
        if first or now - last_note >= NOTE_EVERY_S:
            log.info("%s: waiting for the trainer to train or drop them", why)
            first, last_note = False, now
        on_wait()
        time.sleep(poll_s)
    return time.monotonic() - start
