"""Retention: keep the experience folder bounded in a long run.

Two housekeeping calls, both safe to run while workers publish and the reader reads:

- `prune_consumed(root, consumed_keys, mode)` removes (or archives) published shards that the
  trainer has consumed *and* that a committed checkpoint covers. Call it right after a checkpoint
  commits, with the consumed ledger saved in that checkpoint: a trainer resumed from it will never
  need those shards again. Never pass the live `reader.consumed` of a run whose latest state is not
  yet checkpointed: a crash would then resume with a ledger that still expects deleted shards
  (they would simply be missing: nothing read twice, but those samples lost).
- `clean_stale_temps(root, older_than_s)` removes temporaries (`<name>.tmp-<pid>`) left by writers
  that died mid-write. A live writer's temporary exists only for the milliseconds of one write,
  so any timeout far above that is safe; the timeout also absorbs clock skew between the node
  that wrote the file (its mtime) and the node that cleans.

Deleting consumed shards does not make a restarted worker reuse a shard name: `ShardWriter`
resumes its sequence from its durable claim (`workers/<worker>.claim`, written before each
shard is published), not from what is left on disk.

Cost: both walk the worker folders that exist now, which retention keeps small; the ledger is
only looked up (a Ledger answers `in` in O(1)), so the cost does not grow with its length.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

from buffer.layout import TMP_MARK, RunLayout, check_worker_id
from buffer.ledger import Ledger, shard_key
from buffer.storage import filesystem, is_local

log = logging.getLogger(__name__)

MODES = ("delete", "archive")


def _names(fs, path: str) -> list[str]:
    try:
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _worker_ids(fs, layout: RunLayout) -> list[str]:
    out = []
    for name in _names(fs, layout.experience_dir):
        try:
            out.append(check_worker_id(name))
        except ValueError:
            continue
    return out


def prune_consumed(root: str, consumed_keys: Ledger | Iterable[str], mode: str = "delete") -> dict[str, int]:
    """Delete (mode='delete') or move to `archive/<worker>/` (mode='archive') every published
    shard under `experience/` whose key "<worker>/<seq>" is in `consumed_keys`.

    `consumed_keys` must be the ledger of a *committed* checkpoint (trainer_state.json
    "consumed" read back with Ledger.from_json, i.e. ExperienceReader.consumed as it was saved);
    a Ledger, or an iterable of keys (converted to one). Shards not in it are never touched, nor
    are temporaries, quarantined shards or anything that is not a shard name.

    Returns {"pruned": shards removed or archived, "bytes": their size, "kept": shards left
    because they are not covered}. Idempotent: a second call with the same keys prunes nothing.
    """
    if mode not in MODES:
        raise ValueError(f"retention mode {mode!r}: use one of {MODES}")
    keys = consumed_keys if isinstance(consumed_keys, Ledger) else Ledger.from_keys(consumed_keys)
    fs, root_path = filesystem(root)
    layout = RunLayout(root_path)
    counts = {"pruned": 0, "bytes": 0, "kept": 0}
    for worker in _worker_ids(fs, layout):
        wdir = layout.worker_shard_dir(worker)
        for name in _names(fs, wdir):
            seq = RunLayout.shard_seq(name)
            if seq is None:
                continue
            if shard_key(worker, seq) not in keys:
                counts["kept"] += 1
                continue
            path = f"{wdir}/{name}"
            try:
                size = fs.size(path)
                if mode == "delete":
                    fs.rm_file(path)
                else:
                    dest = layout.archive_shard(worker, seq)
                    fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
                    dup = 0  # an archived shard is never replaced (a restarted writer's empty
                    while fs.exists(dest + (f".{dup}" if dup else "")):  # one may share its seq)
                        dup += 1
                    fs.mv(path, dest + (f".{dup}" if dup else ""))
            except FileNotFoundError:
                continue  # pruned concurrently (or quarantined meanwhile)
            counts["pruned"] += 1
            counts["bytes"] += size or 0
    if counts["pruned"]:
        log.info(
            "retention (%s): %d consumed shards, %.1f MB; %d shards kept",
            mode,
            counts["pruned"],
            counts["bytes"] / 1e6,
            counts["kept"],
        )
    return counts


def clean_stale_temps(root: str, older_than_s: float, now: float | None = None) -> int:
    """Remove temporary files (names containing layout.TMP_MARK) of dead writers under
    `experience/<worker>/`, `experience/` (the gRPC spool) and `workers/` (heartbeats) whose
    mtime is more than `older_than_s` seconds before `now` (default: time.time()). Returns how
    many were removed."""
    fs, root_path = filesystem(root)
    layout = RunLayout(root_path)
    cutoff = (time.time() if now is None else now) - older_than_s
    folders = [layout.worker_shard_dir(w) for w in _worker_ids(fs, layout)] + [
        layout.workers_dir,
        layout.experience_dir,
    ]  # the last: the gRPC server's spool temporaries
    removed = 0
    for folder in folders:
        for name in _names(fs, folder):
            if TMP_MARK not in name:
                continue
            path = f"{folder}/{name}"
            try:
                if fs.isdir(path):  # a worker folder whose id happens to hold the mark
                    continue
                mtime = _mtime(fs, path)
                if mtime is None or mtime > cutoff:
                    continue
                fs.rm_file(path)
            except FileNotFoundError:
                continue  # its writer renamed it into place, or another cleaner was faster
            removed += 1
            log.info("removed stale temporary %s (%.0f s old)", path, time.time() - mtime)
    return removed


def _mtime(fs, path: str) -> float | None:
    if is_local(fs):
        return os.stat(path).st_mtime
    info = fs.info(path)
    m = info.get("mtime") or info.get("LastModified") or info.get("created")
    if m is None:
        return None
    return m.timestamp() if hasattr(m, "timestamp") else float(m)
