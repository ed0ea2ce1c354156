"""Backpressure: rollout workers must not run arbitrarily far ahead of the trainer.

backlog = (samples all workers have published, from their heartbeats)
        - (samples the trainer has retired: trained on or dropped as stale, from progress.json)
Reading one small file per worker keeps the cost proportional to the number of workers.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable, Iterator

from buffer.layout import RunLayout
from buffer.storage import read_json

log = logging.getLogger(__name__)


def heartbeats(fs, layout: RunLayout) -> Iterator[dict]:
    """Every worker's last heartbeat (workers/<id>.json, one small file each) that can be read now."""
    if fs.exists(layout.workers_dir):
        for path in sorted(fs.ls(layout.workers_dir, detail=False)):
            if path.endswith(".json"):
                try:
                    beat = json.loads(fs.cat_file(path))
                except (FileNotFoundError, ValueError):
                    continue  # a heartbeat being replaced or removed; the next look sees it
                if isinstance(beat, dict):
                    yield beat


def describe_workers(fs, layout: RunLayout, now: float | None = None) -> str:
    """One phrase per worker for wait messages: id, state, age of its last heartbeat."""
    now = time.time() if now is None else now
    parts = [f"{b.get('worker_id', '?')} {b.get('state', '?')} (heartbeat "
             f"{now - float(b.get('last_beat', 0)):.0f} s ago)" for b in heartbeats(fs, layout)]
    return ", ".join(parts) if parts else f"no heartbeats in {layout.workers_dir}"


def backlog(fs, layout: RunLayout) -> int:
    written = sum(int(b.get("samples_written", 0)) for b in heartbeats(fs, layout))
    progress = read_json(fs, layout.progress) or {}
    return written - int(progress.get("samples_retired", 0))


def wait_for_room(fs, layout: RunLayout, limit: int, timeout_s: float,
                  should_stop: Callable[[], bool], poll_s: float = 0.5) -> float:
    """Block while the backlog exceeds `limit`; returns seconds waited."""
    start = time.monotonic()
    noted = False
    while (size := backlog(fs, layout)) > limit and not should_stop():
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise TimeoutError(f"backlog of {size} samples stayed above buffer.max_backlog_samples="
                               f"{limit} for {timeout_s:.0f} s: is the trainer consuming? "
                               f"(its progress: {layout.progress})")
        if not noted:
            log.info("backlog %d samples > %d: waiting for the trainer", size, limit)
            noted = True
        time.sleep(poll_s)
    return time.monotonic() - start
