"""Security and hostile clients, with real gRPC servers and clients: constant-time token check,
bind address, TLS, one live writer per worker id, idle and per-worker caps, no folder for a
refused push; and the files a run shares (exports, weights) readable as the umask says."""

import hmac
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from conftest import free_port, make_group

from buffer.channel import WRITER_KEY
from buffer.config import BufferConfig
from buffer.experience.net_server import ShardServer
from buffer.run import setup_trainer_run
from buffer.writer import ShardWriter
from protocol import experience_pb2 as pb
from protocol import experience_pb2_grpc as pb_grpc
from protocol.config import ConfigError, build
from protocol.experience import SCHEMA_VERSION, encode, to_table

TOKEN = "s3cret-token"


def _cfg(tmp_path, bind, address=None, **kw):
    (tmp_path / "token").write_text(TOKEN)
    return BufferConfig(
        grpc_bind=bind, grpc_address=address or bind, transport="grpc", grpc_token_file=str(tmp_path / "token"), **kw
    )


def _shard(worker="w0", seq=0):
    return encode(to_table(make_group(worker, 0, seq, 0, 4)))


def _push(port, data, worker="w0", seq=0, writer="A", token=TOKEN, timeout=30, host="127.0.0.1", size=None):
    head = pb.ShardHeader(
        worker_id=worker, seq=seq, schema_version=SCHEMA_VERSION, size=len(data) if size is None else size
    )
    msgs = [pb.ShardChunk(header=head), pb.ShardChunk(data=data)]
    with grpc.insecure_channel(f"{host}:{port}") as ch:
        return pb_grpc.ExperienceStub(ch).Push(
            iter(msgs), timeout=timeout, metadata=[("authorization", f"Bearer {token}"), (WRITER_KEY, writer)]
        )


def _code(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_the_token_is_compared_in_constant_time(tmp_path, monkeypatch):
    """`!=` on strings stops at the first differing byte: its timing leaks the token's prefix.
    The server must go through hmac.compare_digest (the real one, counted here)."""
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    port = free_port()
    server = ShardServer(str(tmp_path / "t"), _cfg(tmp_path, f"127.0.0.1:{port}"))
    try:
        assert _code(_push, port, _shard(), token="s3cret-tokeX")[0] == grpc.StatusCode.UNAUTHENTICATED
        assert _code(_push, port, _shard())[0] == grpc.StatusCode.OK
    finally:
        server.stop()
    assert len(calls) == 2


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) with a LISTEN socket on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:
                    out.append(addr)
    return out


def test_default_bind_is_this_node_not_every_interface(tmp_path, caplog):
    assert BufferConfig().grpc_bind == ":50051"
    port = free_port()
    caplog.set_level(logging.WARNING, logger="buffer.experience.net_server")
    server = ShardServer(str(tmp_path / "t"), _cfg(tmp_path, f":{port}"))
    try:
        addrs = _listening(port)
        assert addrs and not any(set(a) == {"0"} for a in addrs), addrs  # 0.0.0.0 / [::]
        assert _push(port, _shard()).duplicate is False  # loopback is served
        node = socket.gethostbyname(socket.gethostname())
        assert _push(port, _shard(seq=1), seq=1, host=node).duplicate is False  # so is the node
    finally:
        server.stop()
    if not node.startswith("127."):  # off this host without TLS: said loudly
        assert any("WITHOUT TLS" in r.getMessage() for r in caplog.records), caplog.text


def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return str(cert), str(key)


def test_tls_carries_pushes_and_cert_and_key_come_together(tmp_path):
    cert, key = _self_signed(tmp_path)
    for one in ({"grpc_tls_cert": cert}, {"grpc_tls_key": key}):
        with pytest.raises(ConfigError, match="grpc_tls_cert and buffer.grpc_tls_key go together"):
            build(BufferConfig, one)
    port = free_port()
    cfg = _cfg(
        tmp_path,
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        grpc_tls_cert=cert,
        grpc_tls_key=key,
        grpc_tls_ca=cert,
        grpc_timeout_s=20,
    )
    server = setup_trainer_run(str(tmp_path / "t")).serve(cfg)  # a grpc writer asks the run service too
    try:
        writer = ShardWriter.at(str(tmp_path / "w"), "w0", cfg)
        writer.sink.publish(0, _shard())
        writer.close()
        assert (tmp_path / "t" / "experience" / "w0" / "000000000.arrow").read_bytes() == _shard()
        # a client without TLS gets nowhere (and sends its token nowhere readable)
        code, _ = _code(_push, port, _shard(seq=1), seq=1, timeout=10)
        assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_a_second_live_writer_of_a_worker_id_is_refused(tmp_path):
    port = free_port()
    server = ShardServer(str(tmp_path / "t"), _cfg(tmp_path, f"127.0.0.1:{port}", grpc_claim_ttl_s=2))
    try:
        assert _push(port, _shard(), writer="A").duplicate is False
        code, details = _code(_push, port, _shard(seq=1), seq=1, writer="B")
        assert code == grpc.StatusCode.ABORTED and "in use by another writer" in details
        assert _push(port, _shard(seq=1), seq=1, writer="A").duplicate is False  # A goes on
        assert _push(port, _shard("w1"), worker="w1", writer="B").duplicate is False  # own id
        deadline = time.monotonic() + 60  # A falls silent: after the TTL, B (a restart) takes over
        while _code(_push, port, _shard(seq=2), seq=2, writer="B")[0] != grpc.StatusCode.OK:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert server.servicer.stats["claim_refused"] >= 1
    finally:
        server.stop()
    assert sorted(os.listdir(tmp_path / "t" / "experience" / "w0")) == [
        "000000000.arrow",
        "000000001.arrow",
        "000000002.arrow",
    ]


class _Staller:
    """Authenticated clients that send a header and then nothing, with no deadline."""

    def __init__(self, port, workers):
        self.release = threading.Event()
        self.codes = []
        self.threads = [threading.Thread(target=self._one, args=(port, w), daemon=True) for w in workers]
        for t in self.threads:
            t.start()

    def _one(self, port, worker):
        def msgs():
            yield pb.ShardChunk(
                header=pb.ShardHeader(worker_id=worker, seq=0, size=1000, schema_version=SCHEMA_VERSION)
            )
            self.release.wait()

        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            self.codes.append(
                _code(pb_grpc.ExperienceStub(ch).Push, msgs(), metadata=[("authorization", f"Bearer {TOKEN}")])[0]
            )

    def stop(self):
        self.release.set()
        for t in self.threads:
            t.join(timeout=30)


def test_stalled_clients_cannot_starve_an_honest_push(tmp_path):
    """Before: every server thread waited on a stalled stream and the honest push hit its
    deadline. Now each stalled stream is cancelled after grpc_idle_timeout_s."""
    port = free_port()
    server = ShardServer(
        str(tmp_path / "t"), _cfg(tmp_path, f"127.0.0.1:{port}", grpc_server_threads=4, grpc_idle_timeout_s=2)
    )
    staller = _Staller(port, [f"s{i}" for i in range(6)])
    try:
        deadline = time.monotonic() + 30
        while len(server.servicer.streams) < 4:  # every server thread now holds a stalled stream
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # 20 s: 2 s idle timeout + a loaded 2-core machine's scheduling; before the fix it
        # could never succeed
        assert _push(port, _shard("h0"), worker="h0", timeout=20).duplicate is False
        deadline = time.monotonic() + 30
        stats = server.servicer.stats  # silent ones past grpc_server_threads are evicted first (issue 30)
        while len(staller.codes) < 6 or stats["idle_timeouts"] + stats["evicted"] < 6:
            assert time.monotonic() < deadline, (staller.codes, server.servicer.stats)
            time.sleep(0.05)
        assert set(staller.codes) == {grpc.StatusCode.CANCELLED}
    finally:
        staller.stop()
        server.stop()
    assert os.listdir(tmp_path / "t" / "experience") == ["h0"]  # no folder, no temporary


def test_concurrent_pushes_of_one_worker_are_capped(tmp_path):
    port = free_port()
    server = ShardServer(
        str(tmp_path / "t"), _cfg(tmp_path, f"127.0.0.1:{port}", grpc_max_pushes_per_worker=2, grpc_idle_timeout_s=60)
    )
    staller = _Staller(port, ["w0"] * 5)
    try:
        deadline = time.monotonic() + 30
        while staller.codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) < 3:
            assert time.monotonic() < deadline, staller.codes
            time.sleep(0.05)
        assert _push(port, _shard("w1"), worker="w1").duplicate is False  # others unaffected
    finally:
        staller.stop()
        server.stop()


def test_refused_pushes_create_no_folder(tmp_path):
    port = free_port()
    server = ShardServer(str(tmp_path / "t"), _cfg(tmp_path, f"127.0.0.1:{port}"))
    data = _shard()
    try:
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0xFF
        assert _code(_push, port, bytes(bad))[0] == grpc.StatusCode.DATA_LOSS
        assert _code(_push, port, data[:-10], size=len(data))[0] == grpc.StatusCode.DATA_LOSS
        assert _code(_push, port, data, token="nope")[0] == grpc.StatusCode.UNAUTHENTICATED
        assert os.listdir(tmp_path / "t" / "experience") == []  # no w0/, no temporary
        assert _push(port, data).duplicate is False
        assert os.listdir(tmp_path / "t" / "experience") == ["w0"]
    finally:
        server.stop()


# --- files shared with other users ----------------------------------------------------------

EVIL = """
import os, torch
class Payload:
    def __reduce__(self):
        return (os.mkdir, ({marker!r},))
torch.save({{"w": Payload()}}, {path!r})
"""


def test_export_never_runs_code_from_a_checkpoint(tmp_path):
    actor = tmp_path / "actor"
    actor.mkdir()
    (actor / "fsdp_config.json").write_text("{}")
    marker = tmp_path / "pwned"
    shard = actor / "model_world_size_1_rank_0.pt"
    subprocess.run([sys.executable, "-c", EVIL.format(marker=str(marker), path=str(shard))], check=True, timeout=120)
    p = subprocess.run(
        [sys.executable, "-m", "launch.export", "--checkpoint", str(actor), "--out", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert not marker.exists(), "launch.export executed code from the checkpoint"
    assert p.returncode == 1 and f"{shard}: refused to load" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "hf").exists()


def test_written_models_follow_the_umask(tmp_path):
    """safetensors writes 0600; a shared cluster's readers need what the umask allows."""
    from rollout import builtin_task

    old = os.umask(0o002)
    try:
        builtin_task.write_model(tmp_path / "m")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    assert modes["model.safetensors"] == 0o664 and set(modes.values()) == {0o664}, modes
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o775
