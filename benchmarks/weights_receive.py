"""Network receive rate of one worker from the trainer's weight service on loopback (issue 26).

    python -m benchmarks.weights_receive [--model-mb 512] [--streams 1,2,4,8] [--chunk-kb 4096]
        [--serve-processes 1,4] [--repeats 2] [--out benchmarks/results/weights_receive.json]

The trainer (this process) serves a published version (random safetensors, 4 files like HF
shards, published by WeightStore) through its experience gRPC server's `WeightService`; one
`WeightFetcher` (no peers: every chunk from the trainer, no upload cap) fetches it into a fresh
folder with N chunk requests in flight (`buffer.weights_trainer_streams`). MB/s = model bytes /
wall seconds of `fetch()` (chunk list, transfer, every file checked against the manifest,
rename). `--serve-processes N` (each value a fresh trainer process): the trainer's chunks from
N chunk-server processes of its own (`buffer.weights_serve_processes`; 1: its own process, as
before), the worker's streams spread over them. The acceptance (issue 26) asks >= 1 GB/s on
the GPU machine's 16 cores, or the limit named with a profile. Where the time goes (`profile`
in the output, per MB moved):
- `sha256_mb_s`: one core hashing 4 MiB buffers, and N threads at once (hashlib releases the
  GIL): each chunk is hashed once by the receiver against the chunk list, and each file once
  more against the manifest (`finish_s`: what is left of that after the transfer);
- `copy_mb_s`: one memcpy of a 4 MiB buffer (bytes(memoryview)): the price of each copy of a
  chunk on its way (server: pread, reply encoding; client: reply decoding, pwrite);
- `worker_cpu_s_per_gb`: the worker's CPU seconds (user + system, all its threads) per GB
  received, and `worker_cores_busy` = CPU seconds / wall seconds; `trainer_cpu_s_per_gb` the
  same of the trainer's processes (a subprocess here, as in a run: its own GIL; with
  --serve-processes N, `trainer_cpu_s_per_gb_by_process`: the main one, then each chunk
  server, per GB of all the fetches of that N). Much of a
  Python process's work per chunk holds the GIL (gRPC's Python layer, message decoding): CPU
  seconds per GB near 1 / (wall seconds per GB) on one busy core name the GIL as the limit;
- `stages`: one chunk at a time in one thread, the MB/s and share of each step of the worker's
  path: the gRPC call (trainer: pread, encode, send), decoding the reply, sha256, pwrite;
- `--profile FILE`: cProfile of the worker's fetch at the most streams (`python -m pstats`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent import futures

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT_DIR)

from benchmarks.weights_fanout import TOKEN, publish_model  # noqa: E402


def _cfg(port: int, streams: int, chunk_kb: int, processes: int = 1):
    from buffer.config import BufferConfig

    return BufferConfig(
        weights_serve_processes=processes,
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


def serve(args) -> None:
    """The trainer's side in its own process (as in a run: its own GIL): the weight service on
    an experience gRPC server, READY <port>, then serve until stdin closes; prints its CPU s."""
    from buffer.experience.net_server import ShardServer
    from buffer.weights.fs import WeightStore
    from buffer.weights.net_pool import chunk_servers
    from buffer.weights.net_server import add_weight_service

    store = WeightStore(args.serve)
    cfg = _cfg(0, args.max_streams, args.chunk_kb, args.serve_processes[0])
    shards = ShardServer(os.path.join(args.work, "shards"), cfg)
    service = add_weight_service(
        shards.server,
        lambda v: store.layout.version_dir(v) if store.exists(v) else None,
        TOKEN,
        cfg,
        chunk_servers(store.layout, TOKEN, cfg),
    )
    if service.pool is not None and not service.pool.wait_ready(120):
        raise RuntimeError(f"the chunk servers did not start: ports {service.pool.ports()}")
    service._holding(1)  # the trainer hashes a version once, when it is first asked: not timed
    cpu0 = _cpu()
    pool0 = service.pool.cpu_seconds() if service.pool is not None else {}
    print(f"READY {shards.port}", flush=True)
    sys.stdin.read()
    pool1 = service.pool.cpu_seconds() if service.pool is not None else {}
    spent = [_cpu() - cpu0] + [pool1[p] - pool0[p] for p in pool0 if p in pool1]
    print("CPU", *spent, flush=True)
    shards.stop(grace_s=0.5)
    service.close()


def fetch_once(
    port: int, nbytes: int, streams: int, chunk_kb: int, work: str, profile: str | None, processes: int
) -> dict:
    from buffer.weights.net_client import WeightFetcher

    cfg = _cfg(port, streams, chunk_kb)
    fetcher = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "bench")
    dest = os.path.join(work, f"dest-{streams}")
    prof = None
    try:
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        cpu0, t0 = _cpu(), time.monotonic()
        fetcher.fetch(1, dest)
        wall, cpu = time.monotonic() - t0, _cpu() - cpu0
        if prof is not None:
            prof.disable()
            prof.dump_stats(profile)
        stats = fetcher.stats[1]
    finally:
        fetcher.close()
        shutil.rmtree(dest, ignore_errors=True)
    return {
        "serve_processes": processes,
        "streams": streams,
        "chunk_kb": chunk_kb,
        "seconds": wall,
        "mb_s": nbytes / 1e6 / wall,
        "transfer_s": stats.seconds,
        "finish_s": wall - stats.seconds,  # chunk list + the whole-file checks + rename
        "worker_cpu_s_per_gb": cpu / (nbytes / 1e9),  # all the worker's threads
        "worker_cores_busy": cpu / wall,
        "chunks": stats.chunks,
        "from_chunk_servers": stats.from_servers,
        "busy": stats.busy,
    }


def stages(port: int, chunk_kb: int, work: str, n: int = 32) -> dict:
    """Where a chunk's time goes on the worker, one chunk at a time in one thread: the gRPC
    call (the trainer reads, encodes and sends; gRPC receives), decoding the reply, its sha256,
    its write (pwrite into the page cache). MB/s of each stage alone."""
    from buffer.weights.net_client import WeightFetcher
    from protocol.weights_wire import CHUNK_METHOD, ChunkReply, ChunkRequest

    cfg = _cfg(port, 1, chunk_kb)
    f = WeightFetcher(cfg.grpc_address, TOKEN, cfg, "stages")
    try:
        chunks = f._chunk_list(1)
        call = f.trainer.unary_unary(CHUNK_METHOD)
        spent = {"rpc": 0.0, "decode": 0.0, "sha256": 0.0, "pwrite": 0.0}
        fd = os.open(os.path.join(work, "stages.bin"), os.O_RDWR | os.O_CREAT, 0o644)
        moved = 0
        try:
            for i in range(min(n, chunks.total)):
                t0 = time.perf_counter()
                raw = call(ChunkRequest(1, "stages", index=i).encode(), timeout=60, metadata=f.metadata)
                t1 = time.perf_counter()
                reply = ChunkReply.decode(raw)
                t2 = time.perf_counter()
                hashlib.sha256(reply.data).digest()
                t3 = time.perf_counter()
                os.pwrite(fd, reply.data, moved)
                t4 = time.perf_counter()
                moved += len(reply.data)
                for k, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    spent[k] += dt
        finally:
            os.close(fd)
            os.remove(os.path.join(work, "stages.bin"))
    finally:
        f.close()
    total = sum(spent.values())
    return {
        "chunks": min(n, chunks.total),
        **{f"{k}_mb_s": moved / 1e6 / v for k, v in spent.items() if v},
        **{f"{k}_share": v / total for k, v in spent.items()},
    }


def _trainer(root: str, work: str, chunk_kb: int, max_streams: int, processes: int) -> subprocess.Popen:
    """The trainer's process (its weight service, `processes` serving) and its port."""
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.weights_receive", "--serve", root, "--work", work]
        + ["--chunk-kb", str(chunk_kb), "--max-streams", str(max_streams), "--serve-processes", str(processes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT_DIR,
    )


def run_processes(args, root: str, nbytes: int, streams: list[int], processes: int, work: str, first: bool):
    """Every stream count against one trainer process serving from `processes`: the rows,
    the trainer's CPU seconds [main, chunk servers...] and (first only) the chunk stages."""
    server = _trainer(root, work, args.chunk_kb, max(streams), processes)
    rows, chunk_stages = [], None
    try:
        line = server.stdout.readline().split()  # bounded: the server prints READY or exits
        if not line or line[0] != "READY":
            raise RuntimeError(f"the trainer process did not start (said {line!r})")
        for n in streams:
            for _ in range(args.repeats):
                profile = args.profile if n == max(streams) and first else None
                rows.append(fetch_once(int(line[1]), nbytes, n, args.chunk_kb, work, profile, processes))
                print(json.dumps(rows[-1]), flush=True)
        if first:
            chunk_stages = stages(int(line[1]), args.chunk_kb, work)
        server.stdin.close()
        said = server.stdout.read().split()
        cpu = [float(x) for x in said[said.index("CPU") + 1 :]] if "CPU" in said else None
    finally:
        if server.poll() is None:
            server.terminate()
        server.wait(timeout=60)
    return rows, cpu, chunk_stages


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-mb", type=int, default=512)
    p.add_argument("--streams", default="1,2,4,8")
    p.add_argument("--chunk-kb", type=int, default=4096)
    p.add_argument("--serve-processes", default="1", help="trainer processes sending chunks, comma-separated runs")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", default=None, help="folder for the model and the fetches (default: temporary)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="cProfile the worker's fetch at the most streams into this file")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # the trainer's process
    p.add_argument("--max-streams", type=int, default=8, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.serve_processes = [int(n) for n in args.serve_processes.split(",")]
    work = args.work or tempfile.mkdtemp(prefix="weights_receive-")
    if args.serve:
        args.work = work
        serve(args)
        return {}
    root, nbytes = publish_model(work, args.model_mb)
    streams = [int(s) for s in args.streams.split(",")]
    os.environ["TANDEM_GRPC_TOKEN"] = TOKEN
    rows, cpu_by, chunk_stages = [], {}, None
    for k, n in enumerate(args.serve_processes):
        got, cpu, st = run_processes(args, root, nbytes, streams, n, work, first=k == 0)
        rows += got
        chunk_stages = chunk_stages or st
        gb = nbytes / 1e9 * len(got)
        cpu_by[n] = None if cpu is None else [c / gb for c in cpu]
    best = {
        n: {s: max(r["mb_s"] for r in rows if r["streams"] == s and r["serve_processes"] == n) for s in streams}
        for n in args.serve_processes
    }
    out = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "model_bytes": nbytes,
        "best_mb_s": best,  # serve processes -> streams -> MB/s
        # serve processes -> CPU s per GB served: all the trainer's processes, and each one
        "trainer_cpu_s_per_gb": {n: None if c is None else sum(c) for n, c in cpu_by.items()},
        "trainer_cpu_s_per_gb_by_process": cpu_by,
        "profile": micro(min(8, os.cpu_count() or 1)),
        "stages": chunk_stages,
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
