"""The trainer's checkpoint folders in a run (or SFT output) folder: checkpoints/step_<N>/, each
written under a hidden temporary name and committed by one rename (trainer/checkpoint.py writes
their contents with torch.distributed.checkpoint)."""

from __future__ import annotations

import dataclasses
import os
import shutil

from buffer.layout import TMP_MARK, RunLayout
from buffer.storage import fsync_tree

STATE_FILE = "trainer_state.json"  # rank 0's: step, weight version, ledger, counters
POOL_FILE = "pool.arrow"  # groups read but not yet trained (RL checkpoints only)


def state_file(folder: str) -> str:
    """A checkpoint folder's trainer state (present only once the folder is complete)."""
    return os.path.join(folder, STATE_FILE)


def pool_file(folder: str) -> str:
    return os.path.join(folder, POOL_FILE)


@dataclasses.dataclass(frozen=True)
class FsCheckpoints:
    layout: RunLayout

    @property
    def dir(self) -> str:
        return self.layout.checkpoints_dir

    def path(self, step: int) -> str:
        return self.layout.checkpoint(step)

    def tmp(self, step: int, owner: str) -> str:
        """Where `owner` (the trainer's "<host>-<pid>") writes step `step` before the commit."""
        return self.layout.checkpoint_tmp(step, owner)

    @staticmethod
    def step_of(path: str | None) -> int | None:
        return None if path is None else RunLayout.checkpoint_step(path)

    def steps(self) -> list[int]:
        """Steps with a committed folder, ascending."""
        names = os.listdir(self.dir) if os.path.isdir(self.dir) else []
        return sorted(s for s in map(RunLayout.checkpoint_step, names) if s is not None)

    def latest_complete(self) -> str | None:
        complete = [s for s in self.steps() if os.path.isfile(state_file(self.path(s)))]
        return self.path(complete[-1]) if complete else None

    def commit(self, tmp: str, step: int, keep: int) -> str:
        """Rank 0, once every rank's shard is written: fsync, rename into place (the commit),
        then keep only the newest `keep`. Returns the committed folder."""
        final = self.path(step)
        fsync_tree(tmp)
        if os.path.exists(final):  # of a timeline this run resumed before (resume_mode=PATH)
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in self.steps()[:-keep]:
            shutil.rmtree(self.path(old), ignore_errors=True)
        return final

    def remove_debris(self) -> None:
        """Temporary folders of saves that were killed: the run lock (trainer/run_lock.py) makes
        this trainer the only writer of the run, so any temporary folder is debris."""
        for name in os.listdir(self.dir) if os.path.isdir(self.dir) else []:
            if name.startswith(".step_") and TMP_MARK in name:
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)
