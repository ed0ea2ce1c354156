"""The run's stores as each role sees them: one typed object per role, built by one factory each.

    run = setup_worker_run(cfg)     # a worker, the validator, a pool, launch.control: cfg.root + cfg.buffer
    run = setup_trainer_run(root)   # the trainer, and the launch tools on its folder: the run folder
    announcer = setup_reward_server_run(cfg)  # a reward server (rollout/reward_server.py): cfg.root + cfg.buffer

A `WorkerRun` holds only what the roles beside the trainer may use (the worker-side interfaces of
buffer/{experience,weights,control}/base.py); a `TrainerRun` is the run folder itself, with the
trainer's own stores (its experience reader, weight publisher, checkpoints, the folder's other
files) and the trainer's side of every control-plane store. The type checker holds each role to
its type. Roles never build a path or look at the transport: `setup_worker_run` chooses the
implementations once, by `buffer.transport`; `TrainerRun.serve` starts what the trainer serves
over it. With `grpc`, a WorkerRun's `cfg.root` is the process's own local folder (weights cache,
shard claim, logs) and the rest goes to the trainer's run service.

This is the top floor of buffer/: nothing inside buffer/ imports it but buffer/writer.py and the
buffer.inspect tool (tests/test_structure.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable

import fsspec

from buffer.channel import RunClient, token
from buffer.checkpoints import FsCheckpoints
from buffer.config import BufferConfig
from buffer.control import backpressure
from buffer.control.base import ControlStore, HeartbeatStore, ProgressStore, RunState, SyncClaims, ValidationStore
from buffer.control.fs import FsControl, FsHeartbeats, FsProgress, FsRunState, FsSyncClaims, FsValidation
from buffer.control.net_client import NetControl, NetHeartbeats, NetProgress, NetRunState, NetSyncClaims, NetValidation
from buffer.control.net_server import RunService
from buffer.experience.base import ExperienceSink
from buffer.experience.fs import FsExperienceSink
from buffer.experience.net_client import GrpcSink
from buffer.experience.net_server import ShardServer
from buffer.experience.reader import ExperienceReader
from buffer.layout import RunLayout
from buffer.reward.base import RewardAnnouncer, RewardClient, RewardEndpoints
from buffer.reward.fs import FsRewardEndpoints
from buffer.reward.net_client import GrpcRewardClient, NetRewardEndpoints, StaticEndpoints
from buffer.storage import filesystem, is_local
from buffer.weights.base import WeightSource
from buffer.weights.fs import FsWeightSource, WeightStore
from buffer.weights.net_client import NetWeightSource
from buffer.weights.net_pool import chunk_servers
from buffer.weights.net_server import WeightService, add_weight_service

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerRun:
    """The stores of one run as a worker, the validator, a pool or launch.control sees them."""

    root: str  # this process's own folder: the run folder (fs) or its local one (grpc)
    transport: str
    weights: WeightSource
    heartbeats: HeartbeatStore
    progress: ProgressStore
    state: RunState
    sync: SyncClaims
    control: ControlStore
    validation: ValidationStore
    make_sink: Callable[[str], ExperienceSink]
    # the run's reward servers as this role finds them: the run folder's (fs), the run service's (grpc)
    reward_endpoints: RewardEndpoints | None = None
    buffer: BufferConfig = dataclasses.field(default_factory=BufferConfig)
    # a signal came: calls waiting for an unreachable trainer give up at once (raise
    # buffer.channel.Interrupted); nothing waits so on the run folder
    interrupt: Callable[[], None] = lambda: None

    def sink(self, worker_id: str) -> ExperienceSink:
        """Where worker `worker_id`'s shards go (one per writer)."""
        return self.make_sink(worker_id)

    def reward_client(
        self, addresses: list[str], wait_s: float, call_timeout_s: float, max_inflight: int
    ) -> RewardClient:
        """A client of the run's reward servers (buffer/reward/): those at `addresses`, else
        those announced where this role can see them; the run's token and TLS."""
        if addresses:
            endpoints: RewardEndpoints = StaticEndpoints(addresses)
        elif self.reward_endpoints is not None:
            endpoints = self.reward_endpoints
        else:
            raise ValueError("reward_model.addresses: this role finds no reward servers; give their host:port")
        return GrpcRewardClient(endpoints, self.buffer, wait_s, call_timeout_s, max_inflight)


@dataclasses.dataclass
class TrainerRun:
    """The run folder (fsspec URL or local path) with every store on it: the trainer's, and the
    other roles' as the trainer sees them; `files` names the folder's other files (metrics, logs,
    inputs, lock) for the trainer and the tools that work on the folder itself (launch/*)."""

    root: str
    fs: fsspec.AbstractFileSystem
    files: RunLayout
    weights: FsWeightSource
    publisher: WeightStore  # the trainer's: publish, prune (and read) weight versions
    heartbeats: FsHeartbeats
    progress: FsProgress
    state: FsRunState
    sync: FsSyncClaims
    control: FsControl
    validation: FsValidation

    @functools.cached_property
    def checkpoints(self) -> FsCheckpoints:
        return FsCheckpoints(self.files)

    @functools.cached_property
    def reward(self) -> FsRewardEndpoints:
        """The reward servers announced in the folder (launch.status, launch.local)."""
        return FsRewardEndpoints(self.fs, self.files)

    def reader(self, cfg: BufferConfig, max_staleness: int, **kwargs) -> ExperienceReader:
        """The trainer's ExperienceSource of experience/ (buffer/experience/reader.py)."""
        return ExperienceReader(self.root, cfg, max_staleness, **kwargs)

    def serve(self, buffer: BufferConfig, **hooks) -> RunServer | None:
        """Trainer rank 0: serve this folder to the other roles over `buffer.transport`; None
        when they share it (fs). `hooks` (callables): consumed() -> the reader's ledger,
        retired() -> samples retired, step_samples() -> samples one step takes."""
        if buffer.transport == "fs":
            return None
        elif buffer.transport == "grpc":
            return RunServer(self, buffer, **hooks)
        raise ValueError(f"buffer.transport={buffer.transport!r}: 'fs' or 'grpc'")

    def is_local(self) -> bool:
        """A mounted filesystem (local, NFS, Lustre), not an object store."""
        return is_local(self.fs)


def setup_trainer_run(root: str) -> TrainerRun:
    """The run folder at `root` as the trainer (and the tools on its folder) see it."""
    fs, path = filesystem(root)
    layout = RunLayout(path)
    heartbeats = FsHeartbeats(fs, layout)
    return TrainerRun(
        root=root,
        fs=fs,
        files=layout,
        weights=FsWeightSource(fs, layout),
        publisher=WeightStore(root),
        heartbeats=heartbeats,
        progress=FsProgress(fs, layout),
        state=FsRunState(fs, layout),
        sync=FsSyncClaims(layout, heartbeats),
        control=FsControl(fs, layout),
        validation=FsValidation(fs, layout),
    )


def setup_worker_run(cfg) -> WorkerRun:
    """The WorkerRun of a role config: `cfg.root` and, if it has one, `cfg.buffer.transport`."""
    buffer = getattr(cfg, "buffer", None) or BufferConfig()
    if buffer.transport == "fs":
        return _shared_folder_run(cfg.root, buffer)
    elif buffer.transport == "grpc":
        return _network_run(cfg.root, buffer)
    raise ValueError(f"buffer.transport={buffer.transport!r}: 'fs' or 'grpc'")


def _folder_sink(folder: TrainerRun, buffer: BufferConfig, worker_id: str) -> FsExperienceSink:
    """Shards into `folder`'s experience/<worker>/, backpressure from its heartbeats and progress."""
    room = functools.partial(backpressure.wait_for_room, folder.heartbeats, folder.progress)
    return FsExperienceSink(folder.fs, folder.files, worker_id, room, buffer.worker_lock_wait_s)


def _shared_folder_run(root: str, buffer: BufferConfig) -> WorkerRun:
    """`buffer.transport=fs`: every store on the shared run folder."""
    folder = setup_trainer_run(root)
    return WorkerRun(
        root=root,
        transport="fs",
        weights=folder.weights,
        heartbeats=folder.heartbeats,
        progress=folder.progress,
        state=folder.state,
        sync=folder.sync,
        control=folder.control,
        validation=folder.validation,
        make_sink=functools.partial(_folder_sink, folder, buffer),
        reward_endpoints=folder.reward,
        buffer=buffer,
    )


def _network_run(root: str, buffer: BufferConfig) -> WorkerRun:
    """`buffer.transport=grpc`: the process's own folder `root` (local) holds its weight cache
    and shard claim; everything else is the trainer's run service's."""
    own = setup_trainer_run(root)
    if not own.is_local():
        raise ValueError(
            f"root={root}: with buffer.transport=grpc the root is this process's "
            "own local folder (weight cache, claim file, logs), not a URL"
        )
    os.makedirs(own.files.weights_dir, exist_ok=True)
    client = RunClient(buffer)
    state = NetRunState(client)
    heartbeats, progress = NetHeartbeats(client), NetProgress(client)
    room = functools.partial(backpressure.wait_for_room, heartbeats, progress)

    def make_sink(worker_id: str) -> GrpcSink:  # shards pushed; the claim file in `root`
        return GrpcSink(_folder_sink(own, buffer, worker_id), buffer, state, room)

    return WorkerRun(
        root=root,
        transport="grpc",
        weights=NetWeightSource(client, own.files, buffer.grpc_cache_versions),
        heartbeats=heartbeats,
        progress=progress,
        state=state,
        sync=NetSyncClaims(client),
        control=NetControl(client),
        validation=NetValidation(client),
        make_sink=make_sink,
        reward_endpoints=NetRewardEndpoints(client),
        buffer=buffer,
        interrupt=client.interrupt,
    )


def setup_reward_server_run(cfg) -> RewardAnnouncer:
    """Where a reward server (config `cfg`: root, buffer) announces itself: the run folder
    (buffer.transport=fs), or the trainer's run service (grpc: `root` is its own folder)."""
    buffer = getattr(cfg, "buffer", None) or BufferConfig()
    if buffer.transport == "fs":
        return setup_trainer_run(cfg.root).reward
    elif buffer.transport == "grpc":
        return NetRewardEndpoints(RunClient(buffer))
    raise ValueError(f"buffer.transport={buffer.transport!r}: 'fs' or 'grpc'")


class RunServer:
    """The trainer's rank 0 with buffer.transport=grpc: one grpc.Server (buffer.grpc_bind, the
    token, TLS) with the experience stream (ShardServer), the run service on `run` and the
    weight service of its published versions (its chunks from buffer.weights_serve_processes
    processes of their own: buffer/weights/net_pool.py), each service on its own thread pool. `hooks`:
    see TrainerRun.serve. `stop()` first lingers after the run's end (buffer.grpc_linger_s),
    so that workers learn of it."""

    def __init__(self, run: TrainerRun, buffer: BufferConfig, **hooks):
        secret = token(buffer)
        self.run_service = RunService(run, buffer, secret)
        self.weights: WeightService | None = None

        def add_weights(server) -> None:
            pool = chunk_servers(run.files, secret, buffer)
            self.weights = add_weight_service(server, self.run_service.version_dir, secret, buffer, pool)

        try:
            self.shards = ShardServer(
                run.root,
                buffer,
                **hooks,
                services=[lambda server: server.add_generic_rpc_handlers([self.run_service.handler()]), add_weights],
            )
        except BaseException:  # e.g. the port is taken: the chunk-server processes end too
            if self.weights is not None:
                self.weights.close()
            raise
        self.server, self.port, self.linger_s = self.shards.server, self.shards.port, buffer.grpc_linger_s
        self.servicer = self.shards.servicer  # the experience stream's (its stats)
        log.info("run service and weight service on port %d beside the experience stream", self.port)

    def published(self, version: int) -> None:
        """Rank 0 published `version`: its chunk list is hashed now, before a worker asks."""
        if self.weights is not None:
            self.weights.prepare(version)

    def stop(self, grace_s: float = 5.0) -> None:
        try:
            self.run_service.linger(self.linger_s)
        finally:
            self.shards.stop(grace_s)
            self.run_service.pool.shutdown(wait=False, cancel_futures=True)
            if self.weights is not None:
                self.weights.close()
