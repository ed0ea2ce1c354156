"""Faults users meet on a bad day (issue 15): restarts, races, a second trainer, a full disk.
Real files, processes and gRPC servers; every wait has a timeout."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
from conftest import descendants, free_port, launch_local, make_group, small_filesystem

from buffer.config import BufferConfig
from buffer.experience.reader import ExperienceReader
from buffer.experience.retention import prune_consumed
from buffer.layout import RunLayout
from buffer.run import setup_trainer_run
from buffer.writer import ShardWriter
from launch.status import split_metrics
from protocol.experience import decode, from_table

N = 4  # samples per group


def _cfg(**kw) -> BufferConfig:
    base = dict(discovery="poll", poll_interval=0.02, flush_interval=3600.0, flush_samples=N)
    base.update(kw)
    return BufferConfig(**base)


def _grpc_cfg(port: int, **kw) -> BufferConfig:
    """A worker and a trainer on gRPC at `port`."""
    return _cfg(
        transport="grpc", grpc_bind=f"127.0.0.1:{port}", grpc_address=f"127.0.0.1:{port}", grpc_timeout_s=10, **kw
    )


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
    _restart_after_pruning(lambda beat: ShardWriter.at(root, "w0", _cfg(), resume=beat), root, settle=lambda w: None)


def test_restarted_grpc_worker_is_not_acknowledged_as_a_duplicate(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("TANDEM_GRPC_TOKEN", "t0ken")
    # The restarted writer takes worker id w0 over grpc_claim_ttl_s after the killed one's last
    # push (refused and retried until then: test_grpc_security); 1 s instead of 60 keeps it short.
    cfg = _grpc_cfg(port, grpc_claim_ttl_s=1.0)
    spool, worker_root = str(tmp_path / "trainer"), str(tmp_path / "worker")
    readers = []  # the server asks the trainer's ledger, as trainer.main wires it
    server = setup_trainer_run(spool).serve(cfg, consumed=lambda: readers[0].consumed if readers else ())
    writers = []

    def make(beat):
        writers.append(ShardWriter.at(worker_root, "w0", cfg, resume=beat))
        return writers[-1]

    def settle(w):  # every shard acknowledged (what close() waits for)
        deadline = time.monotonic() + 60
        while w.sink.unacked:
            assert time.monotonic() < deadline, "shards not acknowledged within 60 s"
            time.sleep(0.02)

    try:
        _restart_after_pruning(make, spool, settle, on_reader=readers.append)
    finally:
        try:  # every writer closed (its senders stopped) even when an earlier close raises
            with contextlib.ExitStack() as closing:
                for w in writers:
                    closing.callback(w.close, timeout_s=10)
        finally:
            server.stop()


def test_a_restarted_grpc_worker_counts_each_written_sample_once(tmp_path, monkeypatch):
    """Worker and trainer on one run folder (as the chaos driver runs them): the trainer's
    backpressure holds shards 2-5 unacknowledged while the worker claims the next numbers, then
    takes them all; a restart must count 6 shards' samples, not more."""
    port = free_port()
    monkeypatch.setenv("TANDEM_GRPC_TOKEN", "t0ken")
    cfg = _grpc_cfg(port, grpc_claim_ttl_s=1.0, max_backlog_samples=N)
    root = str(tmp_path / "run")
    retired = [0]  # what the trainer has retired: nothing, then everything
    server = setup_trainer_run(root).serve(cfg, retired=lambda: retired[0])
    writers = []
    try:
        w = ShardWriter.at(root, "w0", cfg)
        writers.append(w)
        for g in range(6):
            w.add_group(make_group("w0", 0, g, 0, N))  # one shard each
        _wait(lambda: server.servicer.stats["backpressure"] > 0, "the trainer to push back")
        retired[0] = 10**6
        _wait(lambda: not w.sink.unacked, "every shard to be acknowledged")
        beat = _beat(w)
        w.sink.stopping = True  # killed: no close
        w.sink.senders.shutdown(wait=True)
        again = ShardWriter.at(root, "w0", cfg, resume=beat)
        writers.append(again)
    finally:
        for w in writers:
            w.sink.stopping = True
            w.sink.senders.shutdown(wait=True)
        server.stop()
    on_disk = sum(
        len(from_table(decode(f.read_bytes()))) for f in (tmp_path / "run" / "experience" / "w0").glob("*.arrow")
    )
    assert on_disk == 6 * N
    assert again.samples_written == on_disk, "samples counted twice across the restart"


def test_a_killed_grpc_worker_re_sends_its_unacknowledged_shards_or_declares_them_lost(tmp_path, monkeypatch):
    """Issue 30 item 1: the trainer's backpressure holds the last shards unacknowledged when
    the worker is killed (its heartbeat says next_seq 5). The restarted worker re-sends them from
    its outbox and declares the one whose copy is damaged lost: the ledger closes with no hole.
    Which shards are held back depends on how the concurrent pushes interleave (the backlog
    bound is soft by the pushes in flight: 2 or 3 of the 5 get in), so the test takes them as
    they come and needs at least 2 held back (one damaged, one re-sent)."""
    port = free_port()
    monkeypatch.setenv("TANDEM_GRPC_TOKEN", "t0ken")
    cfg = _grpc_cfg(port, grpc_claim_ttl_s=1.0, max_backlog_samples=N)
    spool, own = str(tmp_path / "trainer"), tmp_path / "worker"
    retired = [0]
    server = setup_trainer_run(spool).serve(cfg, retired=lambda: retired[0])
    writers = []
    try:
        w = ShardWriter.at(str(own), "w0", cfg)
        writers.append(w)
        for g in range(5):
            w.add_group(make_group("w0", 0, g, 0, N))  # one shard each
        stats = server.servicer.stats
        settled = lambda: stats["spooled"] + len(w.sink.unacked) == 5  # noqa: E731
        _wait(lambda: settled() and stats["backpressure"] > 0, "every shard pushed, some held back")
        refused = stats["backpressure"]  # then each held shard refused once more: none mid-accept
        _wait(lambda: settled() and stats["backpressure"] >= refused + len(w.sink.unacked), "the held shards' retries")
        beat = _beat(w)
        w.sink.stopping = True  # killed: no close
        w.sink.senders.shutdown(wait=True)
        held = sorted(w.sink.unacked)
        assert len(held) >= 2, held
        outbox = own / "outbox" / "w0"
        assert sorted(os.listdir(outbox)) == [f"00000000{i}.arrow" for i in held]
        lost = held[0]
        damaged = bytearray((outbox / f"00000000{lost}.arrow").read_bytes())
        damaged[-40] ^= 0xFF
        (outbox / f"00000000{lost}.arrow").write_bytes(bytes(damaged))
        retired[0] = 10**6
        again = ShardWriter.at(str(own), "w0", cfg, resume=beat)
        writers.append(again)
        again.add_group(make_group("w0", 0, 5, 0, N))
        again.close(timeout_s=30)
        assert os.listdir(outbox) == []  # every shard acknowledged
    finally:
        for w in writers:
            w.sink.stopping = True
            w.sink.senders.shutdown(wait=True)
        server.stop()
    reader = ExperienceReader(spool, _cfg(), max_staleness=10)
    try:
        got = []
        _wait(lambda: got.extend(reader.next_batch(1, 0, timeout_s=1)) or len(got) == 5, "5 groups", 30)
        _wait(lambda: reader.consumed.next_seq("w0") == 6 and len(reader.consumed) == 6, "the ledger to close", 10)
    finally:
        reader.close()
    assert reader.stats["declared_lost_shards"] == 1
    assert sorted(s.sample_id.split("/")[1] for g in got for s in g.samples[:1]) == [
        str(g) for g in range(6) if g != lost
    ]


# --- 7. a version pruned while a worker loads it ----------------------------------------------


def test_worker_survives_a_version_pruned_while_it_loads(tmp_path):
    from buffer.weights.fs import WeightStore
    from protocol.config import build
    from rollout import builtin_task
    from rollout.config import WorkerConfig
    from rollout.worker import RolloutWorker

    builtin_task.write_model(tmp_path / "m")
    builtin_task.write_parquet(tmp_path / "t.parquet", builtin_task.make_rows(10, 3))
    root = tmp_path / "run"
    store = WeightStore(str(root))
    store.publish_hf_folder(tmp_path / "m", 0, 0, keep=3)
    worker = RolloutWorker(
        build(WorkerConfig, {"root": str(root), "worker.id": "w", "train_files": f"[{tmp_path / 't.parquet'}]"})
    )
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


def test_engine_start_survives_the_version_pruned_while_the_engine_loads(tmp_path):
    """The worker's real store and engine; between the store's fetch and the engine's load the
    trainer publishes v1 with keep=1, pruning the version just fetched: the race of a worker
    starting while the trainer runs (seen in the chaos soak, 2026-12-02: the worker died with
    transformers' OSError for the vanished folder). The start takes the newest instead."""
    from buffer.weights.fs import WeightStore
    from protocol.config import build
    from rollout import builtin_task
    from rollout.config import WorkerConfig
    from rollout.versions import VersionGate
    from rollout.worker import start_engine

    builtin_task.write_model(tmp_path / "m")
    builtin_task.write_parquet(tmp_path / "t.parquet", builtin_task.make_rows(10, 3))
    root = tmp_path / "run"
    trainer = WeightStore(str(root))
    trainer.publish_hf_folder(tmp_path / "m", 0, 0, keep=1)

    class RacedStore(WeightStore):
        def fetch(self, version):
            folder = super().fetch(version)
            if version == 0:  # the trainer moves on before the engine reads the folder
                trainer.publish_hf_folder(tmp_path / "m", 1, 1, keep=1)
            return folder

    cfg = build(WorkerConfig, {"root": str(root), "worker.id": "w", "train_files": f"[{tmp_path / 't.parquet'}]"})
    gate = VersionGate(cfg.actor_rollout_ref.model.path)
    engine, version = start_engine(RacedStore(str(root)), cfg.actor_rollout_ref.rollout, "cpu", 60, "worker w", gate)
    try:
        assert version == 1 and not os.path.exists(trainer.layout.version_dir(0))
    finally:
        engine.close()


# --- 8. concurrent pushes of one shard never publish damaged bytes ----------------------------


def _waiting_for_the_shard_lock(servicer) -> int:
    """Push handlers that read their header and now wait for another push of the same shard:
    their innermost frames are Push itself (or the lock helpers it calls), not gRPC's reading."""
    import sys
    import threading

    from buffer.experience import net_server as grpc_transport

    count = 0
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        inner = []
        while frame is not None and frame.f_code is not type(servicer).Push.__code__:
            inner.append(frame.f_code)
            frame = frame.f_back
        if frame is not None and all(
            c.co_filename in (grpc_transport.__file__, contextlib_file()) and c.co_name != "_spool" for c in inner
        ):
            count += 1
    return count


def contextlib_file() -> str:
    import contextlib

    return contextlib.__file__


def _wait(cond, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)


def test_concurrent_pushes_of_one_shard_never_publish_damaged_bytes(tmp_path, monkeypatch):
    """A push that dies mid-stream (A) while a resend (B) waits for it, then another resend (C):
    B and C must not spool at once (they did: A's exit dropped the lock B waited on, C made a
    new one, and both wrote the same temporary name), and what is published is what was
    acknowledged."""
    import threading

    import grpc

    from buffer.experience.net_server import ShardServer
    from protocol import experience_pb2 as pb
    from protocol import experience_pb2_grpc as pb_grpc
    from protocol.experience import SCHEMA_VERSION, encode, load_shard, to_table

    port = free_port()
    monkeypatch.setenv("TANDEM_GRPC_TOKEN", "t0ken")
    server = ShardServer(str(tmp_path / "trainer"), _cfg(grpc_bind=f"127.0.0.1:{port}"))
    spool = tmp_path / "trainer" / "experience" / "w0"
    # ~100 KB each: far above the file buffer, so a spooled half is on disk
    x = encode(to_table([s for g in range(6) for s in make_group("w0", 0, g, 0, N, response_len=500)]))
    y = encode(to_table([s for g in range(5) for s in make_group("w0", 9, g, 0, N, response_len=500)]))
    half = len(x) // 2

    def temporaries() -> list:  # spooled beside experience/w0/ (layout.spool_tmp)
        return list(spool.parent.glob(".w0.*tmp-*")) if spool.parent.is_dir() else []

    def tmp_size() -> int:
        return max((p.stat().st_size for p in temporaries()), default=0)

    def stream(data: bytes, parts: list, gate: threading.Event | None = None):
        yield pb.ShardChunk(header=pb.ShardHeader(worker_id="w0", seq=0, size=len(data), schema_version=SCHEMA_VERSION))
        for i, part in enumerate(parts):
            if i == 1 and gate is not None:
                assert gate.wait(timeout=120)
            yield pb.ShardChunk(data=part)

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    push = pb_grpc.ExperienceStub(channel).Push
    meta = [("authorization", "Bearer t0ken")]
    go_a, go_b = threading.Event(), threading.Event()
    try:
        a = push.future(stream(x, [x[:half], b""], go_a), metadata=meta, timeout=120)
        _wait(lambda: tmp_size() >= half, "A to spool half the shard")
        b = push.future(stream(x, [x[:half], x[half:]], go_b), metadata=meta, timeout=120)
        _wait(lambda: _waiting_for_the_shard_lock(server.servicer) == 1, "B to wait for A")
        go_a.set()  # A's stream ends short: refused (DATA_LOSS), its temporary removed
        with pytest.raises(grpc.RpcError) as refused:
            a.result(timeout=60)
        assert refused.value.code() == grpc.StatusCode.DATA_LOSS
        _wait(lambda: tmp_size() >= half, "B to spool half the shard")
        c = push.future(stream(y, [y]), metadata=meta, timeout=120)
        _wait(lambda: c.done() or _waiting_for_the_shard_lock(server.servicer) == 1, "C to finish or to wait for B")
        go_b.set()
        acks = {}
        for name, call in (("B", b), ("C", c)):
            try:
                acks[name] = call.result(timeout=60).duplicate
            except grpc.RpcError as e:
                acks[name] = e.code().name
    finally:
        go_a.set()
        go_b.set()
        channel.close()
        server.stop()
    published = (spool / "000000000.arrow").read_bytes()
    load_shard(published)  # whole and undamaged
    stored = [name for name, dup in acks.items() if dup is False]
    assert len(stored) == 1, acks  # one push stored it, the other was a duplicate
    assert published == {"B": x, "C": y}[stored[0]]
    assert not temporaries()


# --- 3. one trainer per run folder --------------------------------------------------------------


def _wait_file(path, proc, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} before {what}:\n" + proc.stdout.read()[-3000:])
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.1)


def _wait_steps(root, proc, steps: int, timeout_s: float = 300) -> None:
    """Until metrics.jsonl holds `steps` lines (the file exists, empty, from the start)."""
    path = root / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while not path.exists() or path.read_text().count("\n") < steps:
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} before step {steps}:\n" + proc.stdout.read()[-3000:])
        assert time.monotonic() < deadline, f"no step {steps} within {timeout_s} s"
        time.sleep(0.1)


def _stop_group(proc) -> str:
    """SIGKILL a process started with start_new_session and everything it started."""
    import signal

    if proc.poll() is None:
        for pid in descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    return out


def test_a_second_trainer_on_the_run_folder_is_refused_naming_the_first(experience):
    import re
    import socket

    from conftest import STEPS, run_folder, trainer_proc

    root = run_folder(experience, "two_trainers")
    # more steps than the experience holds: the first trainer stays, waiting for more
    first = trainer_proc(
        root, experience / "model", 1, "trainer.save_freq=1", "trainer.data_timeout_s=600", steps=STEPS + 4
    )
    try:
        _wait_file(RunLayout(str(root)).checkpoint(1), first, "the first trainer's checkpoint")
        second = trainer_proc(root, experience / "model", 1, "trainer.data_timeout_s=20")
        try:
            out, _ = second.communicate(timeout=300)
        finally:
            _stop_group(second)
        assert first.poll() is None, "the first trainer must be unharmed"
    finally:
        _stop_group(first)
    assert second.returncode != 0, "a second trainer ran on the folder the first holds:\n" + out[-2000:]
    held = re.search(r"held by the trainer pid (\d+) on host (\S+)", out)
    assert held, out[-3000:]
    pid, host = int(held.group(1)), held.group(2).rstrip(",;:")
    assert host == socket.gethostname() and pid != second.pid
    assert "resumed from" not in out  # refused before it touched the run


# --- 2. trainer ranks die with their torchrun agent ----------------------------------------------


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # zombies are dead
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_killing_torchrun_kills_its_ranks(experience):
    import signal

    from conftest import STEPS, run_folder, trainer_proc

    root = run_folder(experience, "agent_killed")
    # more steps than the experience holds: the ranks stay, waiting for more
    p = trainer_proc(root, experience / "model", 2, "trainer.data_timeout_s=600", steps=STEPS + 4)
    ranks: list[int] = []
    try:
        _wait_steps(root, p, 1)
        ranks = [pid for pid in descendants(p.pid) if _alive(pid)]
        assert len(ranks) >= 2, ranks  # torchrun's ranks (and any helper they started)
        os.killpg(p.pid, signal.SIGKILL)  # what a user's kill -9 of the job does
        p.wait(timeout=60)
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks if _alive(pid)], "ranks outlived their torchrun agent"
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _stop_group(p)


# --- 4. experience of another run, or from the future, is refused ------------------------------


def test_leftover_experience_of_another_run_is_not_trained_on(experience, tmp_path):
    import shutil
    import subprocess
    import sys

    from conftest import STEPS

    root = tmp_path / "fresh"
    shutil.copytree(experience / "data" / "experience", root / "experience")  # only experience/
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.main",
            f"root={root}",
            f"actor_rollout_ref.model.path={experience / 'model'}",
            f"trainer.total_training_steps={STEPS}",
            "data.train_batch_size=4",
            "trainer.max_staleness=1000",
            # the reader's first pass ingests (and here quarantines) every shard on disk before
            # it looks at the clock, so a short wait is enough to see all of them refused
            "trainer.data_timeout_s=3",
            "buffer.poll_interval=0.1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert p.returncode != 0, "the trainer trained on another run's experience"
    assert not (root / "metrics.jsonl").exists() or not (root / "metrics.jsonl").read_text()
    reasons = [r.read_text() for r in (root / "quarantine").rglob("*.reason.txt")]
    assert reasons and all("another run" in r for r in reasons), reasons[:1]


def test_reader_refuses_shards_of_another_run_without_a_run_id_or_from_the_future(tmp_path):
    from buffer.storage import atomic_write_json, filesystem

    root = str(tmp_path / "run")
    layout = RunLayout(root)
    fs, _ = filesystem(root)

    def write(worker: str, run_id: str | None, version: int) -> None:
        if run_id is None:
            fs.rm_file(layout.run_info) if fs.exists(layout.run_info) else None
        else:
            atomic_write_json(fs, layout.run_info, {"run_id": run_id})
        w = ShardWriter.at(root, worker, _cfg())
        w.add_group(make_group(worker, 0, 0, version, N))

    write("other", "r-old", 0)
    write("nobody", None, 0)
    write("future", "r-now", 7)
    write("ok", "r-now", 2)
    reader = ExperienceReader(root, _cfg(), max_staleness=10, run_id="r-now")
    try:
        [group] = reader.next_batch(1, current_version=2, timeout_s=10)
        with pytest.raises(TimeoutError):
            reader.next_batch(1, current_version=2, timeout_s=1)
    finally:
        reader.close()
    assert group.samples[0].worker_id == "ok"
    reasons = {
        w: (tmp_path / "run" / "quarantine" / w / "000000000.arrow.reason.txt").read_text()
        for w in ("other", "nobody", "future")
    }
    assert "another run" in reasons["other"] and "r-old" in reasons["other"]
    assert "no run id" in reasons["nobody"]
    assert "weight version 7" in reasons["future"] and "v2" in reasons["future"]


def test_shards_of_schema_version_2_are_still_read():
    """Version 3 only adds the run id to the metadata: version-2 shards (and checkpoint pools)
    still decode."""
    from protocol.experience import SCHEMA_VERSION_KEY, decode, encode, from_table, to_table

    table = to_table(make_group("w0", 0, 0, 0, N))
    old = table.replace_schema_metadata({**table.schema.metadata, SCHEMA_VERSION_KEY: b"2"})
    assert [s.sample_id for s in from_table(decode(encode(old)))] == [s.sample_id for s in make_group("w0", 0, 0, 0, N)]


# --- 9. concurrent control commands are all kept, each under its own id -------------------------

CONTROL_AT_ONCE = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
from launch import control
root, me, go = sys.argv[2], sys.argv[3], sys.argv[4]
open(f"{go}.ready-{me}", "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(go):  # all processes released at once: the race a user meets
    assert time.monotonic() < deadline
    time.sleep(0.001)
sys.exit(control.main(["--root", root, "add", "1"]))
"""


def test_concurrent_control_commands_are_all_kept_with_distinct_ids(tmp_path):
    import re
    import subprocess
    import sys

    from conftest import REPO_ROOT, subprocess_env

    from launch.pool import Pool, PoolConfig
    from protocol.config import build

    root, go, k = tmp_path / "run", tmp_path / "go", 8
    root.mkdir()
    script = tmp_path / "add.py"
    script.write_text(CONTROL_AT_ONCE)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(REPO_ROOT), str(root), str(i), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=subprocess_env(),
        )
        for i in range(k)
    ]
    try:
        _wait(lambda: len(list(tmp_path.glob("go.ready-*"))) == k, "the processes to start", 300)
        go.touch()
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert all(p.returncode == 0 for p in procs), outs
    ids = [re.search(r"\(command (\S+)\)", out).group(1) for out in outs]
    assert len(set(ids)) == k, ids  # every command printed its own id
    pool = Pool(build(PoolConfig, {"root": str(root), "pool.initial_workers": "1"}), [])
    pool.apply_new_commands()
    assert pool.state["target"] == 1 + k and sorted(pool.state["applied"]) == sorted(ids)


# --- 5. the backlog drains: quarantined and stale samples retire, big steps fit, idle flushes --


def _progress(root) -> dict:
    import json

    try:
        return json.loads((root / "progress.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def test_quarantined_and_stale_samples_are_retired_while_the_trainer_waits(experience):
    """2 of 8 shards damaged, max_staleness=1: after two steps every other sample is stale.
    While the trainer waits for more, progress.json must count every written sample as retired
    (trained, dropped as stale, or quarantined), or the workers' backpressure never lets them
    write what the trainer waits for."""
    from conftest import GROUPS, STEPS, run_folder, trainer_proc
    from conftest import N as SAMPLES

    root = run_folder(experience, "retire")
    for seq in (2, 3):
        shard = root / "experience" / "w0" / f"{seq:09d}.arrow"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    p = trainer_proc(
        root, experience / "model", 1, "trainer.max_staleness=1", "trainer.data_timeout_s=600", steps=STEPS
    )
    written = STEPS * GROUPS * SAMPLES
    try:
        _wait_steps(root, p, 1)
        deadline = time.monotonic() + 120
        while _progress(root).get("samples_retired") != written:
            assert p.poll() is None, p.stdout.read()[-3000:]
            assert time.monotonic() < deadline, f"progress.json: {_progress(root)}"
            time.sleep(0.2)
    finally:
        _stop_group(p)
    assert len(list((root / "quarantine" / "w0").glob("*.reason.txt"))) == 2


def test_a_step_larger_than_the_backlog_cap_completes(tmp_path):
    """64 groups x 16 samples per step, with workers capped at 256 unretired samples."""
    import json
    import subprocess

    root = tmp_path / "run"
    p = subprocess.run(
        launch_local(
            "--root",
            str(root),
            "--steps",
            "2",
            "--workers",
            "1",
            "--nproc",
            "1",
            "--timeout",
            "600",
            "--test-freq",
            "0",
            "--trainer",
            "data.train_batch_size=64",
        ),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert len(split_metrics(rows)[0]) == 2


def test_a_worker_blocked_by_backpressure_still_flushes_by_age(tmp_path):
    """Once the worker runs, another worker's heartbeat fills the backlog: ours blocks with its
    last batch buffered (below flush_samples). That batch must be published after
    flush_interval, while it waits, not sit there until the worker exits (or is lost, if the
    wait times out)."""
    import json
    import subprocess
    import sys

    from buffer.storage import atomic_write_json, filesystem
    from buffer.weights.fs import WeightStore
    from rollout import builtin_task

    builtin_task.write_model(tmp_path / "m")
    builtin_task.write_parquet(tmp_path / "t.parquet", builtin_task.make_rows(50, 3))
    root = tmp_path / "run"
    WeightStore(str(root)).publish_hf_folder(tmp_path / "m", 0, 0, keep=2)
    fs, _ = filesystem(str(root))
    layout = RunLayout(str(root))
    log_path = tmp_path / "worker.log"
    log = open(log_path, "w")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout.worker",
            f"root={root}",
            "worker.id=w",
            f"data.train_files=[{tmp_path / 't.parquet'}]",
            "data.max_response_length=3",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.prompts_per_batch=2",
            "buffer.flush_samples=1000",
            "buffer.flush_interval=2",
            "buffer.max_backlog_samples=64",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )

    def beat() -> dict:
        try:
            return json.loads((root / "workers" / "w.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def published() -> int:
        return sum(len(from_table(decode(f.read_bytes()))) for f in (root / "experience" / "w").glob("*.arrow"))

    try:
        _wait(lambda: published() > 0 or p.poll() is not None, "a first shard (by age)", 300)
        atomic_write_json(fs, layout.heartbeat("other"), {"worker_id": "other", "samples_written": 10_000})
        _wait(
            lambda: "waiting for the trainer" in log_path.read_text() or p.poll() is not None,
            "the worker to block",
            300,
        )
        # every batch it generated (8 samples each) published, and its heartbeat says so
        _wait(
            lambda: (
                p.poll() is not None or (beat().get("samples_written") == 8 * beat().get("batches", -1) == published())
            ),
            "the buffered batch to be published while blocked",
            120,
        )
        assert p.poll() is None, log_path.read_text()[-3000:]
    finally:
        atomic_write_json(fs, layout.done_marker, {})
        try:
            p.wait(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
            log.close()


# --- 6. backpressure over gRPC: a trainer that stops consuming stops the spool growing ---------


def test_reader_reads_no_further_than_a_step_needs(tmp_path):
    root = str(tmp_path / "run")
    w = ShardWriter.at(root, "w0", _cfg())
    for g in range(20):
        w.add_group(make_group("w0", 0, g, 0, N))  # one group per shard
    reader = ExperienceReader(root, _cfg(), max_staleness=10)
    try:
        assert len(reader.next_batch(2, 0, timeout_s=10)) == 2
        assert len(reader.pool) <= 1 and reader.stats["shards_read"] <= 3  # not all 20 in memory
        got = [g for _ in range(18) for g in reader.next_batch(1, 0, timeout_s=10)]
    finally:
        reader.close()
    assert len(got) == 18


def test_grpc_spool_stops_growing_while_the_trainer_does_not_consume(tmp_path, monkeypatch):
    from buffer.control.backpressure import retired

    port = free_port()
    monkeypatch.setenv("TANDEM_GRPC_TOKEN", "t0ken")
    cap, inflight, shards = 4 * N, 2, 20
    cfg = _grpc_cfg(port, grpc_max_inflight=inflight, max_backlog_samples=cap, backlog_timeout_s=300)
    spool = tmp_path / "trainer"
    reader = ExperienceReader(str(spool), _cfg(), max_staleness=10)
    server = setup_trainer_run(str(spool)).serve(
        cfg, consumed=lambda: reader.consumed, retired=lambda: retired(reader.stats)
    )
    writer = ShardWriter.at(str(tmp_path / "worker"), "w0", cfg)
    import threading

    produced = threading.Thread(
        target=lambda: [writer.add_group(make_group("w0", 0, g, 0, N)) for g in range(shards)], daemon=True
    )
    try:
        produced.start()
        _wait(lambda: server.servicer.stats["backpressure"] > 0, "the server to push back")
        on_disk = len(list((spool / "experience" / "w0").glob("*.arrow")))
        # the cap's shards, plus the pushes admitted at the same moment
        assert on_disk <= cap // N + inflight, on_disk
        assert produced.is_alive()  # the worker waits (flow control), it does not fail
        got = [g for _ in range(shards) for g in reader.next_batch(1, 0, timeout_s=60)]
        produced.join(timeout=60)
        writer.close(timeout_s=60)
    finally:
        writer.sink.stopping = True  # no-op after a clean close; after a failure, no sender left retrying
        writer.sink.senders.shutdown(wait=True)
        server.stop()
        reader.close()
    assert sorted(g.samples[0].prompt_id for g in got) == sorted(f"w0/0/{g}" for g in range(shards))


# --- 10. a full disk: every role says so, waits, and goes on when space returns ----------------

FILL_DISK = r"""
import json, os, shutil, subprocess, sys, time
from conftest import fill_disk
small, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
root = os.path.join(small, "run")
# logs on the big disk (a bind mount in this namespace): what a full disk does to a log file
# is not what this test is about, and the roles' "disk full at" lines must be readable
os.makedirs(os.path.join(root, "logs"))
os.makedirs(os.path.join(out, "logs"))
subprocess.run(["mount", "--bind", os.path.join(out, "logs"), os.path.join(root, "logs")], check=True)
log = open(os.path.join(out, "launch.log"), "w")
run = subprocess.Popen([sys.executable, "-m", "launch.local", "--no-report", "--root", root, "--steps", str(steps),
                        "--nproc", "1", "--timeout", "1500", "--trainer", "trainer.save_freq=2",
                        "--trainer", "trainer.log_sample_ids=true"], stdout=log, stderr=subprocess.STDOUT)

def lines(name):
    try:
        with open(os.path.join(root, name)) as f:
            return f.read()
    except FileNotFoundError:
        return ""

def wait(cond, what, timeout=900):
    deadline = time.monotonic() + timeout
    while not cond():
        if run.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what} (launch.local: {run.poll()})")
        time.sleep(0.2)


filler = os.path.join(small, "filler")
roles = ["logs/trainer.log", "logs/worker-w0.log", "logs/worker-w1.log"]


def fill_and_free():
    fill_disk(filler)
    full_at = time.time()
    try:
        # the disk stays full until every role has said so: space a role frees (the temporaries
        # of its failed attempt) is taken again at once
        wait(lambda: (fill_disk(filler), all("disk full at" in lines(r) for r in roles))[1],
             "every role to say disk full", 300)
    finally:
        os.remove(filler)
    code = run.wait(timeout=1500)
    leftovers = [os.path.join(d, n) for d, dirs, names in os.walk(root) for n in names + dirs
                 if ".tmp-" in n]
    json.dump({"code": code, "full_for_s": time.time() - full_at, "leftovers": leftovers},
              open(os.path.join(out, "result.json"), "w"))


try:
    wait(lambda: lines("metrics.jsonl").count('"reward/mean"') >= 3, "3 steps")  # not val rows
    fill_and_free()
finally:
    if run.poll() is None:
        run.terminate()  # launch.local stops its children
        run.wait(timeout=300)
    shutil.copytree(root, os.path.join(out, "run"), ignore=shutil.ignore_patterns("init_model", "logs"))
"""


def test_every_role_outlives_a_full_disk(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import subprocess_env

    small, out, steps = tmp_path / "small", tmp_path / "out", 10
    small.mkdir()
    out.mkdir()
    script = tmp_path / "fill_disk.py"
    script.write_text(f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n" + FILL_DISK)
    p = subprocess.run(
        small_filesystem(small, 48, [sys.executable, str(script), str(small), str(out), str(steps)]),
        capture_output=True,
        text=True,
        timeout=2400,
        env=subprocess_env(),
    )
    logs = (
        "".join(f"\n--- {f.name}:\n" + f.read_text()[-1500:] for f in sorted((out / "logs").glob("*.log")))
        if (out / "logs").is_dir()
        else ""
    )
    assert p.returncode == 0 and (out / "result.json").exists(), (
        p.stdout[-2000:] + p.stderr[-2000:] + (out / "launch.log").read_text()[-1500:] + logs
    )
    result = json.loads((out / "result.json").read_text())
    assert result["code"] == 0, (out / "launch.log").read_text()[-3000:]
    rows, _ = split_metrics([json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()])
    assert sorted({r["step"] for r in rows}) == list(range(1, steps + 1))
    trained = [i for r in rows for i in r["samples/ids"]]
    assert len(trained) == len(set(trained))  # nothing trained twice on the way
    assert result["leftovers"] == []  # every role removed its own temporaries


def test_a_trainer_killed_before_its_first_checkpoint_starts_again(experience):
    """Killed before any checkpoint (the run could not resume at all): a restart begins again
    at step 0, versions keep counting, and every committed sample is trained exactly once on
    the final timeline."""
    import json
    import signal

    from conftest import STEPS, run_folder, trainer_proc

    from trainer.config import TrainerConfig

    save_freq = TrainerConfig.__dataclass_fields__["trainer"].default_factory().save_freq
    assert save_freq > 0, f"trainer.save_freq defaults to {save_freq}: a killed run cannot resume"
    root = run_folder(experience, "early_kill")
    p = trainer_proc(root, experience / "model", 2, "trainer.log_sample_ids=true", "trainer.save_freq=100")
    try:
        _wait_steps(root, p, 1)
        os.killpg(p.pid, signal.SIGKILL)
    finally:
        _stop_group(p)
    versions_before = max(int(n[1:]) for n in os.listdir(root / "weights") if n[1:].isdigit())
    # What a kill in the middle of a publish leaves (the kill above may or may not have hit
    # one): a staging folder with a partial weight file, which would fill a small disk again.
    debris = RunLayout(str(root)).version_tmp(versions_before + 1, 4242)
    os.makedirs(debris, exist_ok=True)
    with open(os.path.join(debris, "model.safetensors"), "wb") as f:
        f.write(b"\0" * 4096)
    p = trainer_proc(root, experience / "model", 1, "trainer.log_sample_ids=true")
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]
    assert not [n for n in os.listdir(root / "weights") if ".tmp-" in n]  # debris removed
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    final = {r["step"]: r for r in rows}  # the later line of a step is the final timeline's
    assert sorted(final) == list(range(1, STEPS + 1))
    assert final[1]["weights/version"] > versions_before
    trained = [i for r in final.values() for i in r["samples/ids"]]
    committed = {
        s.sample_id
        for f in (experience / "data" / "experience").rglob("*.arrow")
        for s in from_table(decode(f.read_bytes()))
    }
    assert len(trained) == len(set(trained)) and set(trained) == committed


# --- 11. the trainer checkpoints and exits when asked (SLURM's time-limit signal) ---------------


def test_a_stop_request_checkpoints_and_a_restart_resumes(experience):
    """What the trainer job's USR1 trap does (launch/slurm/trainer.sbatch): ROOT/trainer.stop.
    The trainer checkpoints and exits 0 without DONE; started again it resumes, and each
    committed sample is trained exactly once on the final timeline."""
    import json

    from conftest import STEPS, run_folder, trainer_proc

    root = run_folder(experience, "stopped")
    layout = RunLayout(str(root))
    p = trainer_proc(root, experience / "model", 2, "trainer.log_sample_ids=true", "trainer.save_freq=100")
    try:
        _wait_steps(root, p, 2)
        (root / "trainer.stop").write_text("job 42: time limit near\n")
        out, _ = p.communicate(timeout=300)
    finally:
        _stop_group(p)
    assert p.returncode == 0, out[-3000:]
    assert not (root / "DONE").exists(), "the trainer ran on to DONE: the stop request was ignored"
    assert not (root / "trainer.stop").exists()
    from buffer.checkpoints import FsCheckpoints

    assert FsCheckpoints(layout).latest_complete() is not None, "no checkpoint on the way out"
    p = trainer_proc(root, experience / "model", 2, "trainer.log_sample_ids=true")
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0 and "resumed from" in out, out[-3000:]
    assert (root / "DONE").exists()
    final = {}
    for line in (root / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        final[row["step"]] = row["samples/ids"]
    assert sorted(final) == list(range(1, STEPS + 1))
    trained = [i for ids in final.values() for i in ids]
    committed = {
        s.sample_id
        for f in (experience / "data" / "experience").rglob("*.arrow")
        for s in from_table(decode(f.read_bytes()))
    }
    assert len(trained) == len(set(trained)) and set(trained) == committed


# --- 12. launch.local: a trainer rank that dies is restarted with the others, as on SLURM -------


def test_launch_local_restarts_the_trainer_after_a_rank_dies(tmp_path):
    """A native crash of one rank (here SIGKILL by pid, after step 2): torchrun stops the other
    rank and starts both again (launch.local passes its --max-restarts, as SLURM and Ray do);
    they resume from the last checkpoint and the run ends well, every step on the final
    timeline, no sample trained twice. Before the fix the run ended with the trainer's failure."""
    import glob
    import json
    import subprocess

    from conftest import subprocess_env

    root, steps = tmp_path / "run", 5
    out_path = tmp_path / "launch.out"  # a file, not a pipe: nobody reads a pipe while the test waits
    with open(out_path, "w") as out_file:
        proc = subprocess.Popen(
            launch_local("--root", str(root), "--steps", str(steps), "--test-freq", "0", "--timeout", "400", "--nproc",
                         "2", "--trainer", "trainer.log_sample_ids=true", "--trainer", "trainer.save_freq=2"),
            stdout=out_file, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=subprocess_env(),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        metrics = root / "metrics.jsonl"
        while not metrics.exists() or metrics.read_text().count("\n") < 2:
            assert proc.poll() is None, out_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step 2 within 300 s"
            time.sleep(0.1)
        torchrun = next(
            pid for pid in descendants(proc.pid) if b"trainer.main" in open(f"/proc/{pid}/cmdline", "rb").read()
        )
        ranks = [int(c) for f in glob.glob(f"/proc/{torchrun}/task/*/children") for c in open(f).read().split()]
        os.kill(ranks[-1], 9)  # a rank (a child of torchrun's agent), as a native crash would end it
        proc.wait(timeout=450)
    finally:
        if proc.poll() is None:
            for pid in [*descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=60)
    assert proc.returncode == 0, out_path.read_text()[-3000:]
    rows, _ = split_metrics([json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()])
    final = {r["step"]: r for r in rows}  # a step logged twice (before the kill, resumed): the later line
    assert sorted(final) == list(range(1, steps + 1))
    trained = [i for r in final.values() for i in r["samples/ids"]]
    assert len(trained) == len(set(trained))
    assert "restart" in (root / "logs" / "trainer.log").read_text().lower()  # torchrun said so
