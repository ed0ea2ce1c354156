"""The run id: names one run, in `ROOT/run.json` and in the metadata of every experience shard.

The trainer creates it when it first holds the run folder (trainer/run_lock.py), before it
publishes version 0; a worker reads it once a weight version exists and stamps it on every shard.
The trainer refuses shards that carry another run's id or none (experience copied in from an
older run, or from a tandem that wrote no run id), so leftovers are never trained on.
"""
from __future__ import annotations

import socket
import time
import uuid

from buffer.layout import RunLayout
from buffer.storage import atomic_write_json, read_json


def read_run_id(fs, layout: RunLayout) -> str | None:
    info = read_json(fs, layout.run_info)
    return None if info is None else str(info["run_id"])


def ensure_run_id(fs, layout: RunLayout) -> str:
    """The run's id, created now if the folder has none. Only the lock holder calls this."""
    run_id = read_run_id(fs, layout)
    if run_id is None:
        run_id = uuid.uuid4().hex
        atomic_write_json(fs, layout.run_info, {"run_id": run_id, "host": socket.gethostname(),
                                                "created_at": time.time()})
    return run_id
