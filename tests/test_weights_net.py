"""Weight versions over the network (buffer/weights/net_client.py, net_server.py), with real files, the trainer's real
experience gRPC server carrying the weight service, real fetchers with their peer servers on
loopback, and a real worker process killed mid-download."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import msgpack
import pytest
import torch
from conftest import fetch_at_once, free_port, subprocess_env
from safetensors.torch import save_file

from buffer.config import BufferConfig
from buffer.experience.net_server import ShardServer
from buffer.weights.fs import WeightStore
from buffer.weights.net_client import FetchCancelled, WeightFetcher
from buffer.weights.net_server import add_weight_service
from protocol.weights import verify_files
from protocol.weights_wire import (
    CHUNK_LIST_METHOD,
    CHUNK_METHOD,
    PEERS_METHOD,
    ChunkList,
    ChunkRequest,
    FileChunks,
    WireError,
    from_bitmap,
)

TOKEN = "weights-token"
CHUNK_KB = 64  # 64 KiB chunks: a 3 MB version is ~50 chunks, enough to interrupt mid-way


def _cfg(tmp_path, port, **kw):
    (tmp_path / "token").write_text(TOKEN)
    base = dict(
        grpc_bind=f"127.0.0.1:{port}",
        grpc_address=f"127.0.0.1:{port}",
        transport="grpc",
        grpc_token_file=str(tmp_path / "token"),
        weights_chunk_kb=CHUNK_KB,
        weights_peer_host="127.0.0.1",
        weights_peer_refresh_s=0.2,
        weights_chunk_timeout_s=30.0,
        weights_stall_timeout_s=120.0,
    )
    return BufferConfig(**{**base, **kw})


def _publish(root, version=1, mb=3):
    """A version of two safetensors files (uneven sizes) and a config.json, published as the
    trainer publishes."""
    src = root / f"src{version}"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    g = torch.Generator().manual_seed(version)
    n = mb * (1 << 20) // 4
    save_file({"a": torch.randn(n * 2 // 3, generator=g)}, str(src / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.randn(n - n * 2 // 3 + 7, generator=g)}, str(src / "model-00002-of-00002.safetensors"))
    store = WeightStore(str(root / "trainer"))
    store.publish_hf_folder(src, version=version, step=version, keep=4)
    return store


class _Trainer:
    """The trainer's rank-0 server: the experience ShardServer, with the weight service added."""

    def __init__(self, root, cfg):
        self.store = WeightStore(str(root / "trainer"))
        self.shards = ShardServer(str(root / "trainer"), cfg)
        self.service = add_weight_service(self.shards.server, self._dir, TOKEN, cfg)

    def _dir(self, version):
        d = self.store.layout.version_dir(version)
        return d if os.path.isdir(d) else None

    def stop(self):
        self.shards.stop(grace_s=0.5)


@pytest.fixture
def trainer(tmp_path):
    port = free_port()
    _publish(tmp_path)
    made = []

    def start(**kw):
        t = _Trainer(tmp_path, _cfg(tmp_path, port, **kw))
        made.append(t)
        return t

    yield start
    for t in made:
        t.stop()


def _verified(dest, store, version=1):
    """The fetched folder is the published version: manifest identical, every file's sha256."""
    with open(os.path.join(dest, "manifest.json")) as f:
        fetched = f.read()
    with open(store.layout.manifest(version)) as f:
        assert fetched == f.read()
    verify_files(store.manifest(version), dest)
    assert not os.path.exists(dest + ".partial")
    return True


def _wait(cond, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def _background_fetch(f, dest):
    """f.fetch(1, dest) in a thread: (the thread, {"dest": ...} or {"error": ...} when done)."""
    result = {}

    def run():
        try:
            result["dest"] = f.fetch(1, dest)
        except BaseException as e:  # reported by the caller's assertions
            result["error"] = e

    th = threading.Thread(target=run)
    th.start()
    return th, result


def test_full_fetch_verified(tmp_path, trainer):
    t = trainer()
    f = WeightFetcher(t.shards.servicer.cfg.grpc_address, TOKEN, t.shards.servicer.cfg, "w0")
    try:
        dest = f.fetch(1, str(tmp_path / "w0" / "weights" / "v000001"))
        assert _verified(dest, t.store)
        stats = f.stats[1]
        assert stats.from_trainer == stats.chunks and stats.corrupt == 0 and stats.resumed == 0
        assert f.fetch(1, dest) == dest  # there already: verified, nothing fetched
        again = WeightFetcher(t.shards.servicer.cfg.grpc_address, TOKEN, t.shards.servicer.cfg, "w0b")
        try:  # a restarted worker finds the folder, fetches nothing, and serves it to peers
            assert again.fetch(1, dest) == dest and 1 not in again.stats
            assert again._held(1).have == set(range(stats.chunks))
        finally:
            again.close()
    finally:
        f.close()


def test_bad_token_refused(tmp_path, trainer):
    t = trainer()
    cfg = t.shards.servicer.cfg
    bad = WeightFetcher(cfg.grpc_address, "not-the-token", cfg, "intruder")
    good = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "w0")
    try:
        with pytest.raises(PermissionError, match="token"):
            bad.fetch(1, str(tmp_path / "bad" / "v1"))
        good.fetch(1, str(tmp_path / "good" / "v1"))
        # the peer server of a worker refuses a wrong token too
        with grpc.insecure_channel(good.peer_address) as ch:
            call = ch.unary_unary(CHUNK_METHOD)
            with pytest.raises(grpc.RpcError) as e:
                call(
                    ChunkRequest(1, "intruder", index=0).encode(),
                    timeout=30,
                    metadata=[("authorization", "Bearer wrong")],
                )
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert call(
                ChunkRequest(1, "friend", index=0).encode(), timeout=30, metadata=[("authorization", f"Bearer {TOKEN}")]
            )
    finally:
        bad.close()
        good.close()


_WORKER = """
import logging, sys
logging.basicConfig(level=logging.INFO)
from buffer.config import BufferConfig
from buffer.weights.net_client import WeightFetcher
cfg = BufferConfig(**{cfg!r})
f = WeightFetcher(cfg.grpc_address, {token!r}, cfg, "w-killed")
dest = f.fetch(1, {dest!r})
s = f.stats[1]
print("STATS", s.resumed, s.from_trainer + s.from_peers, s.chunks, flush=True)
f.close()
"""


def test_worker_killed_mid_download_resumes(tmp_path, trainer):
    """SIGKILL the fetching process once some chunks are durable; a new process fetches only
    the chunks that were not, and the folder verifies."""
    # 0.5 MB/s: the 3 MB version takes ~6 s, so the kill lands mid-download
    t = trainer(weights_upload_mb_s=0.5)
    cfg = t.shards.servicer.cfg
    dest = str(tmp_path / "w" / "weights" / "v000001")
    fields = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    script = _WORKER.format(cfg=fields, token=TOKEN, dest=dest)
    sidecar = os.path.join(dest + ".partial", ".tandem-verified")

    def durable():
        try:
            with open(sidecar, "rb") as fh:
                return len(from_bitmap(fh.read(), 10**6))
        except FileNotFoundError:
            return 0

    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait(lambda: durable() >= 3 or proc.poll() is not None, 120, "3 chunks made durable")
        assert proc.poll() is None, proc.stdout.read()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    kept = durable()
    total = t.service._holding(1).chunks.total
    assert 3 <= kept < total
    out = subprocess.run(
        [sys.executable, "-c", script], env=subprocess_env(), text=True, capture_output=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    line = [s for s in out.stdout.splitlines() if s.startswith("STATS")][0]
    resumed, fetched, chunks = map(int, line.split()[1:])
    assert (resumed, fetched, chunks) == (kept, total - kept, total)
    assert _verified(dest, t.store)


def test_close_mid_download_cancels_and_keeps_a_resumable_partial(tmp_path, trainer):
    """A clean stop (the worker's close()) while a fetch runs in the background: the fetch
    ends with FetchCancelled, every chunk it verified is in the durable bitmap, its lock file
    is gone, and the next fetch takes exactly the chunks that were not verified."""
    t = trainer(weights_upload_mb_s=0.5)  # 0.5 MB/s: the 3 MB version takes ~6 s at least
    cfg = t.shards.servicer.cfg
    dest = str(tmp_path / "w" / "weights" / "v000001")
    f = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "w-stopped")
    th, result = _background_fetch(f, dest)
    try:
        _wait(lambda: 1 in f.stats and f.stats[1].from_trainer >= 3, 120, "3 chunks verified")
        f.close()
        # once the channels are closed the fetch ends within a loop tick (1 s); 30 s leaves
        # room for a loaded 2-core box and is below weights_chunk_timeout_s, close()'s bound
        th.join(timeout=30)
        assert not th.is_alive(), "the fetch still runs after close()"
    finally:
        f.close()
        th.join(timeout=60)
    assert isinstance(result.get("error"), FetchCancelled), result
    verified = f.stats[1].from_trainer
    total = t.service._holding(1).chunks.total
    assert 3 <= verified < total and not os.path.exists(dest)
    with open(os.path.join(dest + ".partial", ".tandem-verified"), "rb") as fh:
        assert len(from_bitmap(fh.read(), total)) == verified  # none lost since the last save
    assert not os.path.exists(dest + ".partial.lock")  # only a killed fetch leaves its lock
    again = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "w-restarted")
    try:
        assert again.fetch(1, dest) == dest
        s = again.stats[1]
        assert (s.resumed, s.from_trainer + s.from_peers) == (verified, total - verified)
        assert _verified(dest, t.store)
    finally:
        again.close()


_PEER = """
import logging, sys
logging.basicConfig(level=logging.INFO)
from buffer.config import BufferConfig
from buffer.weights.net_client import WeightFetcher
cfg = BufferConfig(**{cfg!r})
f = WeightFetcher(cfg.grpc_address, {token!r}, cfg, "doomed")
f.fetch(1, {dest!r})
print("SERVING", flush=True)
sys.stdin.readline()
"""


def test_peer_dying_mid_transfer(tmp_path, trainer):
    """A worker fetches from a peer (another process, slow uplink) that is SIGKILLed mid-way:
    its requests fail, the peer is skipped, and the rest comes from the trainer, verified."""
    t = trainer()
    cfg = t.shards.servicer.cfg
    fields = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    fields["weights_upload_mb_s"] = 0.5  # the peer's uplink: ~6 s for the version
    script = _PEER.format(cfg=fields, token=TOKEN, dest=str(tmp_path / "peer" / "v1"))
    peer = subprocess.Popen(
        [sys.executable, "-c", script],
        env=subprocess_env(),
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    q = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "survivor")
    result = {}
    try:
        assert peer.stdout.readline().strip() == "SERVING"
        th = threading.Thread(target=lambda: result.update(dest=q.fetch(1, str(tmp_path / "q" / "v1"))))
        th.start()
        _wait(lambda: 1 in q.stats and q.stats[1].from_peers >= 2, 120, "2 chunks from the peer")
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(timeout=30)
        th.join(timeout=180)
        assert not th.is_alive() and "dest" in result, "the fetch did not complete"
        s = q.stats[1]
        assert s.peer_failures >= 1 and s.from_trainer >= 1 and s.from_peers >= 2
        assert s.from_peers + s.from_trainer == s.chunks
        assert _verified(result["dest"], t.store)
    finally:
        if peer.poll() is None:
            peer.kill()
        q.close()


def test_corrupted_peer_detected_and_chunk_refetched(tmp_path, trainer):
    """A peer whose copy went bad on disk serves a damaged chunk: the fetcher detects it by the
    chunk's sha256, never asks that peer again for the version, and gets the chunk elsewhere."""
    t = trainer()
    cfg = t.shards.servicer.cfg
    p = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "peer")
    q = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "victim")
    try:
        held = p.fetch(1, str(tmp_path / "p" / "v1"))
        name = "model-00001-of-00002.safetensors"
        with open(os.path.join(held, name), "r+b") as fh:  # one flipped byte in chunk 2
            fh.seek(2 * (CHUNK_KB << 10) + 100)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))
        dest = q.fetch(1, str(tmp_path / "q" / "v1"))
        s = q.stats[1]
        assert s.bad_peers == ["peer"] and s.corrupt == 1
        assert s.from_peers >= 1  # it did use the peer before the bad chunk...
        assert s.from_trainer >= 1  # ...and the rest (with the damaged chunk) came from the trainer
        assert s.from_peers + s.from_trainer == s.chunks
        assert _verified(dest, t.store)
    finally:
        p.close()
        q.close()


def test_trainer_restart_mid_transfer_loses_nothing(tmp_path, trainer):
    """The trainer's server stops mid-fetch and a new one starts on the same port: the fetch
    waits, keeps every verified chunk, and completes verified."""
    t = trainer(weights_upload_mb_s=0.5)
    cfg = t.shards.servicer.cfg
    f = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "w0")
    th, result = _background_fetch(f, str(tmp_path / "w0" / "v1"))
    try:
        _wait(lambda: 1 in f.stats and f.stats[1].from_trainer >= 3, 120, "3 chunks fetched")
        t.stop()
        got = f.stats[1].from_trainer
        t2 = trainer()  # same port, full speed
        th.join(timeout=120)
        assert not th.is_alive(), "the fetch did not finish after the restart"
        assert "error" not in result, result.get("error")
        s = f.stats[1]
        assert s.from_trainer == s.chunks and s.duplicates == 0 and got < s.chunks
        assert s.trainer_failures >= 1
        assert _verified(result["dest"], t2.store)
    finally:
        th.join(timeout=120)
        f.close()


def test_peer_fanout_used(tmp_path, trainer):
    """Four workers fetch at once from a trainer whose uplink is slow: chunks flow between
    workers, counted, and the trainer sends fewer than four copies."""
    t = trainer(weights_upload_mb_s=1.0)
    cfg = t.shards.servicer.cfg
    fetchers = [WeightFetcher(cfg.grpc_address, TOKEN, cfg, f"w{i}") for i in range(4)]
    try:
        dests = fetch_at_once(fetchers, 1, tmp_path)
        stats = [f.stats[1] for f in fetchers]
        total = stats[0].chunks
        assert sum(s.from_peers for s in stats) > 0
        assert all(s.from_peers + s.from_trainer == total for s in stats)
        # the trainer sent fewer chunks than 4 full copies: fan-out took load off its link
        assert t.service.stats["chunks"] < 4 * total
        for i in range(4):
            assert _verified(dests[i], t.store)
    finally:
        for f in fetchers:
            f.close()


def test_malformed_messages_refused(tmp_path, trainer):
    """Bytes that are not the expected message are INVALID_ARGUMENT (never a crash in the
    handler); a chunk list naming a path outside the fetch's folder is refused by the worker."""
    t = trainer()
    with grpc.insecure_channel(t.shards.servicer.cfg.grpc_address) as ch:
        for method in (CHUNK_METHOD, CHUNK_LIST_METHOD, PEERS_METHOD):
            call = ch.unary_unary(method)
            for raw in (
                b"\xc1garbage",
                msgpack.packb([1, 2]),
                msgpack.packb({"version": "1"}),
                ChunkRequest(1, "x", avoid=[7]).encode(),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    call(raw, timeout=30, metadata=[("authorization", f"Bearer {TOKEN}")])
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, raw)
    for name in ("../evil", "a/b", ".tandem-verified", "manifest.json", ""):
        bad = ChunkList(1, 64, "{}", [FileChunks(name, 10, "0" * 64, [bytes(32)])])
        with pytest.raises(WireError, match="refused"):
            ChunkList.decode(bad.encode())
