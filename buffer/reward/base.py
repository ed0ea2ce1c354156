"""Reward-model scores, what travels between a rollout worker and the run's reward servers
(issue 28; messages in protocol/reward.py).

Discovery: a reward server announces itself (`RewardAnnouncer`: its address and model checksum,
refreshed as its heartbeat, withdrawn when it drains) where the workers look (`RewardEndpoints`:
the live servers). Medium: the run folder (buffer/reward/fs.py); a fixed address list for workers
without it (buffer/reward/net_client.py, reward_model.addresses). Scoring: a worker hands each
finished group to a `RewardClient` (buffer/reward/net_client.py, gRPC to every live server,
shared), served by buffer/reward/net_server.py around a rollout.reward_model.RewardScorer.
"""

from __future__ import annotations

import abc

from buffer.control.base import ShouldStop
from protocol.reward import RewardEndpoint, ScoreReply


class RewardEndpoints(abc.ABC):
    """The run's reward servers as a worker finds them."""

    @abc.abstractmethod
    def live(self) -> list[RewardEndpoint]:
        """The servers serving now (announced, heartbeat fresh), ordered by server id."""

    @abc.abstractmethod
    def where(self) -> str:
        """Where servers are looked for, for messages."""


class RewardAnnouncer(RewardEndpoints):
    """A reward server's side: it announces itself (again every beat) and withdraws."""

    @abc.abstractmethod
    def announce(self, endpoint: RewardEndpoint) -> None:
        """Publish (replace) `endpoint` atomically. OSError on a full disk (the next beat retries)."""

    @abc.abstractmethod
    def withdraw(self, server_id: str) -> None:
        """Remove `server_id`'s endpoint; none is fine."""


class RewardClient(abc.ABC):
    """A worker's side: the reward model's scores of one group."""

    @abc.abstractmethod
    def score(
        self, group_id: str, messages: list[dict], responses: list[str], should_stop: ShouldStop = lambda: False
    ) -> ScoreReply | None:
        """One score per response and the scorer's checksum. Waits while no server can be
        reached (saying which addresses it waits for), at most the client's wait; then
        TimeoutError. None when `should_stop()` says so while it waits (nothing was scored: the
        group is the caller's still); a stop never cuts a call that a live server answers.
        RewardServiceError for a refusal retrying cannot change."""

    def score_groups(
        self, groups: list[tuple[str, list[dict], list[str]]], should_stop: ShouldStop = lambda: False
    ) -> list[ScoreReply | None]:
        """`score` of each (group id, messages, responses); a client may have several in flight."""
        return [self.score(g[0], g[1], g[2], should_stop=should_stop) for g in groups]

    @abc.abstractmethod
    def close(self) -> None:
        """End the channels and the discovery thread."""

    @abc.abstractmethod
    def where(self) -> str:
        """For messages."""


class RewardServiceError(RuntimeError):
    """A reward server refused a request in a way retrying cannot change (token, schema, bounds)."""
