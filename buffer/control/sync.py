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

Both roles go through this module: the trainer's `TrainerRounds` (is the run synchronous, what to
announce with a version, opening and retiring versions, what to say when groups never come) and
the worker's `WorkerRounds` (is the loaded version synchronous, claiming its share, waiting for
the next version). Nothing else reads SYNC_GROUPS.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from buffer.control.base import SyncClaims, SyncRounds
from protocol.weights import SYNC_GROUPS

log = logging.getLogger(__name__)

POLL_S = 0.05  # a worker's look at weights/LATEST while it waits: one small read (~20 us locally)
NOTE_S = 30.0  # period of the "still waiting" line


class TrainerRounds:
    """The trainer's side. `enabled`: trainer.max_staleness=0; `local`: the run folder is a
    mounted filesystem, which exclusive file creation (the claims) needs."""

    def __init__(self, rounds: SyncRounds, enabled: bool, local: bool, root: str):
        if enabled and not local:
            raise ValueError(
                f"trainer.max_staleness=0 (synchronous rollouts) needs root={root} "
                "on a mounted filesystem (local, NFS, Lustre): workers claim each "
                "version's groups by exclusive file creation there"
            )
        self.rounds, self.enabled = rounds, enabled

    def announce(self, version: int, groups: int, opener: bool) -> dict | None:
        """What weights/LATEST says with `version` (None: asynchronous): the `groups` it trains
        on with it. The `opener` (rank 0) makes the version claimable first."""
        if not self.enabled:
            return None
        if opener:
            self.rounds.open_version(version)
        return {SYNC_GROUPS: groups}

    def published(self, version: int, opener: bool) -> None:
        """After `version` is announced: the older versions can no longer be claimed."""
        if self.enabled and opener:
            self.rounds.retire_before(version)

    def why_missing(self, version: int) -> str:
        """What to add to a timeout while waiting for `version`'s groups ('' when asynchronous)."""
        if not self.enabled:
            return ""
        claimed = self.rounds.claims(version)
        return (
            f". Synchronous mode: {len(claimed)} of the groups of v{version} were claimed, by "
            f"{sorted(set(claimed.values())) or 'no worker'} ({self.rounds.where(version)})"
        )


class WorkerRounds:
    """A worker's side: `groups` is the number of groups of the loaded version to claim, or None
    while the trainer runs asynchronously; the worker follows each pointer it loads by."""

    def __init__(self, claims: SyncClaims, worker_id: str):
        self.claims, self.worker_id = claims, worker_id
        self.groups: int | None = None

    @property
    def on(self) -> bool:
        return self.groups is not None

    def follow(self, pointer: dict, loaded: int | None) -> None:
        """Synchronous mode is on exactly when the trainer's LATEST pointer says so; a pointer
        that names a version other than the `loaded` one gives it nothing to claim (the worker
        reloads first)."""
        if SYNC_GROUPS not in pointer:
            self.groups = None
        else:
            self.groups = pointer[SYNC_GROUPS] if pointer.get("version") == loaded else 0

    def claim(self, version: int, per_batch: int) -> int:
        """Claim this worker's share (at most `per_batch`) of `version`'s groups; how many it got."""
        want = self.claims.share(self.groups, per_batch)
        return self.claims.claim(version, self.groups, want, self.worker_id)

    def wait_newer(
        self, latest: Callable[[], int | None], version: int, timeout_s: float, should_stop: Callable[[], bool]
    ) -> float:
        """After the last group of `version`: block until `latest()` is newer or `should_stop()`;
        returns seconds waited. TimeoutError after `timeout_s` (the trainer is presumed dead)."""
        what = f"worker {self.worker_id}"
        start = last_note = time.monotonic()
        while not should_stop():
            newest = latest()
            if newest is not None and newest > version:
                break
            now = time.monotonic()
            if now - start > timeout_s:
                raise TimeoutError(
                    f"{what}: no weight version newer than v{version} for "
                    f"{timeout_s:.0f} s (buffer.backlog_timeout_s): is the trainer "
                    f"running? (synchronous mode, trainer.max_staleness=0)"
                )
            if now - last_note >= NOTE_S:
                log.info(
                    "%s: synchronous mode, waiting for weights newer than v%d (%.0f s)", what, version, now - start
                )
                last_note = now
            time.sleep(POLL_S)
        return time.monotonic() - start
