"""gRPC experience transport against a raw TCP copy of the same bytes, on loopback.

    python benchmarks/grpc_bench.py [--shards 40] [--samples 2048] [--out results.json]

tandem: GrpcShardWriter's push path -> ShardServer (token check, sha256 + column validation,
atomic spool with fsync, then ack; at most 8 shards in flight), on shards already encoded. Baselines, same shard bytes, same machine, same
run: a raw socket copy into memory, and a raw socket copy that also writes and fsyncs each shard
(the durability tandem's ack promises).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def raw_copy(payloads: list[bytes], durable: bool, folder: str) -> float:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def receive():
        conn, _ = srv.accept()
        with conn:
            for i, size in enumerate(len(p) for p in payloads):
                buf = bytearray()
                while len(buf) < size:
                    buf += conn.recv(min(1 << 20, size - len(buf)))
                if durable:
                    with open(os.path.join(folder, f"{i}.bin"), "wb") as f:
                        f.write(buf)
                        f.flush()
                        os.fsync(f.fileno())
                conn.sendall(b"k")  # ack, like tandem's
    t = threading.Thread(target=receive)
    t.start()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        for p in payloads:
            c.sendall(p)
            c.recv(1)
    dt = time.perf_counter() - t0
    t.join(timeout=60)
    srv.close()
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--samples", type=int, default=2048, help="samples per shard")
    ap.add_argument("--out")
    args = ap.parse_args()
    from buffer.config import BufferConfig
    from buffer.grpc_transport import GrpcShardWriter, ShardServer
    from conftest import make_group
    from protocol.experience import encode, to_table

    work = tempfile.mkdtemp(prefix="grpc_bench_")
    with open(os.path.join(work, "token"), "w") as f:
        f.write("bench")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = BufferConfig(transport="grpc", grpc_bind=f"127.0.0.1:{port}", grpc_address=f"127.0.0.1:{port}",
                       grpc_token_file=os.path.join(work, "token"), flush_samples=args.samples)
    groups = [make_group("w0", 0, g, 0, 16, prompt_len=64, response_len=192)
              for g in range(args.samples // 16)]
    shard_bytes = len(encode(to_table([s for g in groups for s in g])))
    # Encoding Samples to Arrow is the worker's cost with either transport (see buffer_bench.py);
    # here both sides move the same ready shard bytes.
    payloads = [encode(to_table([s for g in groups for s in g])) for _ in range(args.shards)]
    server = ShardServer(os.path.join(work, "trainer"), cfg, vocab_size=60_000)
    writer = GrpcShardWriter(os.path.join(work, "worker"), "w0", cfg)
    t0 = time.perf_counter()
    for seq, data in enumerate(payloads):
        writer._publish(seq, data)  # the writer's flush path after encoding
    writer.close(timeout_s=600)
    grpc_s = time.perf_counter() - t0
    assert server.servicer.stats["spooled"] == args.shards
    server.stop()
    mem_s = raw_copy(payloads, durable=False, folder=work)
    disk_dir = os.path.join(work, "raw")
    os.makedirs(disk_dir)
    disk_s = raw_copy(payloads, durable=True, folder=disk_dir)
    total = shard_bytes * args.shards
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()}-core CPU",
              "shards": args.shards, "shard_mb": shard_bytes / 1e6,
              "grpc_MBps_incl_validate_fsync": total / grpc_s / 1e6,
              "raw_socket_MBps": total / mem_s / 1e6, "raw_socket_fsync_MBps": total / disk_s / 1e6,
              "grpc_over_raw_socket": mem_s / grpc_s, "grpc_over_raw_socket_fsync": disk_s / grpc_s}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
