"""The run folder as a Run (buffer/run.py): the filesystem stores of buffer/stores/fs.py, plus the
trainer's own stores, which only exist on the folder (weights publishing, checkpoints, the
experience reader). Importing this module registers it as `buffer.transport=fs`."""
from __future__ import annotations

import functools

import fsspec

from buffer.layout import RunLayout
from buffer.run import Run, register, server_for
from buffer.storage import filesystem, is_local
from buffer.stores.checkpoints import FsCheckpoints
from buffer.stores.fs import (FsControl, FsExperienceSink, FsHeartbeats, FsProgress, FsRunState,
                              FsSpool, FsSyncClaims, FsValidation, FsWeightSource)


class FsRun(Run):
    """The run folder: every store on it, plus the trainer's own (filesystem only):
    `publisher` (weight versions), `checkpoints`, `reader(...)` (experience), and `files`, the
    folder's other file names (metrics, logs, inputs, lock) for the trainer and the tools that
    work on the folder itself (launch/*)."""
    fs: fsspec.AbstractFileSystem
    files: RunLayout
    spool: FsSpool

    @classmethod
    def at(cls, root: str, buffer=None) -> "FsRun":
        fs, path = filesystem(root)
        layout = RunLayout(path)
        heartbeats = FsHeartbeats(fs, layout)
        progress = FsProgress(fs, layout)
        run = cls(root=root, transport="fs", weights=FsWeightSource(fs, layout),
                  heartbeats=heartbeats, progress=progress, state=FsRunState(fs, layout),
                  sync=FsSyncClaims(layout, heartbeats), control=FsControl(fs, layout),
                  validation=FsValidation(fs, layout),
                  make_sink=lambda worker_id: FsExperienceSink(fs, layout, worker_id,
                                                               heartbeats, progress))
        run.fs, run.files, run.spool = fs, layout, FsSpool(fs, layout)
        return run

    @functools.cached_property
    def publisher(self):
        """The trainer's WeightStore (buffer/stores/weights.py): publish, prune, read."""
        from buffer.stores.weights import WeightStore  # torch: only where weights are published
        return WeightStore(self.root)

    @functools.cached_property
    def checkpoints(self):
        return FsCheckpoints(self.files)

    def reader(self, cfg, max_staleness: int, **kwargs):
        """The trainer's ExperienceReader of experience/ (buffer/stores/reader.py)."""
        from buffer.stores.reader import ExperienceReader
        return ExperienceReader(self.root, cfg, max_staleness, **kwargs)

    def serve(self, buffer, **hooks):
        """Trainer rank 0: serve this folder to the other roles over `buffer.transport`; None
        when they share it (fs). `hooks` (callables): consumed() -> the reader's ledger,
        retired() -> samples retired, step_samples() -> samples one step takes."""
        server = server_for(buffer.transport)
        return None if server is None else server(self, buffer, **hooks)

    def is_local(self) -> bool:
        """A mounted filesystem (local, NFS, Lustre), not an object store."""
        return is_local(self.fs)


register("fs", FsRun.at)
