"""Synchronous rollouts (`trainer.max_staleness=0`): every batch is sampled by the newest weights.

The trainer announces, with each weight version, how many prompt groups it will train on with
that version (`protocol.weights.SYNC_GROUPS` in weights/LATEST: data.train_batch_size per step
until the next publish; 0 for the final version). A worker that has loaded the version claims
slots 0..groups-1 of it by creating `sync/v<N>/<slot>` exclusively (O_CREAT|O_EXCL: exactly one
creator wins, on a local disk and on NFSv3+/Lustre), generates one group per claimed slot,
flushes, and claims again until none is left; then it waits for the next version. So the
trainer receives exactly the announced groups of each version, from any number of workers and
over either transport (shards travel as usual; only the claims and the weights use the run
folder, as the weights always do): staleness 0, nothing dropped, nothing left over.

The trainer creates `sync/v<N>/` before it announces the version and, once it announces a newer
one, retires the older folders by renaming each away before removing it, so a worker that still
tries to claim a slot of an old version finds no folder and claims nothing (a rename is atomic;
an rmtree alone could let a claim in between its unlink and its rmdir).

A worker that dies after claiming slots leaves them unfilled: the trainer then fails after
trainer.data_timeout_s, naming the claims (`claims`). Restarting the run resumes from its
checkpoint under a fresh version.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import time
from typing import Callable

from buffer.backpressure import heartbeats
from buffer.layout import RunLayout

log = logging.getLogger(__name__)

POLL_S = 0.05  # a worker's look at weights/LATEST while it waits: one small read (~20 us locally)
NOTE_S = 30.0  # period of the "still waiting" line
LIVE_BEAT_S = 300.0  # a heartbeat newer than this counts its worker in the share (launch.status's
# silent-after); a dead worker only shrinks the others' chunks for a while, never loses groups


def open_version(layout: RunLayout, version: int) -> None:
    """Trainer: the empty claim folder of `version`, before LATEST names it."""
    os.makedirs(layout.sync_version_dir(version), exist_ok=True)


def retire_before(layout: RunLayout, version: int) -> int:
    """Trainer: remove the claim folders of versions older than `version`; returns how many."""
    try:
        names = os.listdir(layout.sync_dir)
    except FileNotFoundError:
        return 0
    retired = 0
    for name in names:
        old = RunLayout.version_of(name)
        if old is None or old >= version:
            continue
        trash = os.path.join(layout.sync_dir, f".retired-{name}-{os.getpid()}")
        try:
            os.rename(os.path.join(layout.sync_dir, name), trash)
        except FileNotFoundError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
        retired += 1
    return retired


def claims(layout: RunLayout, version: int) -> dict[int, str]:
    """Slot -> the worker that claimed it (what the trainer names when a batch never comes)."""
    folder = layout.sync_version_dir(version)
    out = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        if name.isdigit():
            try:
                with open(os.path.join(folder, name)) as f:
                    out[int(name)] = f.read().strip()
            except FileNotFoundError:
                continue
    return out


def claim(layout: RunLayout, version: int, groups: int, want: int, worker_id: str) -> int:
    """Worker: claim up to `want` of the `groups` slots of `version`; returns how many it got
    (0: all taken, or the version is retired)."""
    folder = layout.sync_version_dir(version)
    try:
        taken = set(os.listdir(folder))
    except FileNotFoundError:
        return 0
    got = 0
    for slot in range(groups):
        if got == want:
            break
        path = layout.sync_claim(version, slot)
        if os.path.basename(path) in taken:
            continue
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:  # another worker was first
            continue
        except FileNotFoundError:  # retired meanwhile: the trainer has moved on
            break
        with os.fdopen(fd, "w") as f:
            f.write(worker_id + "\n")
        got += 1
    return got


def share(fs, layout: RunLayout, groups: int, per_batch: int, now: float | None = None) -> int:
    """How many slots one worker claims at a time: an equal share among the live workers (their
    heartbeats), at most `per_batch` (the engine's batch). Balance only: correctness never
    depends on it, a worker claims again while slots are left."""
    now = time.time() if now is None else now
    live = sum(1 for b in heartbeats(fs, layout)
               if b.get("state") != "stopped" and now - b.get("last_beat", 0) < LIVE_BEAT_S)
    return max(1, min(per_batch, math.ceil(groups / max(live, 1))))


def wait_newer(latest: Callable[[], int | None], version: int, timeout_s: float,
               should_stop: Callable[[], bool], what: str) -> float:
    """Block until `latest()` is newer than `version` or `should_stop()`; returns seconds waited.
    Raises TimeoutError after `timeout_s` (the trainer is presumed dead)."""
    start = last_note = time.monotonic()
    while not should_stop():
        newest = latest()
        if newest is not None and newest > version:
            break
        now = time.monotonic()
        if now - start > timeout_s:
            raise TimeoutError(f"{what}: no weight version newer than v{version} for "
                               f"{timeout_s:.0f} s (buffer.backlog_timeout_s): is the trainer "
                               f"running? (synchronous mode, trainer.max_staleness=0)")
        if now - last_note >= NOTE_S:
            log.info("%s: synchronous mode, waiting for weights newer than v%d (%.0f s)",
                     what, version, now - start)
            last_note = now
        time.sleep(POLL_S)
    return time.monotonic() - start
