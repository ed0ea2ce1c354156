"""gRPC experience transport with real servers and processes: auth, idempotence, restarts."""
import collections
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from buffer.config import BufferConfig
from buffer.grpc_transport import GrpcShardWriter, ShardServer
from buffer.reader import ExperienceReader
from conftest import TESTS_DIR, make_group, subprocess_env
from protocol import experience_pb2 as pb
from protocol import experience_pb2_grpc as pb_grpc
from protocol.experience import SCHEMA_VERSION, encode, to_table

TOKEN = "s3cret-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(tmp_path, port, **kw):
    (tmp_path / "token").write_text(TOKEN + "\n")
    return BufferConfig(grpc_bind=f"127.0.0.1:{port}", grpc_address=f"127.0.0.1:{port}",
                        grpc_token_file=str(tmp_path / "token"), transport="grpc", **kw)


def _push(port, shard, token=TOKEN):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        meta = [("authorization", f"Bearer {token}")] if token is not None else []
        return pb_grpc.ExperienceStub(ch).Push(shard, timeout=10, metadata=meta)


def test_token_schema_and_idempotence(tmp_path):
    port = _free_port()
    server = ShardServer(str(tmp_path / "trainer"), _cfg(tmp_path, port), vocab_size=60_000)
    try:
        data = encode(to_table(make_group("w0", 0, 0, 0, 4)))
        shard = pb.Shard(worker_id="w0", seq=0, schema_version=SCHEMA_VERSION, data=data)
        for bad in (None, "wrong"):
            with pytest.raises(grpc.RpcError) as e:
                _push(port, shard, token=bad)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            _push(port, pb.Shard(worker_id="w0", seq=0, schema_version="0", data=data))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "schema version" in e.value.details()
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0xFF
        with pytest.raises(grpc.RpcError) as e:
            _push(port, pb.Shard(worker_id="w0", seq=0, schema_version=SCHEMA_VERSION, data=bytes(flipped)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _push(port, shard).duplicate is False
        assert _push(port, shard).duplicate is True  # a resend is acknowledged, not stored twice
        assert (tmp_path / "trainer" / "experience" / "w0" / "000000000.arrow").read_bytes() == data
        assert server.servicer.stats["refused"] == 2 and server.servicer.stats["spooled"] == 1
    finally:
        server.stop()


SERVER = """
import sys, time
sys.path.insert(0, sys.argv[3])
from buffer.config import BufferConfig
from buffer.grpc_transport import ShardServer
cfg = BufferConfig(grpc_bind=sys.argv[2], grpc_token_file=sys.argv[4], transport="grpc")
server = ShardServer(sys.argv[1], cfg, vocab_size=60_000)  # keep a reference: GC stops it
print("ready", flush=True)
time.sleep(3600)
"""


def _start_server(tmp_path, port):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path / "trainer"), f"127.0.0.1:{port}",
                          str(TESTS_DIR.parent), str(tmp_path / "token")],
                         stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert p.stdout.readline().strip() == "ready"
    return p


def test_server_restart_mid_stream_loses_and_doubles_nothing(tmp_path):
    port = _free_port()
    cfg = _cfg(tmp_path, port, flush_samples=4, grpc_max_inflight=4, grpc_timeout_s=5,
               backlog_timeout_s=90)
    server = _start_server(tmp_path, port)
    writer = GrpcShardWriter(str(tmp_path / "worker"), "w0", cfg)
    try:
        for g in range(10):
            writer.add_group(make_group("w0", 0, g, 0, 4))
        deadline = time.monotonic() + 60
        while writer.unacked and time.monotonic() < deadline:
            time.sleep(0.05)
        server.send_signal(signal.SIGKILL)  # the trainer dies
        server.wait(timeout=30)
        for g in range(10, 30):  # the worker keeps producing; pushes fail and are retried
            writer.add_group(make_group("w0", 0, g, 0, 4))
            if g == 13:  # 4 shards in flight: the writer would block on the next one
                time.sleep(1.0)  # a few failed pushes
                assert "UNAVAILABLE" in (writer.last_error or "")
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
    port = _free_port()
    env = dict(os.environ, TANDEM_GRPC_TOKEN=TOKEN)
    root = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launch.local", "--root", str(root), "--steps", "4",
                           "--timeout", "400", "--trainer", "buffer.transport=grpc",
                           "--trainer", f"buffer.grpc_bind=127.0.0.1:{port}",
                           "--worker", "buffer.transport=grpc",
                           "--worker", f"buffer.grpc_address=127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((root / "metrics.jsonl").read_text().splitlines()) == 4
    assert "experience gRPC server listening" in (root / "logs" / "trainer.log").read_text()
