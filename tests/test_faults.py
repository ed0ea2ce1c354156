"""Faults users meet on a bad day (issue 15): restarts, races, a second trainer, a full disk.
Real files, processes and gRPC servers; every wait has a timeout."""
from __future__ import annotations

import os
import time

import pytest

from buffer.config import BufferConfig
from buffer.layout import RunLayout
from buffer.reader import ExperienceReader
from buffer.retention import prune_consumed
from buffer.writer import ShardWriter
from conftest import free_port, make_group
from protocol.experience import decode, from_table

N = 4  # samples per group


def _cfg(**kw) -> BufferConfig:
    base = dict(discovery="poll", poll_interval=0.02, flush_interval=3600.0, flush_samples=N)
    base.update(kw)
    return BufferConfig(**base)


def _drain(reader: ExperienceReader, groups: int, timeout_s: float = 30) -> list:
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < groups:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(got)}/{groups} groups within {timeout_s} s"
        try:
            got += reader.next_batch(1, 0, timeout_s=min(left, 2.0))
        except TimeoutError:
            continue
    return got


def _beat(writer: ShardWriter) -> dict:
    """What the worker's heartbeat records (rollout/worker.py, once per batch)."""
    return {"next_seq": writer.seq, "samples_written": writer.samples_written}


# --- 1. a worker restarted under the same id never reuses a shard number ----------------------

def _restart_after_pruning(make_writer, spool: str, settle, on_reader=lambda r: None) -> None:
    """Publish 2 shards, heartbeat, publish 2 more; the trainer consumes all 4 and a checkpoint
    lets retention delete them; the worker is killed (the writer is dropped without a flush)
    and restarted from its heartbeat. Every group the restarted worker writes must be read."""
    w = make_writer(None)
    for g in range(2):
        w.add_group(make_group("w0", 0, g, 0, N))
    beat = _beat(w)  # the heartbeat trails: two more shards are published after it
    for g in range(2, 4):
        w.add_group(make_group("w0", 0, g, 0, N))
    settle(w)
    reader = ExperienceReader(spool, _cfg(), max_staleness=10)
    on_reader(reader)
    try:
        first = _drain(reader, 4)
        assert prune_consumed(spool, reader.consumed)["pruned"] == 4
        again = make_writer(beat)  # kill -9, restart under the same id
        for g in range(2):
            again.add_group(make_group("w0", 1, g, 0, N))
        settle(again)
        second = _drain(reader, 2, timeout_s=10)
    finally:
        reader.close()
    assert sorted(s.prompt_id for g in second for s in g.samples[:1]) == ["w0/1/0", "w0/1/1"]
    ids = [s.sample_id for g in first + second for s in g.samples]
    assert len(ids) == len(set(ids)) == 6 * N  # sample ids unique across the restart
    assert again.samples_written >= 4 * N  # backpressure never forgets what was written


def test_restarted_worker_never_reuses_a_consumed_and_pruned_shard_number(tmp_path):
    root = str(tmp_path / "run")
    _restart_after_pruning(lambda beat: ShardWriter(root, "w0", _cfg(), resume=beat), root,
                           settle=lambda w: None)


def test_restarted_grpc_worker_is_not_acknowledged_as_a_duplicate(tmp_path, monkeypatch):
    from buffer.grpc_transport import GrpcShardWriter, ShardServer
    port = free_port()
    monkeypatch.setenv("TANDEM_GRPC_TOKEN", "t0ken")
    cfg = _cfg(transport="grpc", grpc_bind=f"127.0.0.1:{port}", grpc_address=f"127.0.0.1:{port}",
               grpc_timeout_s=10)
    spool, worker_root = str(tmp_path / "trainer"), str(tmp_path / "worker")
    readers = []  # the server asks the trainer's ledger, as trainer.main wires it
    server = ShardServer(spool, cfg, consumed=lambda: readers[0].consumed if readers else ())
    writers = []

    def make(beat):
        writers.append(GrpcShardWriter(worker_root, "w0", cfg, resume=beat))
        return writers[-1]

    def settle(w):  # every shard acknowledged (what close() waits for)
        deadline = time.monotonic() + 60
        while w.unacked:
            assert time.monotonic() < deadline, "shards not acknowledged within 60 s"
            time.sleep(0.02)

    try:
        _restart_after_pruning(make, spool, settle, on_reader=readers.append)
    finally:
        for w in writers:
            w.close(timeout_s=10)
        server.stop()


# --- 7. a version pruned while a worker loads it ----------------------------------------------

def test_worker_survives_a_version_pruned_while_it_loads(tmp_path):
    from buffer.weights import WeightStore
    from protocol.config import build
    from rollout import builtin_task
    from rollout.config import WorkerConfig
    from rollout.worker import RolloutWorker
    builtin_task.write_model(tmp_path / "m")
    builtin_task.write_parquet(tmp_path / "t.parquet", builtin_task.make_rows(10, 3))
    root = tmp_path / "run"
    store = WeightStore(str(root))
    store.publish_hf_folder(tmp_path / "m", 0, 0, keep=3)
    worker = RolloutWorker(build(WorkerConfig, {"root": str(root), "worker.id": "w",
                                                "train_files": f"[{tmp_path / 't.parquet'}]"}))
    worker.start()
    try:
        store.publish_hf_folder(tmp_path / "m", 1, 1, keep=3)
        # What a worker sees when it read LATEST just before the trainer published three more
        # versions and pruned v1 (keep=3): the pointer names v1, v1 is gone.
        import shutil
        shutil.rmtree(store.layout.version_dir(1))
        assert worker.maybe_reload() is False and worker.version == 0
        store.publish_hf_folder(tmp_path / "m", 2, 2, keep=3)
        assert worker.maybe_reload() is True and worker.version == 2
    finally:
        worker.engine.close()
