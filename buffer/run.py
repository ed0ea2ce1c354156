"""`Run`: one object per process that owns the run's storage as this role sees it.

    run = Run.open(cfg)            # a worker, the validator, a pool: cfg.root + cfg.buffer
    run = Run.local(root)          # the trainer (and launch tools on its folder): the run folder

Roles take their stores from it (`run.weights`, `run.heartbeats`, `run.sink(worker_id)`, ...)
and never build a path or look at the transport: the choice of implementations is made here,
once, from `buffer.transport`. Each transport names the module that provides its Run factory
(`_PROVIDERS`); the module registers it with `register` when imported, so a filesystem run never
imports grpc. With `grpc`, `cfg.root` is the process's own local folder (weights cache, shard
claim, logs) and the rest goes to the trainer's run service.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Callable

from buffer.stores.base import (ControlStore, ExperienceSink, HeartbeatStore, ProgressStore,
                                RunState, SyncClaims, ValidationStore, WeightSource)

if TYPE_CHECKING:
    from buffer.config import BufferConfig

# transport -> the module whose import registers its factory (buffer.transport's choices)
_PROVIDERS = {"fs": "buffer.stores.fs_run", "grpc": "buffer.stores.net"}
_FACTORIES: dict[str, Callable[[str, "BufferConfig"], "Run"]] = {}
_SERVERS: dict[str, Callable] = {}


def register(transport: str, factory: Callable[[str, "BufferConfig"], "Run"],
             server: Callable | None = None) -> None:
    """Make `factory(root, buffer_cfg) -> Run` the implementation of `transport`; `server(run,
    buffer_cfg, **hooks)`, if given, is what the trainer's rank 0 starts to serve its run folder
    to the others (an object with `stop()`; hooks: see FsRun.serve)."""
    _FACTORIES[transport] = factory
    if server is not None:
        _SERVERS[transport] = server


def _provider(transport: str) -> None:
    if transport not in _FACTORIES:
        if transport not in _PROVIDERS:
            raise ValueError(f"buffer.transport={transport!r}: one of {sorted(_PROVIDERS)}")
        importlib.import_module(_PROVIDERS[transport])


def server_for(transport: str) -> Callable | None:
    """The server factory of `transport`, None when the others share the folder (fs)."""
    _provider(transport)
    return _SERVERS.get(transport)


@dataclasses.dataclass
class Run:
    """The stores of one run as a worker-side process sees them (see buffer/stores/base.py)."""
    root: str  # this process's own folder: the run folder (fs) or its local one (network)
    transport: str
    weights: WeightSource
    heartbeats: HeartbeatStore
    progress: ProgressStore
    state: RunState
    sync: SyncClaims
    control: ControlStore
    validation: ValidationStore
    make_sink: Callable[[str], ExperienceSink]

    def sink(self, worker_id: str) -> ExperienceSink:
        """Where worker `worker_id`'s shards go (one per writer)."""
        return self.make_sink(worker_id)

    @staticmethod
    def open(cfg) -> "Run":
        """The Run of a role config: `cfg.root` and, if it has one, `cfg.buffer.transport`."""
        from buffer.config import BufferConfig
        buffer = getattr(cfg, "buffer", None) or BufferConfig()
        _provider(buffer.transport)
        return _FACTORIES[buffer.transport](cfg.root, buffer)

    @staticmethod
    def local(root: str, buffer: "BufferConfig | None" = None) -> "Run":
        """The run folder itself (fsspec URL or local path): a buffer.stores.fs_run.FsRun, with
        the trainer-only stores, what the trainer, the trainer-side run service and launch tools
        on the run folder use."""
        _provider("fs")
        return _FACTORIES["fs"](root, buffer)
