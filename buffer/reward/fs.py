"""Reward servers found in the run folder: reward/<server>.json (buffer/layout.py), one
protocol.reward.RewardEndpoint per server, replaced atomically every beat."""

from __future__ import annotations

import dataclasses
import logging
import time

import fsspec

from buffer.layout import RunLayout
from buffer.reward.base import RewardAnnouncer
from buffer.storage import atomic_write
from protocol.reward import MessageError, RewardEndpoint

log = logging.getLogger(__name__)
DEAD_AFTER_BEATS = 4.0  # an endpoint not refreshed for this many of its beats is a dead server's


@dataclasses.dataclass
class FsRewardEndpoints(RewardAnnouncer):
    fs: fsspec.AbstractFileSystem
    layout: RunLayout

    def announce(self, endpoint: RewardEndpoint) -> None:
        atomic_write(self.fs, self.layout.reward_endpoint(endpoint.server_id), (endpoint.to_json() + "\n").encode())

    def withdraw(self, server_id: str) -> None:
        path = self.layout.reward_endpoint(server_id)
        if self.fs.exists(path):
            self.fs.rm(path)

    def all(self) -> list[RewardEndpoint]:
        """Every endpoint that parses, live or not (launch.status)."""
        out: list[RewardEndpoint] = []
        if not self.fs.exists(self.layout.reward_dir):
            return out
        for path in sorted(self.fs.ls(self.layout.reward_dir, detail=False)):
            if RunLayout.heartbeat_worker(path) is None:
                continue  # a temporary
            try:
                out.append(RewardEndpoint.from_json(self.fs.cat_file(path), where=path))
            except FileNotFoundError:
                continue  # withdrawn meanwhile
            except MessageError as e:
                log.warning("%s", e)
        return out

    def live(self) -> list[RewardEndpoint]:
        now = time.time()
        return [
            e for e in self.all() if e.state == "serving" and now - e.last_beat <= DEAD_AFTER_BEATS * max(e.beat_s, 0.1)
        ]

    def where(self) -> str:
        return self.layout.reward_dir
