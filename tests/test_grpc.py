"""gRPC experience transport with real servers and processes: auth, idempotence, restarts."""

import collections
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from conftest import TESTS_DIR, free_port, launch_local, make_group, subprocess_env

from buffer.config import BufferConfig
from buffer.experience.net_client import DAMAGED_RESENDS
from buffer.experience.net_server import SEQ_WINDOW, ShardServer
from buffer.experience.reader import ExperienceReader
from buffer.layout import RunLayout
from buffer.run import setup_trainer_run
from buffer.writer import ShardWriter
from launch.local import rl_metrics
from protocol import experience_pb2 as pb
from protocol import experience_pb2_grpc as pb_grpc
from protocol.experience import SCHEMA_VERSION, encode, to_table
from protocol.shard_stream import chunk_data, decode_chunk, encode_chunk

TOKEN = "s3cret-token"


def _cfg(tmp_path, port, **kw):
    (tmp_path / "token").write_text(TOKEN + "\n")
    return BufferConfig(
        grpc_bind=f"127.0.0.1:{port}",
        grpc_address=f"127.0.0.1:{port}",
        grpc_token_file=str(tmp_path / "token"),
        transport="grpc",
        **kw,
    )


def _push(port, data, seq=0, token=TOKEN, schema=SCHEMA_VERSION, size=None, chunk=1000):
    """A hand-made push: header, then `data` in `chunk`-byte pieces."""
    head = pb.ShardHeader(worker_id="w0", seq=seq, schema_version=schema, size=len(data) if size is None else size)
    msgs = [pb.ShardChunk(header=head)] + [pb.ShardChunk(data=data[i : i + chunk]) for i in range(0, len(data), chunk)]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        meta = [("authorization", f"Bearer {token}")] if token is not None else []
        return pb_grpc.ExperienceStub(ch).Push(iter(msgs), timeout=10, metadata=meta)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, 1 << 20])
def test_data_chunk_fast_path_is_the_protobuf_encoding(size):
    """encode_chunk/decode_chunk skip protobuf objects for data chunks; the bytes must be what
    any client generated from the .proto sends and receives."""
    data = os.urandom(size)
    wire = encode_chunk(memoryview(data))
    assert wire == pb.ShardChunk(data=data).SerializeToString()
    got = decode_chunk(wire)
    assert isinstance(got, memoryview) and bytes(got) == data
    head = pb.ShardChunk(header=pb.ShardHeader(worker_id="w0", seq=size, size=size))
    assert decode_chunk(encode_chunk(head)) == head and chunk_data(decode_chunk(encode_chunk(head))) is None
    # not the canonical single-field form (here an extra unknown field): parsed by protobuf
    odd = wire + b"\x18\x01"
    assert chunk_data(decode_chunk(odd)) == data


def _refused(code, *args, **kw) -> str:
    with pytest.raises(grpc.RpcError) as e:
        _push(*args, **kw)
    assert e.value.code() == code, e.value.details()
    return e.value.details()


def test_token_schema_integrity_and_idempotence(tmp_path):
    port = free_port()
    server = ShardServer(str(tmp_path / "trainer"), _cfg(tmp_path, port, grpc_max_shard_mb=1))
    spool = tmp_path / "trainer" / "experience" / "w0"
    try:
        data = encode(to_table(make_group("w0", 0, 0, 0, 4)))
        for bad in (None, "wrong"):
            _refused(grpc.StatusCode.UNAUTHENTICATED, port, data, token=bad)
        details = _refused(grpc.StatusCode.FAILED_PRECONDITION, port, data, schema="0")
        assert "schema version" in details
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0xFF
        assert "sha256 mismatch" in _refused(grpc.StatusCode.DATA_LOSS, port, bytes(flipped))
        for sent in (data[:-100], data + b"x"):  # the stream ends early, or runs on
            details = _refused(grpc.StatusCode.DATA_LOSS, port, sent, size=len(data))
            assert f"header says {len(data)} bytes" in details
        assert "grpc_max_shard_mb" in _refused(grpc.StatusCode.INVALID_ARGUMENT, port, data, size=2 << 20)
        assert not spool.exists() or not os.listdir(spool)  # refused pushes leave no file
        for chunk in (1, 47, 48, 49, 1 << 20):  # chunking never matters to the trailer check
            seq = min(chunk, 50)  # within SEQ_WINDOW of the highest accepted
            assert _push(port, data, seq=seq, chunk=chunk).duplicate is False
            assert (spool / f"{seq:09d}.arrow").read_bytes() == data
        assert _push(port, data, seq=1).duplicate is True  # a resend is acknowledged, not stored twice
        assert sorted(os.listdir(spool)) == [f"{c:09d}.arrow" for c in (1, 47, 48, 49, 50)]
        assert server.servicer.stats["refused"] == 2 and server.servicer.stats["spooled"] == 5
    finally:
        server.stop()


def test_a_seq_far_past_the_highest_accepted_is_refused_and_cannot_bypass_the_cap(tmp_path):
    """Issue 30 item 5: one shard with seq 10**12 must not make every later shard "below the
    highest" (always taken) and so bypass the backlog cap."""
    port = free_port()
    cfg = _cfg(tmp_path, port, max_backlog_samples=4)
    server = ShardServer(str(tmp_path / "trainer"), cfg, retired=lambda: 0)
    try:
        data = encode(to_table(make_group("w0", 0, 0, 0, 4), {"tandem.num_samples": 4}))
        assert _push(port, data, seq=0).duplicate is False
        for seq in (10**12, SEQ_WINDOW + 1):
            assert "SeqOutOfWindow" in _refused(grpc.StatusCode.INVALID_ARGUMENT, port, data, seq=seq)
        assert _push(port, data, seq=1).duplicate is False  # 4 spooled: not over the cap yet
        for seq in (2, 3, SEQ_WINDOW):  # over the cap: every one refused, none "below the highest"
            assert "over its cap" in _refused(grpc.StatusCode.RESOURCE_EXHAUSTED, port, data, seq=seq)
        assert server.servicer.stats["seq_out_of_window"] == 2 and server.servicer.stats["spooled"] == 2
    finally:
        server.stop()


def test_damaged_shard_is_resent_then_refused(tmp_path):
    """DATA_LOSS means "damaged on the way": the writer resends, DAMAGED_RESENDS times at most
    (then its own copy must be the bad one) and reports the refusal instead of hanging."""
    port = free_port()
    cfg = _cfg(tmp_path, port, grpc_timeout_s=5)
    server = setup_trainer_run(str(tmp_path / "trainer")).serve(cfg)  # a grpc writer asks the run service too
    writer = ShardWriter.at(str(tmp_path / "worker"), "w0", cfg)
    try:
        data = bytearray(encode(to_table(make_group("w0", 0, 0, 0, 4))))
        data[100] ^= 0xFF
        writer.sink.publish(0, bytes(data))
        with pytest.raises(RuntimeError, match="refused a shard.*sha256 mismatch"):
            writer.close()
        assert server.servicer.stats["rejected"] == 1 + DAMAGED_RESENDS
        assert server.servicer.stats["spooled"] == 0
    finally:
        server.stop()


def test_bad_columns_are_quarantined_by_the_one_reader(tmp_path):
    """The server checks integrity; column checks are the reader's, the same for both transports."""
    port = free_port()
    server = ShardServer(str(tmp_path / "trainer"), _cfg(tmp_path, port))
    try:
        group = make_group("w0", 0, 0, 0, 4)
        group[1].response_ids[0] = 70_000
        assert _push(port, encode(to_table(group)), seq=0).duplicate is False
        assert _push(port, encode(to_table(make_group("w0", 0, 1, 0, 4))), seq=1).duplicate is False
    finally:
        server.stop()
    reader = ExperienceReader(str(tmp_path / "trainer"), BufferConfig(), max_staleness=10, vocab_size=60_000)
    try:
        groups = reader.next_batch(1, current_version=0, timeout_s=10)
    finally:
        reader.close()
    assert [g.samples[0].prompt_id for g in groups] == ["w0/0/1"]
    lay = RunLayout(str(tmp_path / "trainer"))
    with open(lay.quarantine_reason(lay.quarantine_shard("w0", 0))) as f:
        assert "outside the vocabulary" in f.read()


SERVER = """
import sys, time
sys.path.insert(0, sys.argv[3])
from buffer.config import BufferConfig
from buffer.run import setup_trainer_run
cfg = BufferConfig(grpc_bind=sys.argv[2], grpc_token_file=sys.argv[4], transport="grpc")
server = setup_trainer_run(sys.argv[1]).serve(cfg)  # keep a reference: GC stops it
print("ready", flush=True)
time.sleep(3600)
"""


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def _start_server(tmp_path, port):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    p = subprocess.Popen(
        [
            sys.executable,
            str(script),
            str(tmp_path / "trainer"),
            f"127.0.0.1:{port}",
            str(TESTS_DIR.parent),
            str(tmp_path / "token"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def test_server_restart_mid_stream_loses_and_doubles_nothing(tmp_path):
    port = free_port()
    cfg = _cfg(tmp_path, port, flush_samples=4, grpc_max_inflight=4, grpc_timeout_s=5, backlog_timeout_s=90)
    server = _start_server(tmp_path, port)
    writer = ShardWriter.at(str(tmp_path / "worker"), "w0", cfg)
    try:
        for g in range(10):
            writer.add_group(make_group("w0", 0, g, 0, 4))
        _wait(lambda: not writer.sink.unacked, 60, "the first 10 shards to be acknowledged")
        server.send_signal(signal.SIGKILL)  # the trainer dies
        server.wait(timeout=30)
        for g in range(10, 30):  # the worker keeps producing; pushes fail and are retried
            writer.add_group(make_group("w0", 0, g, 0, 4))
            if g == 13:  # 4 shards in flight: the writer would block on the next one
                _wait(lambda: "UNAVAILABLE" in (writer.sink.last_error or ""), 60, "a failed push")
                server = _start_server(tmp_path, port)  # the trainer comes back
        writer.close(timeout_s=120)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)
    spool = sorted(os.listdir(tmp_path / "trainer" / "experience" / "w0"))
    assert spool == [f"{i:09d}.arrow" for i in range(30)]
    reader = ExperienceReader(str(tmp_path / "trainer"), BufferConfig(), max_staleness=10)
    try:
        groups = reader.next_batch(30, current_version=0, timeout_s=10)
    finally:
        reader.close()
    counts = collections.Counter(s.prompt_id for g in groups for s in g.samples)
    assert set(counts) == {f"w0/0/{g}" for g in range(30)} and set(counts.values()) == {4}


def test_pipeline_over_grpc(tmp_path):
    port = free_port()
    env = dict(os.environ, TANDEM_GRPC_TOKEN=TOKEN)
    root = tmp_path / "run"
    proc = subprocess.run(
        launch_local(
            "--root",
            str(root),
            "--steps",
            "4",
            "--timeout",
            "400",
            "--trainer",
            "buffer.transport=grpc",
            "--trainer",
            f"buffer.grpc_bind=127.0.0.1:{port}",
            "--worker",
            "buffer.transport=grpc",
            "--worker",
            f"buffer.grpc_address=127.0.0.1:{port}",
        ),
        capture_output=True,
        text=True,
        timeout=500,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, vals = rl_metrics(setup_trainer_run(str(root)))
    # the validator (weights and validation still go through the run folder) measured v0 and v4
    assert len(rows) == 4 and [[p[0] for p in v] for v in vals.values()] == [[0, 4]]
    assert "experience gRPC server listening" in (root / "logs" / "trainer.log").read_text()
