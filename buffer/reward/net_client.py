"""A worker's reward client over gRPC (protocol/reward.py): every live reward server shared.

The servers come from a RewardEndpoints (the run folder's, or `StaticEndpoints`: the addresses
of reward_model.addresses), looked up again every `refresh_s`. Each group goes to the server with
the fewest of this client's calls in flight (ties in turn); at most `max_inflight` calls are in
flight at once (`score_groups` runs them on owned threads). A call that fails in a way a retry
can mend (UNAVAILABLE: down or draining; DEADLINE_EXCEEDED; RESOURCE_EXHAUSTED: its queue full)
is tried again, on another server where there is one, the failed address left aside for a
backoff (0.2 s doubling to 5 s); while no server answers, the client says every `note_s` which
addresses it waits for, and gives up after `wait_s` (TimeoutError). Nothing is lost meanwhile:
the group waits in the worker, unwritten. Scoring is stateless: a retry after a lost reply
scores again, with the same result.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from concurrent import futures

import grpc

from buffer.channel import MAX_BACKOFF_S, RETRIED, RunClient, open_channel, token
from buffer.config import BufferConfig
from buffer.control.base import ShouldStop
from buffer.reward.base import RewardAnnouncer, RewardClient, RewardEndpoints, RewardServiceError
from protocol import reward as rw
from protocol import run_service as rs

log = logging.getLogger(__name__)


class StaticEndpoints(RewardEndpoints):
    """Reward servers at fixed addresses (reward_model.addresses): a worker without the run folder."""

    def __init__(self, addresses: list[str]):
        self.addresses = list(addresses)

    def live(self) -> list[rw.RewardEndpoint]:
        return [rw.RewardEndpoint(a, a, "", 0, "", 0.0, time.time(), 1.0) for a in self.addresses]

    def where(self) -> str:
        return f"reward_model.addresses {self.addresses}"


class NetRewardEndpoints(RewardAnnouncer):
    """The run's reward servers through the trainer's run service (buffer.transport=grpc: a
    worker or a reward server without the run folder; protocol/run_service.py's AnnounceReward,
    WithdrawReward, RewardEndpoints), kept in the trainer's folder as buffer/reward/fs.py does."""

    def __init__(self, client: RunClient):
        self.client = client

    def announce(self, endpoint: rw.RewardEndpoint) -> None:
        self.client.call("AnnounceReward", rs.RewardAnnounce(dataclasses.asdict(endpoint)))

    def withdraw(self, server_id: str) -> None:
        self.client.call("WithdrawReward", rs.WorkerRef(server_id))

    def live(self) -> list[rw.RewardEndpoint]:
        docs = self.client.call("RewardEndpoints").docs
        return [
            rw.RewardEndpoint.from_json(json.dumps(d), where=f"the run service at {self.client.address}") for d in docs
        ]

    def where(self) -> str:
        return f"the run service at {self.client.address}"


class _Server:
    def __init__(self, buffer: BufferConfig, address: str):
        self.address = address
        self.channel = open_channel(buffer, address, [("grpc.max_receive_message_length", rw.MAX_REQUEST_BYTES)])
        self.stub = self.channel.unary_unary(
            rw.method("Score"),
            request_serializer=rw.encode,
            response_deserializer=functools.partial(rw.decode, rw.ScoreReply),
        )
        self.inflight = 0
        self.backoff = 0.0
        self.resting_until = 0.0  # after a retryable failure: not asked before this (monotonic)
        self.last_error = ""


class GrpcRewardClient(RewardClient):
    def __init__(
        self,
        endpoints: RewardEndpoints,
        buffer: BufferConfig,
        wait_s: float,
        call_timeout_s: float,
        max_inflight: int,
        refresh_s: float = 2.0,
        note_s: float = 30.0,
    ):
        self.endpoints, self.buffer = endpoints, buffer
        self.wait_s, self.call_timeout_s, self.refresh_s, self.note_s = wait_s, call_timeout_s, refresh_s, note_s
        self.metadata = (("authorization", f"Bearer {token(buffer)}"), (rw.SCHEMA_KEY, str(rw.SCHEMA)))
        self.lock = threading.Lock()
        self.servers: dict[str, _Server] = {}
        self.live: list[str] = []
        self.looked = -float("inf")
        self.turn = 0
        self.slots = threading.BoundedSemaphore(max_inflight)
        self.pool = futures.ThreadPoolExecutor(max_inflight, thread_name_prefix="reward-client")
        self.retries = 0  # calls tried again (reported in the worker's heartbeat)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self.looked < self.refresh_s:
            return
        found = [e.address for e in self.endpoints.live()]
        with self.lock:
            self.looked = now
            self.live = found
            for address in found:
                if address not in self.servers:
                    self.servers[address] = _Server(self.buffer, address)

    def _pick(self) -> _Server | None:
        """The live server with the fewest of our calls in flight that is not resting."""
        now = time.monotonic()
        with self.lock:
            ready = [self.servers[a] for a in self.live if self.servers[a].resting_until <= now]
            if not ready:
                return None
            self.turn += 1
            server = min(ready, key=lambda s: (s.inflight, (ready.index(s) - self.turn) % len(ready)))
            server.inflight += 1
            return server

    def _waiting_for(self) -> str:
        with self.lock:
            if not self.live:
                return f"no reward server announced in {self.endpoints.where()}"
            return ", ".join(f"{a} ({self.servers[a].last_error or 'busy'})" for a in self.live)

    def score(
        self, group_id: str, messages: list[dict], responses: list[str], should_stop: ShouldStop = lambda: False
    ) -> rw.ScoreReply | None:
        request = rw.ScoreRequest(group_id=group_id, messages=messages, responses=responses)
        start, noted = time.monotonic(), None
        while True:
            self._refresh()
            server = self._pick()
            if server is not None:
                reply = self._call(server, request)
                if reply is not None:
                    if noted is not None:
                        log.info("reward server %s answers (after %.0f s)", server.address, time.monotonic() - start)
                    return reply
            # A stop ends the wait for a server, not a call a live one answers: a worker told to
            # stop finishes its batch (its groups scored and written) unless scoring must wait.
            if should_stop():
                return None
            waited = time.monotonic() - start
            if waited > self.wait_s:
                raise TimeoutError(
                    f"no reward server answered group {group_id} for {waited:.0f} s (reward_model.wait_s): "
                    f"{self._waiting_for()}; are the reward servers running?"
                )
            if noted is None or time.monotonic() - noted >= self.note_s:
                log.warning(
                    "waiting for a reward server to score group %s: %s; %.0f s of %.0f (reward_model.wait_s)",
                    group_id,
                    self._waiting_for(),
                    waited,
                    self.wait_s,
                )
                noted = time.monotonic()
            if server is None:
                time.sleep(0.1)

    def _call(self, server: _Server, request: rw.ScoreRequest) -> rw.ScoreReply | None:
        """The reply, or None after a failure a retry may mend (the server then rests a while)."""
        try:
            reply = server.stub(request, timeout=self.call_timeout_s, metadata=self.metadata)
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            if code not in RETRIED:
                raise RewardServiceError(
                    f"reward server {server.address} refused group {request.group_id}: {code.name}: {details}"
                ) from None
            with self.lock:
                server.backoff = min(max(server.backoff * 2, 0.2), MAX_BACKOFF_S)
                server.resting_until = time.monotonic() + server.backoff
                server.last_error = f"{code.name}: {details}"[:200]
                self.retries += 1
            return None
        finally:
            with self.lock:
                server.inflight -= 1
        if len(reply.scores) != len(request.responses):
            raise RewardServiceError(
                f"reward server {server.address} sent {len(reply.scores)} scores for {len(request.responses)} responses"
            )
        with self.lock:
            server.backoff, server.last_error = 0.0, ""
        return reply

    def score_groups(
        self, groups: list[tuple[str, list[dict], list[str]]], should_stop: ShouldStop = lambda: False
    ) -> list[rw.ScoreReply | None]:
        """`score` of each (group id, messages, responses), at most max_inflight at once."""

        def one(group: tuple[str, list[dict], list[str]]) -> rw.ScoreReply | None:
            with self.slots:
                return self.score(group[0], group[1], group[2], should_stop=should_stop)

        return [f.result() for f in [self.pool.submit(one, g) for g in groups]]

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        with self.lock:
            for server in self.servers.values():
                server.channel.close()

    def where(self) -> str:
        return f"reward servers in {self.endpoints.where()}"
