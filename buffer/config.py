"""Settings of the experience transport, shared by rollout workers (writers) and the trainer."""
from __future__ import annotations

import dataclasses

from protocol.config import F


@dataclasses.dataclass
class BufferConfig:
    flush_interval: float = F(30.0, "seconds: publish buffered groups at least this often", gt=0)
    flush_samples: int = F(512, "publish a shard once this many samples are buffered", ge=1)
    discovery: str = F("auto", "how the trainer finds new shards: 'auto' polls and also listens to "
                       "filesystem events (watchdog) where they are delivered; 'poll' only polls "
                       "(events never arrive from other nodes on NFS/Lustre)",
                       choices=("auto", "poll"))
    poll_interval: float = F(1.0, "seconds between listings of the experience folder", gt=0)
    full_scan_interval: float = F(60.0, "seconds between full listings of every worker folder; "
                                  "between them the trainer only probes for each worker's next "
                                  "shard (cost grows with new shards, not with all shards), the "
                                  "full listing catches gaps in a worker's sequence", gt=0)
    retention: str = F("delete", "what happens to shards consumed and covered by a committed "
                       "checkpoint: 'delete', 'archive' (moved to archive/) or 'keep'",
                       choices=("delete", "archive", "keep"))
    tmp_timeout_s: float = F(3600.0, "temporary shard/heartbeat files older than this are "
                             "leftovers of dead writers and are removed", gt=0)
    max_backlog_samples: int = F(1024, "workers pause while more samples than this are written "
                                 "but not yet trained on or dropped by the trainer", ge=1)
    backlog_timeout_s: float = F(1800.0, "seconds a worker waits for the backlog to drain before "
                                 "failing (the trainer is presumed dead)", gt=0)
