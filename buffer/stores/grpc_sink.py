"""`buffer.transport=grpc` until the run service (buffer/stores/net.py) lands: shards go to the
trainer over gRPC (buffer/grpc_transport.py's push), every other store is the run folder.

The network version replaces this module in buffer/run.py's `_PROVIDERS["grpc"]`: its factory
builds a Run of network stores whose `make_sink` is `GrpcSink(local sink of the worker's own
folder, buffer, run state)`, and its server (started by the trainer's rank 0 through
`FsRun.serve`) adds the run service to the ShardServer's grpc.Server."""
from __future__ import annotations

from buffer.run import Run, register
from buffer.stores.fs_run import FsRun


def _open(root: str, buffer) -> Run:
    from buffer.grpc_transport import GrpcSink
    run = FsRun.at(root, buffer)
    local = run.make_sink
    run.make_sink = lambda worker_id: GrpcSink(local(worker_id), buffer, run.state)
    run.transport = "grpc"
    return run


def _serve(run: FsRun, buffer, **hooks):
    from buffer.grpc_transport import ShardServer
    return ShardServer(run.root, buffer, **hooks)


register("grpc", _open, server=_serve)
