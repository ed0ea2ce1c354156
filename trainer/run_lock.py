"""One trainer per run folder: rank 0 holds an exclusive lock on `ROOT/trainer.lock`.

Two trainers on one folder (one started twice by mistake, or a restart while the old job still
runs) would both consume shards and both publish versions the workers load. The lock is a POSIX
record lock (`fcntl.lockf`): the kernel, or the NFS/Lustre lock manager, releases it when its
process dies, even by SIGKILL, so a restarted trainer never waits out a stale lease. The file
holds the holder's host, pid and start time, for the message a second trainer fails with.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time

log = logging.getLogger(__name__)
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLocked(RuntimeError):
    """Another trainer holds the run folder; the message names it."""


class RunLock:
    def __init__(self, fd: int | None, path: str):
        self.fd, self.path = fd, path

    @classmethod
    def acquire(cls, run) -> RunLock:
        """Take the lock of `run` (buffer.run.TrainerRun) or raise RunLocked naming the
        holder. Not blocking."""
        os.makedirs(run.root, exist_ok=True)
        path = run.files.trainer_lock
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise RunLocked(
                    f"{run.root} is held by the trainer pid {holder.get('pid', '?')} on host "
                    f"{holder.get('host', '?')} (since {holder.get('started', '?')}, {path}): one "
                    "trainer per run folder. Stop that one first, or use another root"
                ) from None
            if e.errno in _UNSUPPORTED:
                log.warning(
                    "%s: this filesystem does not support file locks (%s): one trainer per run folder is not enforced",
                    path,
                    e,
                )
                return cls(None, path)
            raise
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        return cls(fd, path)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}  # being written by its holder right now
