"""gRPC experience transport against a raw TCP copy of the same bytes, on loopback.

    python benchmarks/grpc_bench.py [--shards 150] [--samples 2048] [--rounds 5] [--out results.json]

tandem: the gRPC ExperienceSink's push path (shards already encoded, streamed in chunks, at most
`--inflight` unacknowledged) -> ShardServer in another process (token check, sha256 while
writing, fsync + rename, then ack). Baselines, same shard bytes, same machine, same run, receiver
in another process too: a raw socket copy into memory, and a raw socket copy that also writes and
fsyncs each shard before its ack (the durability tandem's ack promises). And the ceiling: bare
gRPC, the same chunk framing into a handler that only counts bytes. Column validation is the
reader's for both transports (buffer_bench.py measures it). The four are run in turn for
`--rounds` rounds (disk speed drifts on a shared VM) and each ratio is the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from concurrent import futures

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def _raw_receiver(port_q, sizes: list[int], folder: str | None) -> None:
    """The raw baseline's receiving process: read each shard's bytes, optionally write + fsync
    them, then ack with one byte, like tandem's server."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    with conn:
        for i, size in enumerate(sizes):
            buf = bytearray(size)
            view, got = memoryview(buf), 0
            while got < size:
                got += conn.recv_into(view[got:], min(1 << 20, size - got))
            if folder:
                with open(os.path.join(folder, f"{i}.bin"), "wb") as f:
                    f.write(buf)
                    f.flush()
                    os.fsync(f.fileno())
            conn.sendall(b"k")
    srv.close()


def raw_copy(payloads: list[bytes], folder: str | None) -> float:
    """Seconds to send every payload over one TCP connection to another process, waiting for
    each ack (written + fsynced first when `folder` is given)."""
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    proc = ctx.Process(target=_raw_receiver, args=(port_q, [len(p) for p in payloads], folder))
    proc.start()
    port = port_q.get(timeout=60)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        for p in payloads:
            c.sendall(p)
            c.recv(1)
    dt = time.perf_counter() - t0
    proc.join(timeout=60)
    return dt


def _grpc_server(root: str, cfg, ready, stop, stats_q) -> None:
    """The trainer side in its own process, as in a real run (rank 0 of the trainer)."""
    from buffer.experience.net_server import ShardServer

    server = ShardServer(root, cfg)
    ready.set()
    stop.wait(timeout=3600)
    server.stop()
    stats_q.put(dict(server.servicer.stats))


def grpc_copy(payloads: list[bytes], cfg, root: str) -> float:
    """Seconds for the gRPC ExperienceSink's push path (after encoding) to get every shard acknowledged
    by a ShardServer in another process."""
    from buffer.writer import ShardWriter

    ctx = mp.get_context("spawn")
    ready, stop, stats_q = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_grpc_server, args=(os.path.join(root, "trainer"), cfg, ready, stop, stats_q))
    proc.start()
    assert ready.wait(timeout=60), "gRPC server did not start"
    writer = ShardWriter.at(os.path.join(root, "worker"), "w0", cfg)
    t0 = time.perf_counter()
    for seq, data in enumerate(payloads):
        writer.sink.publish(seq, data)  # the writer's flush path after encoding
    writer.close(timeout_s=600)
    dt = time.perf_counter() - t0
    stop.set()
    stats = stats_q.get(timeout=60)
    proc.join(timeout=60)
    assert stats.get("spooled") == len(payloads), stats
    return dt


def _bare_server(port_q, stop) -> None:
    """The ceiling: the same chunked stream into a gRPC handler that only counts bytes."""
    import grpc

    from protocol.shard_stream import decode_chunk

    def push(chunks, context):
        return bytes(sum(len(c) if isinstance(c, memoryview) else 0 for c in chunks) > 0)

    server = grpc.server(futures.ThreadPoolExecutor(16), options=[("grpc.max_receive_message_length", 8 << 20)])
    handler = grpc.stream_unary_rpc_method_handler(push, request_deserializer=decode_chunk)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bare.Bare", {"Push": handler})])
    port_q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait(timeout=3600)
    server.stop(1)


def bare_grpc_copy(payloads: list[bytes], chunk: int, inflight: int) -> float:
    """Seconds to stream every payload through bare gRPC (same framing, `inflight` at a time)."""
    import grpc

    from protocol.shard_stream import encode_chunk

    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_bare_server, args=(port_q, stop))
    proc.start()
    port = port_q.get(timeout=60)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        push = channel.stream_unary("/bare.Bare/Push", request_serializer=encode_chunk)

        def one(data: bytes):
            view = memoryview(data)
            return push(iter([view[i : i + chunk] for i in range(0, len(data), chunk)]), timeout=60)

        t0 = time.perf_counter()
        with futures.ThreadPoolExecutor(inflight) as pool:
            list(pool.map(one, payloads))
        dt = time.perf_counter() - t0
    stop.set()
    proc.join(timeout=60)
    return dt


def one_round(payloads: list[bytes], cfg, work: str, i: int) -> dict[str, float]:
    """Seconds for each of the four, run back to back on fresh folders."""
    root = os.path.join(work, f"round{i}")
    os.makedirs(os.path.join(root, "raw"))
    out = {
        "grpc": grpc_copy(payloads, cfg, root),
        "raw": raw_copy(payloads, folder=None),
        "raw_fsync": raw_copy(payloads, folder=os.path.join(root, "raw")),
        "bare_grpc": bare_grpc_copy(payloads, cfg.grpc_chunk_kb << 10, cfg.grpc_max_inflight),
    }
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=150)
    ap.add_argument("--samples", type=int, default=2048, help="samples per shard")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inflight", type=int, default=8, help="buffer.grpc_max_inflight")
    ap.add_argument("--chunk-kb", type=int, default=1024, help="buffer.grpc_chunk_kb")
    ap.add_argument("--out")
    args = ap.parse_args()
    from conftest import make_group

    from buffer.config import BufferConfig
    from protocol.experience import encode, to_table

    work = tempfile.mkdtemp(prefix="grpc_bench_")
    with open(os.path.join(work, "token"), "w") as f:
        f.write("bench")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = BufferConfig(
        transport="grpc",
        grpc_bind=f"127.0.0.1:{port}",
        grpc_address=f"127.0.0.1:{port}",
        grpc_token_file=os.path.join(work, "token"),
        flush_samples=args.samples,
        grpc_max_inflight=args.inflight,
        grpc_chunk_kb=args.chunk_kb,
    )
    groups = [make_group("w0", 0, g, 0, 16, prompt_len=64, response_len=192) for g in range(args.samples // 16)]
    # Encoding Samples to Arrow is the worker's cost with either transport (see buffer_bench.py);
    # here both sides move the same ready shard bytes.
    payloads = [encode(to_table([s for g in groups for s in g])) for _ in range(args.shards)]
    total = sum(len(p) for p in payloads)
    rounds = [one_round(payloads, cfg, work, i) for i in range(args.rounds)]
    shutil.rmtree(work, ignore_errors=True)
    mbps = {k: [total / r[k] / 1e6 for r in rounds] for k in rounds[0]}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()}-core CPU",
        "shards": args.shards,
        "shard_mb": len(payloads[0]) / 1e6,
        "rounds": args.rounds,
        "inflight": args.inflight,
        "chunk_kb": args.chunk_kb,
        "MBps_per_round": mbps,
        "grpc_MBps_incl_sha256_fsync": statistics.median(mbps["grpc"]),
        "raw_socket_MBps": statistics.median(mbps["raw"]),
        "raw_socket_fsync_MBps": statistics.median(mbps["raw_fsync"]),
        "bare_grpc_MBps": statistics.median(mbps["bare_grpc"]),
        "grpc_over_bare_grpc": statistics.median(r["bare_grpc"] / r["grpc"] for r in rounds),
        "grpc_over_raw_socket": statistics.median(r["raw"] / r["grpc"] for r in rounds),
        "grpc_over_raw_socket_fsync": statistics.median(r["raw_fsync"] / r["grpc"] for r in rounds),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
