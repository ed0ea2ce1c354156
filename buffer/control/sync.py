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

The claims are the run's SyncClaims store (buffer/control/fs.py: `sync/v<N>/<slot>` files). A
worker that dies after claiming slots leaves them unfilled: the trainer then fails after
trainer.data_timeout_s, naming the claims (`SyncClaims.claims`). Restarting the run resumes from its
checkpoint under a fresh version.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger(__name__)

POLL_S = 0.05  # a worker's look at weights/LATEST while it waits: one small read (~20 us locally)
NOTE_S = 30.0  # period of the "still waiting" line


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
