"""Network receive rate of one worker from the trainer's weight service on loopback (issue 26).

    python -m benchmarks.weights_receive [--model-mb 512] [--streams 1,2,4,8] [--chunk-kb 4096]
        [--repeats 2] [--out benchmarks/results/weights_receive.json]

The trainer (this process) serves a published version (random safetensors, 4 files like HF
shards, published by WeightStore) through its experience gRPC server's `WeightService`; one
`WeightFetcher` (no peers: every chunk from the trainer, no upload cap) fetches it into a fresh
folder with N chunk requests in flight (`buffer.weights_trainer_streams`). MB/s = model bytes /
wall seconds of `fetch()` (chunk list, transfer, every file checked against the manifest,
rename). The acceptance (issue 26) asks >= 1 GB/s on the GPU machine's 16 cores, or the limit
named with a profile. Where the time goes (`profile` in the output, per MB moved):
- `sha256_mb_s`: one core hashing 4 MiB buffers, and N threads at once (hashlib releases the
  GIL): each chunk is hashed once by the receiver against the chunk list, and each file once
  more against the manifest (`finish_s`: what is left of that after the transfer);
- `copy_mb_s`: one memcpy of a 4 MiB buffer (bytes(memoryview)): the price of each copy of a
  chunk on its way (server: pread, reply encoding; client: reply decoding, pwrite);
- `cpu_s_per_gb`: process CPU seconds (user + system, both sides: server and client share this
  process) per GB received, and `cpu_cores_busy` = CPU seconds / wall seconds: when it reaches
  the machine's cores, the CPU is the limit, not the streams.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from concurrent import futures

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT_DIR)

from benchmarks.weights_fanout import TOKEN, publish_model  # noqa: E402


def _cfg(port: int, streams: int, chunk_kb: int):
    from buffer.config import BufferConfig

    return BufferConfig(
        transport="grpc",
        grpc_address=f"127.0.0.1:{port}",
        grpc_bind=f"127.0.0.1:{port}",
        weights_chunk_kb=chunk_kb,
        weights_peer_fanout=False,
        weights_trainer_streams=streams,
        weights_send_slots=max(2, streams),
        grpc_server_threads=max(16, 2 * streams),
        weights_chunk_timeout_s=120.0,
        weights_stall_timeout_s=300.0,
    )


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def micro(threads: int) -> dict:
    """sha256 and memcpy rates on 4 MiB buffers (the default chunk)."""
    buf = os.urandom(4 << 20)
    n = 32
    t0 = time.perf_counter()
    for _ in range(n):
        hashlib.sha256(buf).digest()
    one = n * 4 / (time.perf_counter() - t0)
    with futures.ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda _: hashlib.sha256(buf).digest(), range(n * threads)))
        many = n * threads * 4 / (time.perf_counter() - t0)
    mv = memoryview(buf)
    t0 = time.perf_counter()
    for _ in range(n):
        bytes(mv[1:])
    copy = n * 4 / (time.perf_counter() - t0)
    return {"sha256_mb_s_1": one, f"sha256_mb_s_{threads}": many, "copy_mb_s": copy}


def fetch_once(store_root: str, nbytes: int, streams: int, chunk_kb: int, work: str) -> dict:
    from buffer.experience.net_server import ShardServer
    from buffer.weights.fs import WeightStore
    from buffer.weights.net_client import WeightFetcher
    from buffer.weights.net_server import add_weight_service

    sock = __import__("socket").socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cfg = _cfg(port, streams, chunk_kb)
    store = WeightStore(store_root)
    token_file = os.path.join(work, "token")
    with open(token_file, "w") as f:
        f.write(TOKEN)
    os.environ["TANDEM_GRPC_TOKEN"] = TOKEN
    shards = ShardServer(os.path.join(work, "shards"), cfg)
    service = add_weight_service(
        shards.server, lambda v: store.layout.version_dir(v) if store.exists(v) else None, TOKEN, cfg
    )
    fetcher = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "bench")
    dest = os.path.join(work, f"dest-{streams}")
    try:
        service._holding(1)  # the trainer hashes a version once, when it is first asked: not timed
        cpu0, t0 = _cpu(), time.monotonic()
        fetcher.fetch(1, dest)
        wall, cpu = time.monotonic() - t0, _cpu() - cpu0
        stats = fetcher.stats[1]
    finally:
        fetcher.close()
        shards.stop(grace_s=0.5)
        shutil.rmtree(dest, ignore_errors=True)
    return {
        "streams": streams,
        "chunk_kb": chunk_kb,
        "seconds": wall,
        "mb_s": nbytes / 1e6 / wall,
        "transfer_s": stats.seconds,
        "finish_s": wall - stats.seconds,  # chunk list + the whole-file checks + rename
        "cpu_s_per_gb": cpu / (nbytes / 1e9),
        "cpu_cores_busy": cpu / wall,
        "chunks": stats.chunks,
        "busy": stats.busy,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-mb", type=int, default=512)
    p.add_argument("--streams", default="1,2,4,8")
    p.add_argument("--chunk-kb", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", default=None, help="folder for the model and the fetches (default: temporary)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="weights_receive-")
    root, nbytes = publish_model(work, args.model_mb)
    streams = [int(s) for s in args.streams.split(",")]
    rows = []
    for n in streams:
        for _ in range(args.repeats):
            rows.append(fetch_once(root, nbytes, n, args.chunk_kb, work))
            print(json.dumps(rows[-1]), flush=True)
    best = {n: max(r["mb_s"] for r in rows if r["streams"] == n) for n in streams}
    out = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "model_bytes": nbytes,
        "best_mb_s": best,
        "profile": micro(min(8, os.cpu_count() or 1)),
        "runs": rows,
    }
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
