"""Hostile clients against the trainer's real gRPC servers on loopback (issue 30, items 3 to 7):
attackers are real gRPC clients holding the token, run in threads this test owns; honest calls are
timed unloaded, then while the attack runs, and must stay under 2x their unloaded time; the
servers' memory (their registries, the files they write) must stay bounded.

The 2x is asserted on medians of HONEST_CALLS calls (one slow call on a 2-core box shared by other
jobs moves a median little), and the unloaded median is floored at FLOOR_S: a call of a few ms
doubles with one scheduler tick, which says nothing about the server. Before the fixes the honest
calls waited for seconds (their CALL_TIMEOUT_S) or failed: far over either bound.

Items 5 and 7 (seq bound, rows against the shard's key): the last test."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import threading
import time
from collections import Counter

import grpc
import torch
from conftest import free_port, make_group
from safetensors.torch import save_file

from buffer.channel import WRITER_KEY, RunClient
from buffer.config import BufferConfig
from buffer.experience.net_server import EVICT_AFTER_S, SPARE_THREADS
from buffer.run import setup_trainer_run
from buffer.weights.net_client import WeightFetcher
from protocol import experience_pb2 as pb
from protocol import experience_pb2_grpc as pb_grpc
from protocol import run_service as rs
from protocol.experience import SCHEMA_VERSION, encode, to_table
from protocol.weights_wire import CHUNK_LIST_METHOD, PEERS_METHOD, ChunkListRequest, PeerReport

TOKEN = "hostile-token"
HONEST_CALLS = 9
FLOOR_S = 0.025
CALL_TIMEOUT_S = 8.0
AUTH = [("authorization", f"Bearer {TOKEN}")]


def _cfg(tmp_path, port, **kw) -> BufferConfig:
    (tmp_path / "token").write_text(TOKEN)
    base = dict(
        transport="grpc",
        grpc_bind=f"127.0.0.1:{port}",
        grpc_address=f"127.0.0.1:{port}",
        grpc_token_file=str(tmp_path / "token"),
        grpc_call_timeout_s=CALL_TIMEOUT_S,
        grpc_trainer_wait_s=CALL_TIMEOUT_S,
        grpc_linger_s=0,
        weights_chunk_kb=64,
        weights_peer_host="127.0.0.1",
        weights_peer_refresh_s=0.2,
        weights_chunk_timeout_s=CALL_TIMEOUT_S,
        weights_stall_timeout_s=30.0,
    )
    return BufferConfig(**{**base, **kw})


@contextlib.contextmanager
def _trainer(tmp_path, **kw):
    """The trainer's RunServer (pushes, run service, weight service on one port), v0 published."""
    cfg = _cfg(tmp_path, free_port(), **kw)
    run = setup_trainer_run(str(tmp_path / "trainer"))
    run.state.ensure_run_id()
    model = tmp_path / "model"  # 512 KB of weights: 8 chunks of 64 KiB (no transformers import: 12 s)
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    weights = torch.randn(128 << 10, generator=torch.Generator().manual_seed(0))
    save_file({"w": weights}, str(model / "model.safetensors"))
    run.publisher.publish_hf_folder(model, 0, 0, keep=2)
    server = run.serve(cfg)
    try:
        yield run, server, cfg
    finally:
        server.stop(grace_s=0.5)


class _Attack:
    """`n` threads each running `attack(i, stop)` until stopped, `pause_s` apart; the status
    codes they met. The attackers share this process (its GIL) and the box's 2 cores with the
    honest client: a loop without pauses would measure that contention, not the server's."""

    def __init__(self, n: int, attack, pause_s: float = 0.0):
        self.stop, self.codes, self.pause_s = threading.Event(), Counter(), pause_s
        self.threads = [threading.Thread(target=self._loop, args=(i, attack), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self, i, attack):
        while not self.stop.is_set():
            try:
                attack(i, self.stop)
                self.codes["OK"] += 1
            except grpc.RpcError as e:
                self.codes[e.code().name] += 1
            self.stop.wait(self.pause_s)

    def end(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)
            assert not t.is_alive(), "an attacker thread did not end"


def _times(call, n=HONEST_CALLS) -> list[float]:
    """Seconds of `n` calls, after one untimed (a first call's connection is no part)."""
    call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def _median_s(call, n=HONEST_CALLS) -> float:
    return statistics.median(_times(call, n))


def _around(before: dict[str, list[float]], honest: dict) -> dict[str, float]:
    """The unloaded medians from calls timed before the attack (`before`) and again after it: the
    box's own load (other jobs on 2 cores) may change while the attack runs, and a before-only
    baseline then fails the 2x with the attack refused as designed (CI: 0.40 s against 0.32)."""
    return {name: statistics.median(before[name] + _times(call, HONEST_CALLS)) for name, call in honest.items()}


def _within_2x(unloaded: dict, loaded: dict, factor: dict[str, float] | None = None) -> None:
    """Each honest call under attack within 2x its unloaded median (or `factor[name]` x)."""
    print("median seconds, unloaded:", unloaded, "under attack:", loaded)
    for name, before in unloaded.items():
        bound = (factor or {}).get(name, 2.0) * max(before, FLOOR_S)
        assert loaded[name] < bound, (name, unloaded, loaded)


def _wait(cond, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def _push(port, worker, seq, data, timeout=CALL_TIMEOUT_S):
    head = pb.ShardHeader(worker_id=worker, seq=seq, schema_version=SCHEMA_VERSION, size=len(data))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return pb_grpc.ExperienceStub(ch).Push(
            iter([pb.ShardChunk(header=head), pb.ShardChunk(data=data)]),
            timeout=timeout,
            metadata=[*AUTH, (WRITER_KEY, worker)],
        )


def _trickle(port, opened: Counter, period_s=0.5, size=1 << 20):
    """A push that announces `size` bytes and sends one every `period_s` (a new worker id each);
    `opened` counts them."""
    ids = iter(range(10**9))

    def attack(i, stop):
        worker = f"trickle{i}-{next(ids)}"
        opened[i] += 1
        head = pb.ShardHeader(worker_id=worker, seq=0, schema_version=SCHEMA_VERSION, size=size)

        def messages():
            yield pb.ShardChunk(header=head)
            while not stop.wait(period_s):
                yield pb.ShardChunk(data=b"x")

        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            pb_grpc.ExperienceStub(ch).Push(messages(), timeout=60, metadata=[*AUTH, (WRITER_KEY, worker)])

    return attack


def test_trickling_pushes_starve_no_honest_call(tmp_path):
    """Item 3: 12 streams trickling a byte every 0.5 s (a new id each, reconnecting when cut)
    against 4 push threads. Before: they held every thread (the idle watch only cuts silent
    streams) and the run and weight services shared those threads: every honest call waited.
    Now each service has its own pool, pushes past buffer.grpc_server_threads run on spare
    threads and evict the slowest under buffer.grpc_min_rate_bytes_s, so that slow ones do not
    stay. (Past the spare threads too, 4x as many trickling connections, each reconnecting at
    once, an honest push waits for the next eviction: up to EVICT_AFTER_S plus a watch tick.)"""
    with _trainer(tmp_path, grpc_server_threads=4, grpc_max_workers=4) as (run, server, cfg):
        port, client, seqs = server.port, RunClient(cfg), iter(range(10**6))
        shard = encode(to_table(make_group("h0", 0, 0, 0, 4)))
        weights = grpc.insecure_channel(cfg.grpc_address).unary_unary(CHUNK_LIST_METHOD)
        honest = {
            "push": lambda: _push(port, "h0", next(seqs), shard),
            "run state": lambda: client.call("RunState"),
            "chunk list": lambda: weights(ChunkListRequest(0).encode(), timeout=CALL_TIMEOUT_S, metadata=AUTH),
        }
        before = {name: _times(call, HONEST_CALLS) for name, call in honest.items()}
        opened: Counter = Counter()
        attack = _Attack(12, _trickle(port, opened))
        try:
            _wait(lambda: len(opened) == 12, 20, "12 trickling streams")
            time.sleep(2.0)  # their rates are measurable (EVICT_AFTER_S), and they are 3x older
            loaded = {name: _median_s(call) for name, call in honest.items()}
            assert len(server.servicer.streams) <= cfg.grpc_server_threads * SPARE_THREADS
            now = time.monotonic()  # the slow ones past grpc_server_threads were evicted
            kept = [s for s in list(server.servicer.streams) if s.client_time(now) > 3 * EVICT_AFTER_S]
            assert len(kept) <= cfg.grpc_server_threads, len(kept)
        finally:
            attack.end()
        try:
            unloaded = _around(before, honest)
        finally:
            client.channel.close()
        _within_2x(unloaded, loaded)
        assert server.servicer.stats["evicted"] >= HONEST_CALLS, server.servicer.stats
        assert attack.codes["CANCELLED"] > 0 and not attack.codes["OK"], attack.codes


def test_a_slow_or_endless_push_is_cut_by_its_rate_or_deadline(tmp_path):
    """Item 3 on an idle server: a trickle is cut once its rate over buffer.grpc_min_rate_window_s
    is under buffer.grpc_min_rate_bytes_s; a push fast enough but never ending at
    buffer.grpc_stream_deadline_s. Before, both held their threads until the client gave up."""
    with _trainer(tmp_path, grpc_min_rate_window_s=1.0, grpc_stream_deadline_s=3.0) as (run, server, cfg):
        codes: dict[str, grpc.StatusCode] = {}

        def push(name, period_s, data):
            head = pb.ShardHeader(worker_id=name, seq=0, schema_version=SCHEMA_VERSION, size=100 << 20)
            chunks = [pb.ShardChunk(header=head)] + [pb.ShardChunk(data=data)] * 1000
            with grpc.insecure_channel(cfg.grpc_address) as ch:
                try:
                    pb_grpc.ExperienceStub(ch).Push(
                        (time.sleep(period_s) or c for c in chunks), timeout=20, metadata=[*AUTH, (WRITER_KEY, name)]
                    )
                except grpc.RpcError as e:
                    codes[name] = e.code()

        started = time.monotonic()
        threads = [
            threading.Thread(target=push, args=("slow", 0.3, b"x")),
            threading.Thread(target=push, args=("endless", 0.1, b"y" * 8192)),  # 80 KiB/s
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        took = time.monotonic() - started
        stats = server.servicer.stats  # counted by each handler once its read fails: may lag the client
        _wait(lambda: stats["slow_streams"] + stats["stream_deadlines"] >= 2, 10, "both cut pushes counted")
        assert codes == {"slow": grpc.StatusCode.CANCELLED, "endless": grpc.StatusCode.CANCELLED}, codes
        assert stats["slow_streams"] == 1 and stats["stream_deadlines"] == 1, stats
        assert took < 10, took  # the deadline (3 s) plus the watch's ticks, not the client's 20 s
        for name in ("slow", "endless"):  # nothing published, no folder
            assert not os.path.exists(os.path.dirname(run.files.shard(name, 0)))


def _black_hole():
    """A listening socket that never accepts nor answers: a peer address that never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s


def test_fake_peers_and_reports_for_unpublished_versions(tmp_path):
    """Item 4: 2,000 reports name versions never published (8 KiB bitmaps each); then, while an
    honest fetch of v0 is timed, 40 fake peers (addresses that never answer) keep reporting every
    chunk of v0 and the reports for unpublished versions go on. Before: every report stayed in
    the registry for good, and the fakes were handed to the honest fetcher, which waited for
    them (the trainer redirected it to them). Now reports for unpublished versions are refused,
    the registry is bounded and expires, and peers are probed before being offered."""
    kw = dict(weights_probe_timeout_s=0.5, weights_max_registered_peers=32)
    with _trainer(tmp_path, **kw) as (run, server, cfg):
        service, versions = server.weights, iter(range(10**6, 10**7))
        report = grpc.insecure_channel(cfg.grpc_address).unary_unary(PEERS_METHOD)

        def unpublished(i, stop):
            fake = PeerReport(next(versions), f"u{i}", "127.0.0.1:1", b"\xff" * 8192)
            report(fake.encode(), timeout=5, metadata=AUTH)

        flood = _Attack(4, unpublished, pause_s=0.002)
        try:
            _wait(lambda: sum(flood.codes.values()) >= 2000, 60, "2,000 reports for unpublished versions")
        finally:
            flood.end()
        assert set(flood.codes) == {"NOT_FOUND"}, flood.codes
        assert not service.peers and not service._making, (len(service.peers), len(service._making))
        holes = [_black_hole() for _ in range(4)]

        def fakes(i, stop):  # often enough to stay registered (buffer.weights_peer_ttl_s: 10 s)
            if i == 0:
                try:
                    return unpublished(i, stop)
                finally:
                    stop.wait(0.1)
            try:
                for n in range(40):  # 8 more than the registry holds: those are refused
                    address = f"127.0.0.1:{holes[n % 4].getsockname()[1]}"
                    with contextlib.suppress(grpc.RpcError):
                        report(PeerReport(0, f"fake{n}", address, b"\xff").encode(), timeout=5, metadata=AUTH)
            finally:
                stop.wait(2.0)

        fetcher = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "honest")
        dests = iter(str(tmp_path / f"fetched{i}") for i in range(100))
        try:
            fetch = lambda: fetcher.fetch(0, next(dests))  # noqa: E731
            before = _times(fetch, n=HONEST_CALLS)
            attack = _Attack(2, fakes)
            try:
                _wait(lambda: service.stats["probes_failed"] >= 4, 10, "the probes of the fake peers")
                loaded = {"fetch": _median_s(fetch)}
                registered = sum(len(t) for t in service.peers.values())
            finally:
                attack.end()
            # a fetch fsyncs its chunks: on a box shared with other jobs its time drifts, so the
            # unloaded median is of calls before and after the attack
            unloaded = {"fetch": statistics.median(before + _times(fetch, n=HONEST_CALLS))}
        finally:
            fetcher.close()
            for s in holes:
                s.close()
        _within_2x(unloaded, loaded)
        assert registered == cfg.weights_max_registered_peers and set(service.peers) == {0}
        assert set(service.answered) == {fetcher.peer_address}, service.answered  # the fakes never
        last = fetcher.stats[0]  # of the last fetch: every chunk from the trainer, none asked of a fake
        assert last.peer_failures == 0 and last.from_trainer == last.chunks, last


def test_claims_heartbeats_and_worker_ids_are_bounded(tmp_path):
    """Item 6: ~450 invented worker ids with 30 KiB heartbeats each, then, while honest calls are
    timed, claims of 2^62 groups (wanting 2,000), 512 KiB heartbeats and more invented ids.
    Before: every id kept a heartbeat, the Heartbeats reply outgrew the 4 MiB message limit, a
    heartbeat of up to 1 MiB was kept and a claim created files for as long as it was let.
    Now ids are bounded by buffer.grpc_max_worker_ids, the reply by rs.MAX_REPLY_BYTES, claims
    by buffer.grpc_max_claim_groups, heartbeats by rs.MAX_BEAT_BYTES. The unloaded times are
    taken with the ids' heartbeats stored (a Heartbeats reply of 4 MiB takes longer to read
    than one of 100 bytes, attack or not). The honest worker's id is known before the flood:
    new ids wait (RESOURCE_EXHAUSTED, retried) while the bound is full of live ones."""
    kw = dict(grpc_max_claim_groups=64, grpc_max_worker_ids=200, grpc_max_workers=4)
    with _trainer(tmp_path, **kw) as (run, server, cfg):
        run.sync.open_version(0)
        client, ids, kinds = RunClient(cfg), iter(range(10**6)), Counter()
        stubs, meta = {n: client._stub(n) for n in ("SyncClaim", "WriteHeartbeat")}, client.metadata

        def invent(i, stop):
            worker = f"f{next(ids)}"
            fake = {"worker_id": worker, "last_beat": time.time(), "pad": "z" * (30 << 10)}
            stubs["WriteHeartbeat"](rs.HeartbeatWrite(worker, fake), timeout=5, metadata=meta)

        def flood(i, stop):
            try:
                if i == 0:  # a claim of every slot there could be
                    claim = rs.ClaimRequest(0, 2**62, 2000, "x", rs.new_request_id())
                    stubs["SyncClaim"](claim, timeout=5, metadata=meta)
                elif i == 1:
                    big = {"worker_id": "big", "pad": "z" * (512 << 10)}
                    stubs["WriteHeartbeat"](rs.HeartbeatWrite("big", big), timeout=5, metadata=meta)
                else:
                    invent(i, stop)
            except grpc.RpcError as e:
                kinds[i, e.code().name] += 1
                raise

        beat = {"worker_id": "h0", "state": "running", "last_beat": time.time()}
        client.call("WriteHeartbeat", rs.HeartbeatWrite("h0", beat))  # a worker of the run, from its start
        filling = _Attack(2, invent, pause_s=0.005)
        try:
            _wait(lambda: filling.codes["RESOURCE_EXHAUSTED"] >= 10, 30, "invented worker ids past the bound")
        finally:
            filling.end()
        honest = {
            "heartbeat": lambda: client.call("WriteHeartbeat", rs.HeartbeatWrite("h0", beat)),
            "claim": lambda: client.call("SyncClaim", rs.ClaimRequest(0, 64, 1, "h0", request_id=rs.new_request_id())),
            "heartbeats": lambda: client.call("Heartbeats"),
        }
        before = {name: _times(call, HONEST_CALLS) for name, call in honest.items()}
        attack = _Attack(4, flood, pause_s=0.005)
        try:
            _wait(lambda: sum(attack.codes.values()) >= 40, 30, "the attack under way")
            loaded = {name: _median_s(call) for name, call in honest.items()}
            reply = client.call("Heartbeats")
        finally:
            attack.end()
        try:
            unloaded = _around(before, honest)
        finally:
            client.channel.close()
        # Heartbeats reads a ~4 MiB reply: msgpack encode (server) and decode (client), CPU-bound
        # under the test process's one GIL, which the 4 attacker threads take between their calls
        # (and on 2 cores the server's and client's threads share them too). Seen 2.2x in a full
        # suite run (0.127 s against 0.058), whereas the faults this guards (a reply outgrowing the
        # message limit, ids without bound) fail it or grow it without bound: 3x for it.
        _within_2x(unloaded, loaded, factor={"heartbeats": 3.0})
        assert len(rs.encode(reply)) <= rs.MAX_REPLY_BYTES + (64 << 10)
        assert "h0" in {b["worker_id"] for b in reply.docs}  # the small honest beat is kept
        assert kinds[0, "INVALID_ARGUMENT"] and kinds[1, "INVALID_ARGUMENT"], kinds
        assert kinds[2, "RESOURCE_EXHAUSTED"] and kinds[3, "RESOURCE_EXHAUSTED"], kinds
        assert len(os.listdir(run.files.workers_dir)) <= cfg.grpc_max_worker_ids
        assert set(run.sync.claims(0).values()) == {"h0"}  # the honest claims' slots only
        assert len(server.run_service.seen) <= cfg.grpc_max_worker_ids


def test_seq_jumps_and_foreign_rows_cost_the_attacker_only(tmp_path):
    """Items 5 and 7: while honest pushes are timed, token holders push shards with seq 10**12
    (a new id each) and push h0's rows under ids of their own. Before: the first seq jump made
    every later shard of that id "below the highest", accepted past the backlog cap, and the
    re-keyed rows were read a second time. Now a seq more than SEQ_WINDOW past the highest
    accepted is refused (INVALID_ARGUMENT) and a shard whose rows are not its worker's is
    quarantined when read: only h0's rows are read, and the spool holds h0's shards, one
    in-window shard per jumping id and the foreign ones, never a jump."""
    from buffer.experience.net_server import SEQ_WINDOW
    from buffer.experience.reader import ExperienceReader

    with _trainer(tmp_path) as (run, server, cfg):
        port, seqs = server.port, iter(range(10**6))
        honest_rows = to_table(make_group("h0", 0, 0, 0, 4))
        shard = encode(honest_rows)
        honest_push = {"push": lambda: _push(port, "h0", next(seqs), shard)}
        before = {"push": _times(honest_push["push"], HONEST_CALLS)}
        ids, foreign = iter(range(10**9)), Counter()

        def attack(i, stop):
            worker = f"x{next(ids)}"
            if i == 0:  # one shard in the window, then one far past it
                _push(port, worker, 0, shard)
                _push(port, worker, 10**12, shard)
            elif foreign[i] < 3:  # h0's rows (no worker/seq metadata) as shards of its own
                foreign[i] += 1
                _push(port, f"f{i}", foreign[i] - 1, shard)
            else:
                _push(port, worker, SEQ_WINDOW + 1, shard)

        attack_ = _Attack(3, attack, pause_s=0.005)
        try:
            _wait(lambda: server.servicer.stats["seq_out_of_window"] >= 20, 30, "20 seq jumps refused")
            loaded = {"push": _median_s(honest_push["push"])}
        finally:
            attack_.end()
        _within_2x(_around(before, honest_push), loaded)
        assert attack_.codes["INVALID_ARGUMENT"] >= 20, attack_.codes
        honest = next(seqs)  # shards h0 pushed (its sample ids repeat: one group's, 4 samples)
        jumpers = attack_.codes["INVALID_ARGUMENT"]
        # spooled: h0's, the jumpers' in-window shard 0 each, the 6 foreign ones; never a jump
        assert server.servicer.stats["spooled"] <= honest + jumpers + 6, server.servicer.stats
        reader = ExperienceReader(str(tmp_path / "trainer"), cfg, max_staleness=100)
        try:
            got = []
            with contextlib.suppress(TimeoutError):
                while True:
                    got += reader.next_batch(1, 0, timeout_s=1.0)
        finally:
            reader.close()
        assert reader.stats["foreign_row_shards"] >= 6, reader.stats  # f1's and f2's, and the x's
        assert all(s.sample_id.startswith("h0/") for g in got for s in g.samples)
