"""The trainer's chunk-server processes (buffer/weights/net_pool.py, buffer.weights_serve_processes):
real processes serving a real published version over loopback gRPC to real fetchers; one killed
with SIGKILL mid-fetch; the trainer's own process killed with SIGKILL."""

import os
import signal
import subprocess
import sys
import textwrap

import grpc
import pytest
from conftest import fetch_at_once, free_port, subprocess_env
from test_weights_net import TOKEN, _background_fetch, _cfg, _publish, _verified, _wait

from buffer.config import BufferConfig
from buffer.experience.net_server import ShardServer
from buffer.run import setup_trainer_run
from buffer.weights.fs import WeightStore
from buffer.weights.net_client import WeightFetcher
from buffer.weights.net_pool import ChunkServerPool, chunk_servers
from buffer.weights.net_server import add_weight_service
from protocol.config import ConfigError, build
from protocol.weights_wire import ASK_TRAINER, CHUNK_METHOD, REDIRECT, ChunkReply, ChunkRequest, to_bitmap

START_S = 120.0  # N Python interpreters importing gRPC on a loaded 2-core box: seconds each


class _PoolTrainer:
    """The trainer's rank-0 server with the weight service and its chunk-server processes."""

    def __init__(self, root, cfg):
        self.store = WeightStore(str(root / "trainer"))
        self.shards = ShardServer(str(root / "trainer"), cfg)
        self.service = add_weight_service(
            self.shards.server, self._dir, TOKEN, cfg, chunk_servers(self.store.layout, TOKEN, cfg)
        )
        self.cfg = cfg
        assert self.service.pool is not None and self.service.pool.wait_ready(START_S), "chunk servers up"

    def _dir(self, version):
        d = self.store.layout.version_dir(version)
        return d if os.path.isdir(d) else None

    def stop(self):
        self.shards.stop(grace_s=0.5)
        self.service.close()


@pytest.fixture
def pool_trainer(tmp_path):
    port = free_port()
    _publish(tmp_path)
    made = []

    def start(**kw):
        t = _PoolTrainer(tmp_path, _cfg(tmp_path, port, **kw))
        made.append(t)
        return t

    yield start
    for t in made:
        t.stop()


def _gone(pid):
    """The process ended (a zombie counts: it runs nothing; PID 1 here may not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _call(address, request):
    with grpc.insecure_channel(address) as ch:
        raw = ch.unary_unary(CHUNK_METHOD)(
            request.encode(), timeout=30, metadata=[("authorization", f"Bearer {TOKEN}")]
        )
    return ChunkReply.decode(raw)


def test_fetch_over_several_serving_processes_is_bit_exact(tmp_path, pool_trainer):
    t = pool_trainer(weights_serve_processes=3, weights_trainer_streams=4, weights_send_slots=6)
    cfg = t.cfg
    assert len(set(t.service.pool.ports())) == 3 and os.getpid() not in t.service.pool.pids()
    f = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "w0")
    try:
        dest = f.fetch(1, str(tmp_path / "w0" / "v000001"))
        assert _verified(dest, t.store)
        s = f.stats[1]
        # every chunk sent by the processes, none by the trainer's own (its GIL is not the limit)
        assert s.from_trainer == s.from_servers == s.chunks and s.server_failures == 0
        assert t.service.stats["chunks"] == 0
        _wait(lambda: t.service.answered, 30, "the trainer's probe of w0's peer server")
        # every chunk left the processes once: asked again by a fan-out worker, they defer to
        # the trainer, which (told so: `sent`) redirects to w0, the live peer holding them all
        everything = to_bitmap(range(s.chunks), s.chunks)
        ask = ChunkRequest(1, "w9", want=everything, peers=True)
        assert _call(f"127.0.0.1:{t.service.pool.ports()[1]}", ask).index == ASK_TRAINER
        ask.sent = True
        assert _call(cfg.grpc_address, ask).index == REDIRECT
        # a second worker with fan-out: the processes sent every chunk once already, so they
        # defer to the trainer, which knows w0 holds them all: w1 takes them from w0
        g = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "w1")
        try:
            dest1 = g.fetch(1, str(tmp_path / "w1" / "v000001"))
            assert _verified(dest1, t.store)
            s1 = g.stats[1]
            assert s1.from_peers + s1.from_trainer == s1.chunks and s1.from_peers > 0
            assert s1.from_servers < s1.chunks  # not every chunk left the trainer twice
        finally:
            g.close()
    finally:
        f.close()


def test_fanout_over_the_serving_processes(tmp_path, pool_trainer):
    """Four workers fetch at once from chunk servers with a slow uplink (1 MB/s in all, split
    over them): chunks flow between workers, and the trainer's processes together send fewer
    than four copies (test_weights_net's test_peer_fanout_used, with the processes)."""
    t = pool_trainer(weights_serve_processes=2, weights_upload_mb_s=1.0)
    fetchers = [WeightFetcher(t.cfg.grpc_address, TOKEN, t.cfg, f"w{i}") for i in range(4)]
    try:
        dests = fetch_at_once(fetchers, 1, tmp_path)
        stats = [f.stats[1] for f in fetchers]
        total = stats[0].chunks
        assert sum(s.from_peers for s in stats) > 0
        assert all(s.from_peers + s.from_trainer == total for s in stats)
        assert sum(s.from_trainer for s in stats) < 4 * total
        assert sum(s.from_servers for s in stats) > 0
        for i in range(4):
            assert _verified(dests[i], t.store)
    finally:
        for f in fetchers:
            f.close()


def test_killed_serving_process_is_replaced_and_the_fetch_completes(tmp_path, pool_trainer):
    # 1 MB/s in all: the 3 MB fetch lasts ~3 s, long enough to kill a process mid-way
    t = pool_trainer(
        weights_serve_processes=2, weights_trainer_streams=2, weights_upload_mb_s=1.0, weights_peer_fanout=False
    )
    pool, cfg = t.service.pool, t.cfg
    ports, pids = pool.ports(), pool.pids()
    f = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "w0")
    try:
        th, result = _background_fetch(f, str(tmp_path / "w0" / "v000001"))
        _wait(lambda: 1 in f.stats and f.stats[1].from_servers >= 4, 60, "chunks from the processes")
        os.kill(pids[0], signal.SIGKILL)
        th.join(timeout=120)
        assert not th.is_alive() and "error" not in result, result
        assert _verified(result["dest"], t.store)
        assert f.stats[1].from_trainer == f.stats[1].chunks
    finally:
        f.close()
    _wait(lambda: pool.pids()[0] not in (None, pids[0]) and pool.ports()[0], START_S, "the process replaced")
    assert pool.ports() == ports  # on its old port: workers' channels reconnect by themselves
    assert _gone(pids[0])
    g = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "w1")
    try:  # the replacement serves its chunks
        assert _verified(g.fetch(1, str(tmp_path / "w1" / "v000001")), t.store)
        assert g.stats[1].from_servers == g.stats[1].chunks and g.stats[1].server_failures == 0
    finally:
        g.close()


def test_hung_serving_process_is_killed_and_replaced(tmp_path, pool_trainer):
    t = pool_trainer(weights_serve_processes=2, weights_probe_timeout_s=1.0)
    pool = t.service.pool
    hung = pool.pids()[1]
    os.kill(hung, signal.SIGSTOP)  # alive to poll(), deaf to Pings
    try:  # 3 Pings of 1 s, a health tick each, the backoff, the start: well within START_S
        _wait(lambda: pool.pids()[1] not in (None, hung) and pool.ports()[1], START_S, "the hung process replaced")
        _wait(lambda: _gone(hung), 30, "the hung process killed")
    finally:
        if not _gone(hung):
            os.kill(hung, signal.SIGKILL)
    f = WeightFetcher(t.cfg.grpc_address, TOKEN, t.cfg, "w0")
    try:
        assert _verified(f.fetch(1, str(tmp_path / "w0" / "v000001")), t.store)
        assert f.stats[1].from_servers == f.stats[1].chunks
    finally:
        f.close()


def test_no_orphans_after_the_trainer_server_stops(tmp_path):
    _publish(tmp_path)
    port = free_port()
    cfg = _cfg(tmp_path, port, weights_serve_processes=2, grpc_linger_s=0)
    run = setup_trainer_run(str(tmp_path / "trainer"))
    server = run.serve(cfg)
    try:
        pool = server.weights.pool
        assert pool is not None and pool.wait_ready(START_S)
        pids = pool.pids()
        f = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "w0")
        try:
            assert _verified(f.fetch(1, str(tmp_path / "w0" / "v000001")), run.publisher)
            assert f.stats[1].from_servers == f.stats[1].chunks
        finally:
            f.close()
    finally:
        server.stop(grace_s=0.5)
    # ended and reaped by the pool, not zombies: the thread's end alone would have them killed
    # (PR_SET_PDEATHSIG follows the thread that started them) but leave them unreaped
    assert not any(os.path.exists(f"/proc/{p}") for p in pids), [_gone(p) for p in pids]


_KILLED_TRAINER = """
import sys, threading
from buffer.config import BufferConfig
from buffer.weights.fs import WeightStore
from buffer.weights.net_pool import chunk_servers
from buffer.weights.net_server import WeightService
store = WeightStore(sys.argv[1])
cfg = BufferConfig(transport="grpc", grpc_bind="127.0.0.1:0", weights_serve_processes=2)
service = WeightService(lambda v: None, "secret", cfg, chunk_servers(store.layout, "secret", cfg))
assert service.pool.wait_ready(float(sys.argv[2]))
print(*service.pool.pids(), flush=True)
threading.Event().wait()
"""


def test_no_orphans_after_the_trainer_is_killed(tmp_path):
    store = _publish(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLED_TRAINER), store.layout.root, str(START_S)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]  # bounded: it prints or exits
        assert len(pids) == 2, f"the trainer said {pids}"
        assert not any(_gone(p) for p in pids)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    _wait(lambda: all(_gone(p) for p in pids), 30, f"chunk servers {pids} to end with their trainer")


def test_serve_processes_refused_early_with_the_field_named(tmp_path):
    for bad in ("65", "-2"):
        with pytest.raises(ConfigError, match=r"^weights_serve_processes: must be [<>]= "):
            build(BufferConfig, {"weights_serve_processes": bad})
    assert build(BufferConfig, {"weights_serve_processes": "1"}).serve_processes() == 0  # today's: one process
    assert build(BufferConfig, {"weights_serve_processes": "3"}).serve_processes() == 3
    auto = build(BufferConfig, {}).serve_processes()
    assert auto == (0 if len(os.sched_getaffinity(0)) < 4 else min(4, len(os.sched_getaffinity(0)) // 2))
    with pytest.raises(ValueError, match="weights_serve_processes"):
        ChunkServerPool(WeightStore(str(tmp_path)).layout, TOKEN, BufferConfig(), 1)


def test_chunk_servers_speak_tls_and_check_the_token(tmp_path):
    from test_grpc_security import _self_signed

    cert, key = _self_signed(tmp_path)
    _publish(tmp_path)
    port = free_port()
    cfg = _cfg(tmp_path, port, weights_serve_processes=2, grpc_tls_cert=cert, grpc_tls_key=key, grpc_tls_ca=cert)
    cfg.grpc_address = f"localhost:{port}"  # the certificate's name: the chunk servers' too
    t = _PoolTrainer(tmp_path, cfg)
    try:
        f = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "w0")
        try:
            assert _verified(f.fetch(1, str(tmp_path / "w0" / "v000001")), t.store)
            assert f.stats[1].from_servers == f.stats[1].chunks and f.stats[1].server_failures == 0
        finally:
            f.close()
        server = f"127.0.0.1:{t.service.pool.ports()[0]}"
        ask = ChunkRequest(1, "w9", index=0)
        with pytest.raises(grpc.RpcError) as e:  # no TLS: no connection (the token never leaves)
            _call(server, ask)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        creds = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
        with grpc.secure_channel(f"localhost:{t.service.pool.ports()[0]}", creds) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(CHUNK_METHOD)(ask.encode(), timeout=30, metadata=[("authorization", "Bearer wrong")])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        t.stop()
