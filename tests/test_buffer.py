"""buffer: atomic shard publication, exactly-once discovery, staleness, flushing, backpressure."""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import TESTS_DIR, make_group, subprocess_env

from buffer.config import BufferConfig
from buffer.control.backpressure import backlog, wait_for_room
from buffer.experience.reader import ExperienceReader
from buffer.layout import TMP_MARK, RunLayout
from buffer.run import setup_trainer_run
from buffer.storage import atomic_write, atomic_write_json, filesystem
from buffer.writer import ShardWriter
from protocol.experience import SCHEMA_VERSION_KEY, check_rows, decode, encode, from_table, to_table


def _cfg(**kw) -> BufferConfig:
    base = dict(discovery="poll", poll_interval=0.02, flush_interval=3600.0)
    base.update(kw)
    return BufferConfig(**base)


def _published(wdir: Path) -> list[str]:
    return sorted(n for n in os.listdir(wdir) if RunLayout.shard_seq(n) is not None)


def _tmps(wdir: Path) -> list[str]:
    return sorted(n for n in os.listdir(wdir) if TMP_MARK in n)


def _big_tmps(wdir: Path) -> list[str]:
    out = []
    for name in _tmps(wdir):
        try:
            if (wdir / name).stat().st_size > 64_000:
                out.append(name)
        except FileNotFoundError:
            continue  # renamed into place meanwhile
    return out


def _read_shard(path) -> list:
    with open(path, "rb") as f:
        samples = from_table(decode(f.read()))
    check_rows(samples)
    return samples


def _wait_all(procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


# --- partial shards from a writer killed mid-publication ---------------------------------------

LOOP_WRITER = r"""
import os, sys
sys.path.insert(0, sys.argv[3])
from conftest import make_group
from buffer.config import BufferConfig
from buffer.writer import ShardWriter

root, wid = sys.argv[1], sys.argv[2]
GROUPS, N, RESPONSE = 50, 5, 2000           # 250 samples x ~2000 tokens: ~4 MB per shard
w = ShardWriter.at(root, wid, BufferConfig(flush_samples=GROUPS * N, flush_interval=3600.0))
while True:
    batch = w.seq                            # resumes after the last published shard
    for g in range(GROUPS):
        w.add_group(make_group(wid, batch, g, 0, N, prompt_len=32, response_len=RESPONSE))
"""


def test_killed_writer_leaves_only_temporaries_that_reader_ignores(tmp_path):
    root = tmp_path / "run"
    script = tmp_path / "loop_writer.py"
    script.write_text(LOOP_WRITER)
    wid = "killme"
    wdir = root / "experience" / wid
    rng = random.Random(1234)
    found_tmp = False
    attempts = 0
    while attempts < 12 and not (found_tmp and _published(wdir)):
        attempts += 1
        p = subprocess.Popen(
            [sys.executable, str(script), str(root), wid, str(TESTS_DIR)],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            time.sleep(rng.uniform(0.0, 1.5))
            # then SIGKILL as soon as a shard's temporary is being written (they exist for
            # ~10-100 ms), once some shard is published; not during the ~1 KB empty shard a
            # restarted writer may publish first. The writer needs seconds to import torch on a
            # loaded machine, so the wait is for those events, bounded generously.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and p.poll() is None:
                if wdir.is_dir() and _published(wdir) and _big_tmps(wdir):
                    break
                time.sleep(0.001)
            crashed = p.poll() is not None
        finally:
            p.kill()
            _, err = p.communicate(timeout=10)
        assert not crashed, err.decode()[-2000:]
        found_tmp = bool(_tmps(wdir))
    assert found_tmp, f"no temporary file left behind after {attempts} kills"
    published = _published(wdir)
    assert published, "no shard was published before the kills"
    tmps = _tmps(wdir)
    assert all(n.startswith(".") for n in tmps)

    reader = ExperienceReader(str(root), _cfg(), max_staleness=10)
    try:
        found = reader.discover()
        assert [p.rsplit("/", 1)[-1] for _, p in found] == published
        assert all(TMP_MARK not in p for _, p in found)
        expected_ids = []
        n_groups = 0
        for key, path in found:
            assert key == f"{wid}/{RunLayout.shard_seq(path)}"
            samples = _read_shard(path)  # decodes, schema and rows valid
            # empty: a number the killed writer claimed but never published, filled on restart
            assert len(samples) == 0 or (len(samples) == 250 and os.path.getsize(path) > 3_000_000)
            expected_ids += [s.sample_id for s in samples]
            n_groups += len({s.group_id for s in samples})
        assert len(set(expected_ids)) == len(expected_ids)

        batch = reader.next_batch(n_groups, current_version=0, timeout_s=30)
        got = [s.sample_id for g in batch for s in g.samples]
        assert sorted(got) == sorted(expected_ids)
        assert reader.stats["bad_shards"] == 0
        assert reader.stats["shards_read"] == len(published)
        assert reader.discover() == []  # the temporaries are never offered
    finally:
        reader.close()


# --- exactly-once consumption with concurrent writers ------------------------------------------

GROUP_WRITER = r"""
import random, sys, time
sys.path.insert(0, sys.argv[3])
from conftest import make_group
from buffer.config import BufferConfig
from buffer.writer import ShardWriter

root, wid = sys.argv[1], sys.argv[2]
batches, groups, n, flush = (int(a) for a in sys.argv[4:8])
rng = random.Random(wid)
w = ShardWriter.at(root, wid, BufferConfig(flush_samples=flush, flush_interval=3600.0))
for b in range(batches):
    for g in range(groups):
        w.add_group(make_group(wid, b, g, 0, n))
        time.sleep(rng.uniform(0, 0.004))
w.flush()
print(w.samples_written, w.shards_written)
"""


def test_exactly_once_with_two_concurrent_writers(tmp_path):
    root = tmp_path / "run"
    script = tmp_path / "group_writer.py"
    script.write_text(GROUP_WRITER)
    workers, batches, groups, n, flush = ["w-a", "w-b"], 6, 5, 4, 10
    # The writer renames ids after the shard they land in; prompt_id + member index identify
    # what the test wrote.
    expected = {(f"{w}/{b}/{g}", k) for w in workers for b in range(batches) for g in range(groups) for k in range(n)}
    total_groups = len(workers) * batches * groups  # 60
    per_batch = 6

    cfg = _cfg(discovery="auto")  # polling plus watchdog events
    reader = ExperienceReader(str(root), cfg, max_staleness=0)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(root), w, str(TESTS_DIR), str(batches), str(groups), str(n), str(flush)],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in workers
    ]
    try:
        received = []
        while len(received) < total_groups:
            batch = reader.next_batch(per_batch, current_version=0, timeout_s=30)
            assert len(batch) == per_batch
            received += batch
        _wait_all(procs, timeout=30)
        for p in procs:
            out, err = p.communicate(timeout=10)
            assert p.returncode == 0, err
            assert out.split() == [str(batches * groups * n), str(-(-batches * groups * n // 12))]
    finally:
        _wait_all(procs, timeout=0)
    try:
        ids = collections.Counter(s.sample_id for g in received for s in g.samples)
        assert all(c == 1 for c in ids.values()), [i for i, c in ids.items() if c > 1]
        written = collections.Counter(
            (s.prompt_id, int(s.sample_id.rsplit("/", 1)[1])) for g in received for s in g.samples
        )
        assert set(written) == expected
        assert all(c == 1 for c in written.values())
        assert all(len(g.samples) == n for g in received)
        assert len({g.group_id for g in received}) == total_groups
        assert reader.stats["consumed_samples"] == len(expected)
        n_shards = sum(len(_published(root / "experience" / w)) for w in workers)
        assert reader.stats["shards_read"] == n_shards
        assert len(reader.consumed) == n_shards

        # a second pass finds nothing new
        with pytest.raises(TimeoutError):
            reader.next_batch(1, current_version=0, timeout_s=0.3)
        assert len(reader.pool) == 0
        assert reader.stats["shards_read"] == n_shards

        # a restarted reader that is handed the consumed set discovers nothing ...
        again = ExperienceReader(str(root), _cfg(), max_staleness=0, consumed=reader.consumed)
        try:
            assert again.discover() == []
            # ... until a (restarted) writer publishes more: only that shard is new
            seq_a = len(_published(root / "experience" / "w-a"))
            w = ShardWriter.at(str(root), "w-a", _cfg(flush_samples=1))
            path = w.add_group(make_group("w-a", "late", 0, 0, n))
            assert path is not None and RunLayout.shard_seq(path) == seq_a
            assert again.discover() == [(f"w-a/{seq_a}", path)]
            [g] = again.next_batch(1, current_version=0, timeout_s=5)
            assert {s.sample_id for s in g.samples} == {f"w-a/{seq_a}/0/{k}" for k in range(n)}
            assert {s.prompt_id for s in g.samples} == {"w-a/late/0"}
        finally:
            again.close()
        # a reader without the consumed set sees everything again
        fresh = ExperienceReader(str(root), _cfg(), max_staleness=0)
        try:
            assert len(fresh.discover()) == n_shards + 1
        finally:
            fresh.close()
    finally:
        reader.close()


def test_writer_resumes_sequence_after_restart(tmp_path):
    root = str(tmp_path / "run")
    w = ShardWriter.at(root, "w0", _cfg(flush_samples=1))
    paths = [w.add_group(make_group("w0", 0, g, 0, 2)) for g in range(3)]
    assert [RunLayout.shard_seq(p) for p in paths] == [0, 1, 2]
    # a leftover temporary of an unpublished seq must not advance the sequence
    layout = RunLayout(str(tmp_path / "run"))
    Path(layout.shard_tmp("w0", 7, 999)).write_bytes(b"partial")
    w2 = ShardWriter.at(root, "w0", _cfg(flush_samples=1))
    assert w2.seq == 3
    assert RunLayout.shard_seq(w2.add_group(make_group("w0", 1, 0, 0, 2))) == 3


# --- staleness ---------------------------------------------------------------------------------


def test_stale_groups_are_dropped_and_counted(tmp_path):
    root = str(tmp_path / "run")
    n, per_version = 3, 2
    w = ShardWriter.at(root, "w0", _cfg(flush_samples=n * per_version))
    for version in range(6):
        for g in range(per_version):
            w.add_group(make_group("w0", version, g, version, n))
    assert w.pending == [] and w.shards_written == 6

    reader = ExperienceReader(root, _cfg(), max_staleness=2)
    try:
        fresh = reader.next_batch(3 * per_version, current_version=5, timeout_s=5)
        assert sorted(g.weight_version for g in fresh) == [3, 3, 4, 4, 5, 5]
        assert all(s.weight_version == g.weight_version for g in fresh for s in g.samples)
        assert reader.stats["dropped_stale_samples"] == 3 * per_version * n
        assert reader.stats["consumed_samples"] == 3 * per_version * n
        with pytest.raises(TimeoutError):
            reader.next_batch(1, current_version=5, timeout_s=0.2)
        assert reader.stats["dropped_stale_samples"] == 3 * per_version * n
    finally:
        reader.close()


def test_pooled_groups_go_stale_when_version_advances(tmp_path):
    root = str(tmp_path / "run")
    n = 2
    w = ShardWriter.at(root, "w0", _cfg(flush_samples=100))
    for g in range(4):
        w.add_group(make_group("w0", 0, g, 1, n))
    w.flush()
    reader = ExperienceReader(root, _cfg(), max_staleness=1)
    try:
        assert len(reader.next_batch(1, current_version=2, timeout_s=5)) == 1
        assert len(reader.pool) == 3 and reader.stats["dropped_stale_samples"] == 0
        with pytest.raises(TimeoutError):
            reader.next_batch(1, current_version=3, timeout_s=0.1)
        assert len(reader.pool) == 0
        assert reader.stats["dropped_stale_samples"] == 3 * n
    finally:
        reader.close()


# --- groups and flushing -----------------------------------------------------------------------


@pytest.mark.parametrize("n,flush_samples", [(5, 2), (3, 7), (4, 4)])
def test_groups_never_split_across_shards(tmp_path, n, flush_samples):
    root = tmp_path / "run"
    w = ShardWriter.at(str(root), "w0", _cfg(flush_samples=flush_samples))
    num_groups = 9
    for g in range(num_groups):
        w.add_group(make_group("w0", 0, g, 0, n))
    w.flush()
    wdir = root / "experience" / "w0"
    seen = collections.Counter()
    shard_sizes = []
    for name in _published(wdir):
        samples = _read_shard(wdir / name)
        shard_sizes.append(len(samples))
        per_group = collections.Counter(s.group_id for s in samples)
        assert all(c == n for c in per_group.values()), (name, per_group)
        seen.update(per_group.keys())
    assert len(seen) == num_groups and all(c == 1 for c in seen.values())
    # a shard is published as soon as the buffered whole groups reach flush_samples
    per_shard = -(-flush_samples // n) * n
    assert shard_sizes[:-1] == [per_shard] * (len(shard_sizes) - 1)
    assert sum(shard_sizes) == num_groups * n
    assert w.samples_written == num_groups * n and w.shards_written == len(shard_sizes)


def test_add_group_rejects_bad_rows_without_buffering(tmp_path):
    w = ShardWriter.at(str(tmp_path / "run"), "w0", _cfg(flush_samples=1))
    group = make_group("w0", 0, 0, 0, 2)
    group[1].behaviour_logprobs.pop()
    with pytest.raises(ValueError):
        w.add_group(group)
    assert w.pending == [] and w.shards_written == 0


def test_flush_by_age(tmp_path):
    # Young groups stay pending: with a one-hour flush_interval no check can come too late.
    young = ShardWriter.at(str(tmp_path / "young"), "w0", _cfg(flush_samples=1000, flush_interval=3600.0))
    assert young.maybe_flush() is None  # nothing pending
    assert young.add_group(make_group("w0", 0, 0, 0, 2)) is None
    first = young.oldest_pending
    assert young.add_group(make_group("w0", 0, 1, 0, 2)) is None
    assert young.oldest_pending == first  # the age counts from the first pending group
    assert young.maybe_flush() is None and _published(tmp_path / "young" / "experience" / "w0") == []

    # An old group is published by the next check: wait for it (no fixed sleep), then check it
    # was not published before it was flush_interval old.
    interval = 0.3
    root = tmp_path / "run"
    w = ShardWriter.at(str(root), "w0", _cfg(flush_samples=1000, flush_interval=interval))
    wdir = root / "experience" / "w0"
    added = time.monotonic()
    w.add_group(make_group("w0", 1, 0, 0, 2))
    deadline = added + 60
    while not _published(wdir):
        assert time.monotonic() < deadline, "a pending group was not published within 60 s"
        w.maybe_flush()
        time.sleep(0.01)
    assert time.monotonic() - added >= interval
    assert _published(wdir) == ["000000000.arrow"] and len(_read_shard(wdir / "000000000.arrow")) == 2
    assert w.maybe_flush() is None and w.pending == []
    # the age restarts with the next group
    flushed = time.monotonic()
    w.add_group(make_group("w0", 2, 0, 0, 2))
    assert w.oldest_pending >= flushed


def test_shard_metadata(tmp_path):
    root = tmp_path / "run"
    w = ShardWriter.at(str(root), "w0", _cfg(flush_samples=1))
    path = w.add_group(make_group("w0", 0, 0, 0, 2))
    with open(path, "rb") as f:
        meta = decode(f.read()).schema.metadata
    assert meta[b"tandem.worker_id"] == b"w0"
    assert meta[b"tandem.shard_seq"] == b"0"
    assert SCHEMA_VERSION_KEY in meta


def test_reader_skips_unreadable_shard(tmp_path):
    root = tmp_path / "run"
    layout = RunLayout(str(root))
    fs, _ = filesystem(str(root))
    good = to_table(make_group("w0", 0, 0, 0, 2))
    atomic_write(fs, layout.shard("w0", 0), encode(good.replace_schema_metadata(None)))
    atomic_write(fs, layout.shard("w0", 1), b"not arrow at all")
    atomic_write(fs, layout.shard("w0", 2), encode(to_table(make_group("w0", 0, 1, 0, 2))))
    reader = ExperienceReader(str(root), _cfg(), max_staleness=0)
    try:
        [g] = reader.next_batch(1, current_version=0, timeout_s=5)
        assert g.group_id == "w0/0/1"
        assert reader.stats["bad_shards"] == 2 and reader.stats["shards_read"] == 1
        assert reader.discover() == []
    finally:
        reader.close()


# --- backpressure ------------------------------------------------------------------------------


def _beat(fs, layout, worker_id, written):
    atomic_write_json(
        fs, layout.heartbeat(worker_id), {"worker_id": worker_id, "samples_written": written, "state": "running"}
    )


def _progress(fs, layout, retired):
    atomic_write_json(fs, layout.progress, {"samples_retired": retired})


def test_backlog_from_heartbeats_and_progress(tmp_path):
    fs, root = filesystem(str(tmp_path / "run"))
    layout = RunLayout(root)
    run = setup_trainer_run(root)
    assert backlog(run.heartbeats, run.progress) == 0  # nothing yet
    _beat(fs, layout, "w-a", 100)
    _beat(fs, layout, "w-b", 40)
    assert backlog(run.heartbeats, run.progress) == 140
    _progress(fs, layout, 90)
    assert backlog(run.heartbeats, run.progress) == 50
    # leftovers of an interrupted heartbeat write are not counted
    Path(layout.heartbeat("w-a") + ".tmp-4242").write_text('{"samples_written": 1000}')
    assert backlog(run.heartbeats, run.progress) == 50
    _beat(fs, layout, "w-a", 130)
    assert backlog(run.heartbeats, run.progress) == 80


def test_wait_for_room(tmp_path):
    fs, root = filesystem(str(tmp_path / "run"))
    layout = RunLayout(root)
    run = setup_trainer_run(root)
    _beat(fs, layout, "w-a", 100)
    _progress(fs, layout, 60)  # backlog 40
    never = lambda: False  # noqa: E731

    # With room it returns without waiting: timeout_s=0 raises as soon as it would have to wait.
    wait_for_room(run.heartbeats, run.progress, limit=50, timeout_s=0, should_stop=never)
    wait_for_room(run.heartbeats, run.progress, limit=40, timeout_s=0, should_stop=never)  # the limit is room enough

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="max_backlog_samples=39"):
        wait_for_room(run.heartbeats, run.progress, limit=39, timeout_s=0.3, should_stop=never, poll_s=0.05)
    assert time.monotonic() - t0 >= 0.3

    # a stop request ends the wait even while the backlog is too large
    wait_for_room(run.heartbeats, run.progress, limit=10, timeout_s=0, should_stop=lambda: True)

    # progress by the trainer releases a waiting worker; the trainer moves once the worker waits
    # (wait_for_room asks should_stop only while the backlog is too large)
    waiting = threading.Event()

    def still_waiting():
        waiting.set()
        return False

    trainer = threading.Thread(target=lambda: waiting.wait(60) and _progress(fs, layout, 95))
    trainer.start()
    try:
        waited = wait_for_room(
            run.heartbeats, run.progress, limit=10, timeout_s=60, should_stop=still_waiting, poll_s=0.05
        )
    finally:
        trainer.join(timeout=60)
    assert waiting.is_set() and waited > 0
    assert backlog(run.heartbeats, run.progress) == 5


def test_restarted_writer_resumes_count_and_ids_after_shards_are_deleted(tmp_path):
    """A worker restarted under the same id, after consumed shards were deleted, neither
    reuses a shard name (the trainer would skip it as consumed) nor undercounts its samples
    (backpressure would loosen)."""
    root = str(tmp_path / "run")
    w = ShardWriter.at(root, "w0", _cfg(flush_samples=4))
    for g in range(3):
        w.add_group(make_group("w0", 0, g, 0, 4))
    beat = {"next_seq": w.seq, "samples_written": w.samples_written}
    w.add_group(make_group("w0", 0, 3, 0, 4))  # published after the last heartbeat
    wdir = tmp_path / "run" / "experience" / "w0"
    ids_before = {s.sample_id for name in _published(wdir) for s in from_table(decode((wdir / name).read_bytes()))}
    for name in _published(wdir)[:3]:
        (wdir / name).unlink()  # retention removed the consumed ones
    again = ShardWriter.at(root, "w0", _cfg(flush_samples=4), resume=beat)
    assert again.seq == 4 and again.samples_written == 16
    path = again.add_group(make_group("w0", 1, 0, 0, 4))
    assert RunLayout.shard_seq(path) == 4
    new_ids = {s.sample_id for s in from_table(decode(open(path, "rb").read()))}
    assert new_ids and not new_ids & ids_before


# --- one live writer per worker id ---------------------------------------------------------------

_HOLDER = """
import sys, time
from buffer.config import BufferConfig
from buffer.writer import ShardWriter
ShardWriter.at(sys.argv[1], "w0", BufferConfig())
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _holder(root: Path, hold_s: float) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root), str(hold_s)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    assert p.stdout.readline().strip() == "holding", "the first writer did not start"
    return p


def test_a_second_live_writer_of_a_worker_id_fails_naming_the_holder(tmp_path):
    """Issue 30 item 2: two writers of w0 on one folder would overwrite each other's shards.
    The second fails (after buffer.worker_lock_wait_s) naming the id and the holder's pid; one
    that starts while the holder is still exiting waits for it (a pool's restart)."""
    from buffer.experience.base import WorkerIdInUse

    root = tmp_path / "run"
    first = _holder(root, 60)
    try:
        with pytest.raises(WorkerIdInUse, match=rf"worker id w0 is in use by another live worker, pid {first.pid}"):
            ShardWriter.at(str(root), "w0", _cfg(worker_lock_wait_s=0.5))
        ShardWriter.at(str(root), "w1", _cfg(worker_lock_wait_s=0.5))  # another id is free
    finally:
        first.kill()  # ours (Popen above), by its pid
        first.wait(timeout=30)
    again = _holder(root, 1.5)  # exits 1.5 s from now, while the next writer waits for it
    try:
        started = time.monotonic()
        w = ShardWriter.at(str(root), "w0", _cfg(worker_lock_wait_s=30))
        assert time.monotonic() - started >= 0.5 and again.wait(timeout=30) == 0
        w.add_group(make_group("w0", 0, 0, 0, 2))
        assert w.flush() is not None
    finally:
        if again.poll() is None:
            again.kill()
            again.wait(timeout=30)
