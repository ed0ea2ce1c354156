"""buffer: shard integrity and quarantine, retention, stale temporaries, probing discovery,
`python -m buffer.inspect`. Real files and processes; every wait has a timeout."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import REPO_ROOT, TESTS_DIR, make_group, subprocess_env

from buffer.config import BufferConfig
from buffer.experience.reader import ExperienceReader
from buffer.experience.retention import clean_stale_temps, prune_consumed
from buffer.inspect import report as inspect_report
from buffer.layout import TMP_MARK, RunLayout
from buffer.storage import atomic_write, atomic_write_json, filesystem
from buffer.writer import ShardWriter
from protocol.experience import (
    TRAILER_SIZE,
    IntegrityError,
    SchemaError,
    StreamVerifier,
    decode,
    encode,
    from_table,
    load_shard,
    to_table,
)

N = 3  # samples per group


def _cfg(**kw) -> BufferConfig:
    base = dict(discovery="poll", poll_interval=0.02, flush_interval=3600.0)
    base.update(kw)
    return BufferConfig(**base)


def _publish(root: str, worker: str, groups: int, version: int = 0, resume=None) -> ShardWriter:
    """One shard per group (flush_samples=1)."""
    w = ShardWriter.at(root, worker, _cfg(flush_samples=1), resume=resume)
    for g in range(groups):
        w.add_group(make_group(worker, "t", g, version, N))
    return w


def _reader(root: str, **kw) -> ExperienceReader:
    return ExperienceReader(root, kw.pop("cfg", _cfg()), max_staleness=kw.pop("max_staleness", 100), **kw)


def _drain(reader: ExperienceReader, groups: int, version: int = 0, timeout_s: float = 10) -> list:
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < groups:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(got)}/{groups} groups within {timeout_s} s"
        got += reader.next_batch(1, version, timeout_s=left)
    return got


def _quarantined(root: Path, worker: str) -> dict[str, str]:
    qdir = root / "quarantine" / worker
    if not qdir.is_dir():
        return {}
    return {
        n: (qdir / (n + ".reason.txt")).read_text() for n in sorted(os.listdir(qdir)) if not n.endswith(".reason.txt")
    }


def _mutate(path: str, fn) -> None:
    data = bytearray(Path(path).read_bytes())
    Path(path).write_bytes(bytes(fn(data)))


def _flip(data: bytearray, at: int) -> bytearray:
    data[at] ^= 0x5A
    return data


# --- the byte format ---------------------------------------------------------------------------


def test_trailer_catches_flips_truncation_and_strangers():
    data = encode(to_table(make_group("w0", 0, 0, 0, N)))
    assert len(from_table(decode(data))) == N
    for i in range(0, len(data), 97):  # a flipped byte anywhere, trailer included
        with pytest.raises(IntegrityError):
            decode(bytes(_flip(bytearray(data), i)))
    # pyarrow alone accepts a stream cut right before its end-of-stream marker; the trailer doesn't
    body = data[:-TRAILER_SIZE]
    assert pa.ipc.open_stream(body[:-8]).read_all().num_rows == N
    for cut in (1, 8, TRAILER_SIZE, TRAILER_SIZE + 8, len(data) // 2, len(data) - 3):
        with pytest.raises(IntegrityError):
            decode(data[:-cut])
    with pytest.raises(IntegrityError):
        decode(data + b"\0")
    with pytest.raises(IntegrityError):
        decode(body)  # a bare IPC stream (schema version 1): no trailer
    with pytest.raises(IntegrityError):
        decode(b"PAR1" + b"\0" * 100)


def _stream_check(data: bytes, piece: int) -> None:
    v = StreamVerifier()
    for i in range(0, len(data), piece):
        v.update(data[i : i + piece])
    v.finish()


@pytest.mark.parametrize("piece", [1, 47, 48, 49, 1000, 1 << 22])
def test_stream_verifier_agrees_with_payload_for_any_piece_size(piece):
    """The gRPC server checks shards arriving in pieces; any split must give decode's verdict."""
    data = encode(to_table(make_group("w0", 0, 0, 0, N)))
    _stream_check(data, piece)
    for bad in (
        _flip(bytearray(data), len(data) // 3),
        _flip(bytearray(data), len(data) - 5),
        data[:-1],
        data + b"\0",
        data[: TRAILER_SIZE - 1],
    ):
        with pytest.raises(IntegrityError):
            decode(bytes(bad))
        with pytest.raises(IntegrityError):
            _stream_check(bytes(bad), piece)


@pytest.mark.parametrize(
    "mutate,vocab,match",
    [
        (lambda g: g[1].response_ids.__setitem__(0, 1000), 1000, "outside the vocabulary"),
        (lambda g: g[2].prompt_ids.__setitem__(3, 5000), 1000, "outside the vocabulary"),
        (lambda g: g[0].prompt_ids.__setitem__(0, -1), None, "negative token id"),
        (lambda g: g[1].behaviour_logprobs.__setitem__(2, float("nan")), None, "non-finite behaviour"),
        (lambda g: g[2].behaviour_logprobs.__setitem__(0, float("-inf")), None, "non-finite behaviour"),
        (lambda g: setattr(g[0], "reward", float("nan")), None, "non-finite reward"),
        (lambda g: g[1].behaviour_logprobs.pop(), None, "response tokens but"),
        (
            lambda g: (setattr(g[2], "response_ids", []), setattr(g[2], "behaviour_logprobs", [])),
            None,
            "empty response_ids",
        ),
    ],
)
def test_load_shard_rejects_bad_values(mutate, vocab, match):
    group = [s for s in make_group("w0", 0, 0, 0, N, response_len=3)]
    for s in group:
        s.prompt_ids = [t % 900 for t in s.prompt_ids]
        s.response_ids = [t % 900 for t in s.response_ids]
    load_shard(encode(to_table(group)), vocab_size=1000)
    mutate(group)
    with pytest.raises(SchemaError, match=match):
        load_shard(encode(to_table(group)), vocab_size=vocab)


# --- quarantine in the reader ------------------------------------------------------------------


def test_flipped_bytes_quarantined_while_a_writer_process_keeps_publishing(tmp_path):
    """A worker process publishes shards; one published shard gets a flipped byte. The reader
    quarantines it with a reason, keeps going and consumes every good shard, the later ones too."""
    root = tmp_path / "run"
    first = _publish(str(root), "w0", 4)  # seq 0..3
    first.close()  # that worker ended: the process below takes its id
    victim = first.sink.layout.shard("w0", 1)
    _mutate(victim, lambda d: _flip(d, len(d) // 3))
    script = tmp_path / "writer.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(TESTS_DIR)!r})\n"
        "from conftest import make_group\n"
        "from buffer.config import BufferConfig\n"
        "from buffer.writer import ShardWriter\n"
        "w = ShardWriter.at(sys.argv[1], 'w0', BufferConfig(flush_samples=1),\n"
        "                resume={'next_seq': 4, 'samples_written': 12})\n"
        "for g in range(6):\n"
        "    w.add_group(make_group('w0', 'later', g, 0, 3))\n"
        "    time.sleep(0.05)\n"
        "print(w.seq)\n"
    )
    reader = _reader(str(root))
    try:
        early = _drain(reader, 3)
        assert reader.stats["bad_shards"] == 1 and reader.stats["quarantined_shards"] == 1
        p = subprocess.run(
            [sys.executable, str(script), str(root)], env=subprocess_env(), capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.split() == ["10"]
        later = _drain(reader, 6)
        with pytest.raises(TimeoutError):
            reader.next_batch(1, 0, timeout_s=0.2)
    finally:
        reader.close()
    prompts = sorted(s.prompt_id for g in early + later for s in g.samples[:1])
    assert prompts == sorted([f"w0/t/{g}" for g in (0, 2, 3)] + [f"w0/later/{g}" for g in range(6)])
    assert reader.stats["shards_read"] == 9 and reader.stats["bad_shards"] == 1
    assert not os.path.exists(victim)
    q = _quarantined(root, "w0")
    assert list(q) == ["000000001.arrow"]
    assert "IntegrityError" in q["000000001.arrow"] and "sha256 mismatch" in q["000000001.arrow"]
    assert f"shard: {victim}" in q["000000001.arrow"]
    assert "w0/1" in reader.consumed  # rejected shards are consumed: never retried


def test_truncated_and_foreign_shards_are_quarantined(tmp_path):
    root = tmp_path / "run"
    w = _publish(str(root), "w0", 6)
    lay = w.sink.layout
    _mutate(lay.shard("w0", 0), lambda d: d[: len(d) // 2])  # cut mid-payload
    _mutate(lay.shard("w0", 2), lambda d: d[:-1])  # cut one trailer byte
    # a plain Arrow IPC file of someone else's (another schema) under a shard name
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, pa.schema([("x", pa.int64())])) as f:
        f.write_table(pa.table({"x": [1, 2, 3]}))
    Path(lay.shard("w0", 3)).write_bytes(sink.getvalue().to_pybytes())
    # a valid shard of another worker copied into w0's folder
    other = _publish(str(tmp_path / "elsewhere"), "w9", 1)
    Path(lay.shard("w0", 4)).write_bytes(Path(other.sink.layout.shard("w9", 0)).read_bytes())
    # a file that is not a shard name at all is left alone
    (root / "experience" / "w0" / "notes.txt").write_text("hello")
    reader = _reader(str(root))
    try:
        got = _drain(reader, 2)
        with pytest.raises(TimeoutError):
            reader.next_batch(1, 0, timeout_s=0.2)
    finally:
        reader.close()
    assert sorted(g.samples[0].prompt_id for g in got) == ["w0/t/1", "w0/t/5"]
    assert reader.stats["bad_shards"] == 4 == reader.stats["quarantined_shards"]
    q = _quarantined(root, "w0")
    assert sorted(q) == [f"00000000{i}.arrow" for i in (0, 2, 3, 4)]
    assert "IntegrityError" in q["000000000.arrow"] and "IntegrityError" in q["000000002.arrow"]
    assert "no tandem trailer" in q["000000003.arrow"]
    assert "foreign shard" in q["000000004.arrow"] and "w9" in q["000000004.arrow"]
    assert sorted(os.listdir(root / "experience" / "w0")) == ["000000001.arrow", "000000005.arrow", "notes.txt"]


def test_a_shard_re_encoded_under_another_worker_id_is_quarantined(tmp_path):
    """Issue 30 item 7: w0's rows, re-encoded without worker/seq metadata (the run id kept) and
    published as w1's shard 0, are refused: each sample id is read once."""
    root = tmp_path / "run"
    w = _publish(str(root), "w0", 2)
    lay = w.sink.layout
    table = decode(Path(lay.shard("w0", 0)).read_bytes())
    meta = {k: v for k, v in table.schema.metadata.items() if k not in (b"tandem.worker_id", b"tandem.shard_seq")}
    os.makedirs(lay.worker_shard_dir("w1"))
    atomic_write(w.sink.fs, lay.shard("w1", 0), encode(table.replace_schema_metadata(meta)))
    reader = _reader(str(root))
    try:
        got = _drain(reader, 2)
        with pytest.raises(TimeoutError):
            reader.next_batch(1, 0, timeout_s=0.3)
    finally:
        reader.close()
    ids = [s.sample_id for g in got for s in g.samples]
    assert len(ids) == len(set(ids)) == 2 * N
    assert reader.stats["foreign_row_shards"] == 1 == reader.stats["quarantined_shards"]
    assert "foreign rows" in _quarantined(root, "w1")["000000000.arrow"]


def test_out_of_vocab_and_nan_shards_quarantined_reader_continues(tmp_path):
    root = tmp_path / "run"
    fs, _ = filesystem(str(root))
    lay = RunLayout(str(root))

    def shard(seq, mutate=None):
        g = make_group("w0", "v", seq, 0, N)
        if mutate:
            mutate(g)
        table = to_table(g, {"tandem.worker_id": "w0", "tandem.shard_seq": seq})
        atomic_write(fs, lay.shard("w0", seq), encode(table))

    shard(0)
    shard(1, lambda g: g[1].response_ids.__setitem__(0, 60_000))  # vocab is 50_010
    shard(2, lambda g: g[2].behaviour_logprobs.__setitem__(1, float("nan")))
    shard(3, lambda g: setattr(g[0], "reward", float("inf")))
    shard(4)
    reader = _reader(str(root), vocab_size=50_010)
    try:
        got = _drain(reader, 2)
    finally:
        reader.close()
    assert [g.samples[0].prompt_id for g in got] == ["w0/v/0", "w0/v/4"]
    q = _quarantined(root, "w0")
    assert "outside the vocabulary (size 50010)" in q["000000001.arrow"]
    assert "w0/v/1/1" in q["000000001.arrow"]  # names the sample
    assert "non-finite behaviour logprob" in q["000000002.arrow"]
    assert "non-finite reward" in q["000000003.arrow"]
    assert reader.stats["bad_shards"] == 3 and reader.stats["shards_read"] == 2
    # without a vocab size the token ids are only checked to be >= 0
    lenient = _reader(str(tmp_path / "run2"))
    try:
        fs2, _ = filesystem(str(tmp_path / "run2"))
        g = make_group("w0", "v", 0, 0, N)
        g[0].response_ids[0] = 10**9
        atomic_write(fs2, RunLayout(str(tmp_path / "run2")).shard("w0", 0), encode(to_table(g)))
        assert len(_drain(lenient, 1)) == 1
    finally:
        lenient.close()


# --- discovery: probing, gaps, exactly once ----------------------------------------------------

WRITER = r"""
import random, sys, time
sys.path.insert(0, sys.argv[3])
from conftest import make_group
from buffer.config import BufferConfig
from buffer.writer import ShardWriter
root, wid, shards = sys.argv[1], sys.argv[2], int(sys.argv[4])
rng = random.Random(wid)
w = ShardWriter.at(root, wid, BufferConfig(flush_samples=1, flush_interval=3600.0))
for b in range(shards):
    w.add_group(make_group(wid, b, 0, 0, 2))
    time.sleep(rng.uniform(0, 0.01))
"""


def test_probing_discovery_exactly_once_with_writer_processes(tmp_path):
    """Full listings happen once (first poll); everything after is found by probing, across
    4 writer processes and a worker that appears late; each shard exactly once."""
    root = tmp_path / "run"
    _publish(str(root), "old", 50)  # history the probe must not re-list every poll
    script = tmp_path / "w.py"
    script.write_text(WRITER)
    workers, shards = ["p0", "p1", "p2", "p3"], 30
    reader = _reader(str(root), cfg=_cfg(full_scan_interval=3600.0))
    try:
        got = _drain(reader, 50)
        assert reader.stats["full_scans"] == 1
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), str(root), w, str(TESTS_DIR), str(shards)],
                env=subprocess_env(),
                stderr=subprocess.PIPE,
            )
            for w in workers
        ]
        try:
            got += _drain(reader, len(workers) * shards, timeout_s=60)
            for p in procs:
                assert p.wait(timeout=30) == 0, p.stderr.read()[-2000:]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
        with pytest.raises(TimeoutError):
            reader.next_batch(1, 0, timeout_s=0.2)
        assert reader.stats["full_scans"] == 1  # never listed again
        assert reader.stats["shards_read"] == 50 + len(workers) * shards
    finally:
        reader.close()
    ids = collections.Counter(s.sample_id for g in got for s in g.samples)
    assert len(ids) == (50 * N + len(workers) * shards * 2) and set(ids.values()) == {1}


def test_gap_in_a_sequence_is_caught_by_the_periodic_full_listing(tmp_path):
    root = tmp_path / "run"
    w = _publish(str(root), "w0", 2)
    # A one-hour interval: only the first poll lists; the test makes the next listing due below.
    reader = _reader(str(root), cfg=_cfg(full_scan_interval=3600.0))
    try:
        assert len(_drain(reader, 2)) == 2
        # seq 2 is missing (say it was quarantined by a trainer that crashed before its
        # checkpoint); the writer is at seq 3
        w.seq = 3
        w.add_group(make_group("w0", "t", 9, 0, N))
        assert reader.discover() == []  # the probe waits for seq 2
        assert reader.stats["full_scans"] == 1
        reader.cfg = dataclasses.replace(reader.cfg, full_scan_interval=0.5)
        [g] = reader.next_batch(1, 0, timeout_s=60)  # waits for the periodic listing
        assert g.samples[0].prompt_id == "w0/t/9" and reader.stats["full_scans"] == 2
        # and the probe continues from there
        reader.cfg = dataclasses.replace(reader.cfg, full_scan_interval=3600.0)
        w.add_group(make_group("w0", "t", 10, 0, N))
        [g] = reader.next_batch(1, 0, timeout_s=60)
        assert g.samples[0].prompt_id == "w0/t/10" and reader.stats["full_scans"] == 2
    finally:
        reader.close()


def test_replacing_the_ledger_rescans(tmp_path):
    """The trainer assigns reader.consumed after construction (resume): that must be honoured
    even after polls have happened, and probing must restart from the ledger."""
    root = tmp_path / "run"
    _publish(str(root), "w0", 4)
    reader = _reader(str(root), cfg=_cfg(full_scan_interval=3600.0))
    try:
        assert len(reader.discover()) == 4
        reader.consumed = {"w0/0", "w0/1", "w0/2"}
        assert [k for k, _ in reader.discover()] == ["w0/3"]
        assert reader.stats["full_scans"] == 2
        assert len(_drain(reader, 1)) == 1
    finally:
        reader.close()


# --- retention ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["delete", "archive"])
def test_retention_prunes_only_covered_shards_and_writer_never_reuses_a_name(tmp_path, mode):
    root = tmp_path / "run"
    w = _publish(str(root), "w0", 5)
    _publish(str(root), "w1", 2)
    beat = {"next_seq": w.seq, "samples_written": w.samples_written}
    reader = _reader(str(root))
    try:
        _drain(reader, 7)
    finally:
        reader.close()
    # the checkpoint covers only some of what the reader consumed
    covered = {"w0/0", "w0/1", "w0/2", "w1/0", "w9/5"}
    wdir = root / "experience" / "w0"
    Path(str(wdir / ".000000009.arrow") + TMP_MARK + "77").write_bytes(b"x")
    counts = prune_consumed(str(root), covered, mode=mode)
    assert counts["pruned"] == 4 and counts["kept"] == 3 and counts["bytes"] > 0
    assert sorted(n for n in os.listdir(wdir) if TMP_MARK not in n) == ["000000003.arrow", "000000004.arrow"]
    assert os.listdir(root / "experience" / "w1") == ["000000001.arrow"]
    archived = root / "archive"
    if mode == "archive":
        assert sorted(os.listdir(archived / "w0" / "00000")) == [f"00000000{i}.arrow" for i in range(3)]
        assert len(from_table(decode((archived / "w0" / "00000" / "000000000.arrow").read_bytes()))) == N
        assert inspect_report(str(root))["archive"] == {"w0": 3, "w1": 1}
        assert RunLayout(str(root)).archive_shard("w0", 123_456).endswith("w0/00012/000123456.arrow")
    else:
        assert not archived.exists()
    assert prune_consumed(str(root), covered, mode=mode)["pruned"] == 0  # idempotent
    assert prune_consumed(str(root), reader.consumed, mode=mode)["pruned"] == 3

    # every shard of w0 is gone; a restarted w0 resumes from its heartbeat: a new name, new ids
    assert not [n for n in os.listdir(wdir) if RunLayout.shard_seq(n) is not None]
    again = _publish(str(root), "w0", 1, resume=beat)
    assert [n for n in os.listdir(wdir) if RunLayout.shard_seq(n) is not None] == ["000000005.arrow"]
    assert again.samples_written == 6 * N
    resumed = _reader(str(root), consumed=reader.consumed)
    try:
        [g] = _drain(resumed, 1)
        assert g.group_id == "w0/5/0"
        assert resumed.stats["shards_read"] == 1
    finally:
        resumed.close()
    with pytest.raises(ValueError):
        prune_consumed(str(root), covered, mode="shred")


def test_clean_stale_temps(tmp_path):
    root = tmp_path / "run"
    w = _publish(str(root), "w0", 2)
    lay = w.sink.layout
    old = [lay.shard_tmp("w0", 2, 111), lay.shard_tmp("w0", 3, 222), lay.heartbeat("w0") + TMP_MARK + "333"]
    fresh = lay.shard_tmp("w0", 4, 444)
    os.makedirs(lay.workers_dir, exist_ok=True)
    for p in old + [fresh]:
        Path(p).write_bytes(b"partial")
    atomic_write_json(w.sink.fs, lay.heartbeat("w0"), {"samples_written": 6})
    past = time.time() - 7200
    for p in old + [lay.shard("w0", 0)]:  # an old *published* shard is never a temporary
        os.utime(p, (past, past))
    assert clean_stale_temps(str(root), older_than_s=3600) == 3
    assert all(not os.path.exists(p) for p in old)
    assert os.path.exists(fresh) and os.path.exists(lay.shard("w0", 0))
    assert os.path.exists(lay.heartbeat("w0"))
    assert clean_stale_temps(str(root), older_than_s=3600) == 0
    assert clean_stale_temps(str(root), older_than_s=0, now=time.time() + 1) == 1
    assert clean_stale_temps(str(tmp_path / "nothing"), 1) == 0


KILLED = r"""
import sys
sys.path.insert(0, sys.argv[3])
from conftest import make_group
from buffer.config import BufferConfig
from buffer.writer import ShardWriter
w = ShardWriter.at(sys.argv[1], sys.argv[2], BufferConfig(flush_samples=250, flush_interval=3600.0))
while True:
    for g in range(50):
        w.add_group(make_group(sys.argv[2], w.seq, g, 0, 5, prompt_len=32, response_len=2000))
"""


def test_temps_of_a_sigkilled_writer_are_cleaned_after_the_timeout(tmp_path):
    root = tmp_path / "run"
    script = tmp_path / "k.py"
    script.write_text(KILLED)
    wdir = root / "experience" / "k"
    tmps = []
    for _ in range(10):
        p = subprocess.Popen(
            [sys.executable, str(script), str(root), "k", str(TESTS_DIR)], env=subprocess_env(), stderr=subprocess.PIPE
        )
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and p.poll() is None:
                if wdir.is_dir() and (tmps := [n for n in os.listdir(wdir) if TMP_MARK in n]):
                    break
                time.sleep(0.001)
        finally:
            p.kill()
            p.wait(timeout=10)
        tmps = [n for n in os.listdir(wdir) if TMP_MARK in n] if wdir.is_dir() else []
        if tmps:
            break
    assert tmps, "never caught a writer mid-write"
    assert clean_stale_temps(str(root), older_than_s=60) == 0  # too young: could be alive
    assert clean_stale_temps(str(root), older_than_s=60, now=time.time() + 61) == len(tmps)
    assert not [n for n in os.listdir(wdir) if TMP_MARK in n]


# --- python -m buffer.inspect ------------------------------------------------------------------


def _inspect(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "buffer.inspect", *args],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_inspect_and_verify(tmp_path):
    root = tmp_path / "run"
    w0 = _publish(str(root), "w0", 3, version=2)
    w1 = ShardWriter.at(str(root), "w1", _cfg(flush_samples=2 * N))
    for v in range(4):
        w1.add_group(make_group("w1", "t", v, 5 + v, N))  # two shards, versions 5..8
    lay = w0.sink.layout
    atomic_write_json(w0.sink.fs, lay.heartbeat("w0"), {"samples_written": 9, "next_seq": 3, "state": "running"})
    atomic_write_json(w0.sink.fs, lay.heartbeat("w1"), {"samples_written": 12, "next_seq": 2, "state": "running"})
    atomic_write_json(w0.sink.fs, lay.progress, {"samples_retired": 6, "version": 7})
    Path(lay.shard_tmp("w0", 3, 99)).write_bytes(b"x")

    r = _inspect(str(root), "--verify")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "2 workers, 5 shards, 21 samples, versions v2..v8" in out
    assert "w0: 3 shards (seq 0..2), 9 samples, versions v2, 1 temporaries" in out
    assert "w1: 2 shards (seq 0..1), 12 samples, versions v5..v8" in out
    assert "backlog: 15 samples (written 21 per heartbeats - retired 6" in out
    assert "quarantine: 0 shards" in out and "5/5 shards ok" in out

    # damage one shard: --verify names it and exits 1; the plain report does not read it all
    _mutate(lay.shard("w1", 1), lambda d: _flip(d, 40))
    r = _inspect(str(root), "--verify")
    assert r.returncode == 1
    assert f"BAD {lay.shard('w1', 1)}: IntegrityError" in r.stdout
    assert "4/5 shards ok" in r.stdout
    # an out-of-vocab shard is bad only against a vocabulary
    assert _inspect(str(root), "--verify", "--vocab-size", "5").stdout.count("BAD ") == 5
    assert "outside the vocabulary (size 5)" in _inspect(str(root), "--verify", "--vocab-size", "5").stdout

    # the trainer quarantines it; inspect then shows it with its reason, and verify passes
    reader = _reader(str(root))
    try:
        _drain(reader, 5, version=8)  # no version from the future
    finally:
        reader.close()
    r = _inspect(str(root), "--verify", "--json")
    assert r.returncode == 0, r.stdout
    rep = json.loads(r.stdout)
    assert rep["total"]["shards"] == 4 and rep["bad"] == []
    [q] = rep["quarantine"]
    assert q["path"].endswith("quarantine/w1/000000001.arrow") and "sha256 mismatch" in q["reason"]
    plain = _inspect(str(root))
    assert plain.returncode == 0 and "quarantine: 1 shards" in plain.stdout
    assert "sha256 mismatch" in plain.stdout
