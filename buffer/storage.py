"""Atomic publication on a shared filesystem, through fsspec.

`rename` is the only atomic publish that Lustre and NFS give: write to a temporary name in the
same folder, flush and fsync, then rename. A reader that lists the folder sees either nothing or
the whole file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_TIMEOUT_S = 3600.0  # a role waits this long for space before it fails
DISK_FULL_NOTE_S = 60.0


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_FULL


def when_space(action, path: str, timeout_s: float = DISK_FULL_TIMEOUT_S):
    """`action()`; while it fails because the disk (or quota) is full, say "disk full at PATH",
    wait (1 s, doubling to 30 s) and try again, until `timeout_s` has passed: a full disk is
    usually freed by someone, and every role must outlive that. `action` must leave nothing
    behind when it fails (atomic_writer removes its temporary file)."""
    start = time.monotonic()
    noted, wait = -DISK_FULL_NOTE_S, 1.0
    while True:
        try:
            return action()
        except OSError as e:
            if not is_disk_full(e):
                raise
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise OSError(e.errno, f"disk full at {path} for {waited:.0f} s: giving up ({e.strerror})") from e
            if waited - noted >= DISK_FULL_NOTE_S:
                log.warning(
                    "disk full at %s (%s): waiting for space (retrying with backoff up to 30 s, for at most %.0f s)",
                    path,
                    e.strerror,
                    timeout_s,
                )
                noted = waited
            time.sleep(wait)
            wait = min(wait * 2, 30.0)


class LockHeld(RuntimeError):
    """Another live process holds the lock; `holder` is what it wrote ({host, pid, started})."""

    def __init__(self, message: str, holder: dict):
        super().__init__(message)
        self.holder = holder


_HELD: dict[str, int] = {}  # path -> fd of the locks this process holds (never closed)
_HELD_GUARD = threading.Lock()
_LOCK_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def hold_lock(path: str, what: str, wait_s: float, note_s: float = 10.0) -> bool:
    """Hold an exclusive POSIX record lock (`fcntl.lockf`) on `path` for the rest of this
    process's life (the kernel, or the NFS lock manager, drops it when the process dies, even by
    SIGKILL). A holder still exiting (a pool restarting a worker) is waited for, up to `wait_s`,
    saying so every `note_s`; then LockHeld names its pid and host. The lock is per process:
    taking it again in the holder returns at once. False where the filesystem has no locks."""
    with _HELD_GUARD:
        if path in _HELD:
            return True
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _lock_waiting(fd, path, what, wait_s, note_s):
                os.close(fd)
                return False
        except BaseException:
            os.close(fd)
            raise
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        _HELD[path] = fd  # closing any fd of the file would drop the process's lock: never closed
        return True


def release_lock(path: str) -> None:
    """Drop a lock `hold_lock` took (a writer closed: its worker id is free again)."""
    with _HELD_GUARD:
        fd = _HELD.pop(path, None)
    if fd is not None:
        os.close(fd)


def _lock_waiting(fd: int, path: str, what: str, wait_s: float, note_s: float) -> bool:
    start = noted = time.monotonic()
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in _LOCK_UNSUPPORTED:
                log.warning("%s: no file locks on this filesystem (%s): %s is not enforced", path, e, what)
                return False
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise
        holder = _lock_holder(fd)
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('started', '?')})"
        waited = time.monotonic() - start
        if waited >= wait_s:
            raise LockHeld(f"{what}: held by {who} ({path}); waited {waited:.0f} s", holder)
        if time.monotonic() - noted >= note_s:
            log.warning("%s: waiting for %s to exit (%s; at most %.0f s)", what, who, path, wait_s)
            noted = time.monotonic()
        time.sleep(min(0.1, wait_s))


def _lock_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}  # being written by its holder right now


def filesystem(root: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for a run root (a local path or a URL) and the root's path in it."""
    fs, path = fsspec.core.url_to_fs(root)
    return fs, path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(fs: fsspec.AbstractFileSystem, path: str, tmp: str | None = None):
    """A binary file to write `path` through, piece by piece: it appears under `path` (fsynced)
    only if the block ends without an exception; otherwise the temporary file is removed."""
    tmp = tmp or f"{path}.tmp-{os.getpid()}"
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(tmp.rsplit("/", 1)[0], exist_ok=True)  # `path`'s folder only once it is whole
    local = is_local(fs)
    try:
        with open(tmp, "wb") if local else fs.open(tmp, "wb") as f:
            yield f
            if local:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            fs.rm_file(tmp)
        raise
    fs.makedirs(parent, exist_ok=True)
    if local:
        os.replace(tmp, path)
        _fsync_dir(parent)
    else:
        fs.mv(tmp, path)


def atomic_write(fs: fsspec.AbstractFileSystem, path: str, data: bytes, tmp: str | None = None) -> None:
    """Write `data` to `path` so that readers never see a partial file."""
    with atomic_writer(fs, path, tmp) as f:
        f.write(data)


def create_new(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """Publish `data` under `path` only if nothing is there yet; False if something is.

    Locally (and on NFS and Lustre) a hard link of a finished temporary file is atomic and
    refuses an existing name, so of concurrent creators exactly one wins and readers never see
    a partial file. Other fsspec filesystems have no such primitive: there it is check-then-move,
    which two creators racing within milliseconds can both pass."""
    if not is_local(fs):
        if fs.exists(path):
            return False
        atomic_write(fs, path, data)
        return True
    tmp = f"{path}.tmp-{os.getpid()}"
    atomic_write(fs, tmp, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    _fsync_dir(path.rsplit("/", 1)[0])
    return True


def atomic_write_json(fs: fsspec.AbstractFileSystem, path: str, obj) -> None:
    atomic_write(fs, path, (json.dumps(obj, sort_keys=True) + "\n").encode())


def read_json(fs: fsspec.AbstractFileSystem, path: str):
    """Parsed JSON at `path`, or None when the file does not exist."""
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None


def umask() -> int:
    """The process's file mode creation mask (read without changing it where Linux allows)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, hence the above)
    os.umask(mask)
    return mask


def respect_umask(path: str) -> None:
    """Give the files and folders under a local `path` the modes a plain `open`/`mkdir` would
    (0666/0777 less the umask). safetensors writes 0600, unreadable for the other users of a
    shared cluster whatever their umask says."""
    mask = umask()
    for dirpath, _dirs, files in os.walk(path):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~mask)


def fsync_tree(path: str) -> None:
    """fsync every file and folder under a local path (before renaming the folder into place)."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb+") as f:
                os.fsync(f.fileno())
        _fsync_dir(dirpath)


class _StopRace(logging.Filter):
    """watchdog's inotify emitter logs an ERROR ("queue_events() called when the thread is
    inactive") when an event arrives while its observer stops: a race inside watchdog, harmless
    when we stop the observer on purpose, and otherwise the last line of a clean run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


_STOP_RACE = _StopRace()


def watch(path: str, on_event, recursive: bool):
    """A started watchdog observer (daemon) calling `on_event(event)` for each event under the
    local folder `path`; end it with `stop_watch`. Events only cut latency: callers also poll."""
    from watchdog.observers import Observer

    logging.getLogger("watchdog.observers.inotify").addFilter(_STOP_RACE)  # once: same object

    class Handler:
        dispatch = staticmethod(on_event)

    observer = Observer()
    observer.schedule(Handler(), path, recursive=recursive)
    observer.daemon = True
    observer.start()
    return observer


def stop_watch(observer) -> None:
    observer.stop()
    observer.join(timeout=5)
