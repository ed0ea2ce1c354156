"""One weight version delivered to N workers over the network, with and without peer fan-out.

    python benchmarks/weights_fanout.py [--model-mb 1024] [--workers 1,8,32] [--rate-mb-s 4]
        [--direct-model-mb 16] [--repeats 1] [--out results.json]    (--quick: 64 MB, 1,8)

The trainer (this process) serves a published version (random safetensors, 4 files like HF
shards, published by WeightStore) through `WeightService` on its own gRPC server; N worker
processes (`--worker`) each run a `WeightFetcher` (with its peer server) on loopback and fetch
the version into their own folder. Every fetch checks each chunk's sha256 against the trainer's
chunk list and, at the end, every file against the manifest's sha256 before the folder appears.

Link model: loopback is not a network, so every process's uplink is limited to R bytes/s by its
sender (`buffer.weights_upload_mb_s`: replies reserve 256 KiB slots on one clock per server, so
concurrent replies share R); downlinks are unlimited. The byte floor of the trainer's link for
one copy is model bytes / R; the result is time / floor, from the moment all workers are told to
start to the last verified folder. Fan-out: workers serve each other (`weights_peer_fanout`);
direct: every chunk from the trainer (ratio ~N by construction; run on a smaller model,
`--direct-model-mb`, since N copies through R take N times as long).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from concurrent import futures

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT_DIR)

TOKEN = "bench-token"
FILES = 4  # a ~1 GB model as 4 shards of ~256 MB, as the trainer publishes


def _cfg(port: int, rate_mb_s: float, fanout: bool, chunk_kb: int):
    from buffer.config import BufferConfig

    return BufferConfig(
        transport="grpc",
        grpc_address=f"127.0.0.1:{port}",
        grpc_bind=f"127.0.0.1:{port}",
        weights_chunk_kb=chunk_kb,
        weights_peer_host="127.0.0.1",
        weights_peer_fanout=fanout,
        weights_upload_mb_s=rate_mb_s,
        # 32 workers x 2 requests queue at the trainer's R: one can wait ~64 c/R
        weights_chunk_timeout_s=600.0,
        weights_stall_timeout_s=900.0,
    )


def publish_model(work: str, mb: int) -> tuple[str, int]:
    """A published version of `mb` MB of random safetensors (made once, reused)."""
    from buffer.weights.fs import WeightStore

    root = os.path.join(work, f"trainer_{mb}mb")
    store = WeightStore(root)
    if store.latest() == 1:
        return root, sum(f.bytes for f in store.manifest(1).files)
    src = os.path.join(work, f"src_{mb}mb")
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2"}, f)
    per = (mb << 20) // FILES
    for i in range(FILES):  # one U8 tensor of random bytes per file, written in pieces
        head = json.dumps({f"w{i}": {"dtype": "U8", "shape": [per], "data_offsets": [0, per]}}).encode()
        head += b" " * (-len(head) % 8)
        with open(os.path.join(src, f"model-{i + 1:05d}-of-{FILES:05d}.safetensors"), "wb") as f:
            f.write(len(head).to_bytes(8, "little") + head)
            for _ in range(0, per, 16 << 20):
                f.write(os.urandom(min(16 << 20, per - f.tell() + 8 + len(head))))
    store.publish_hf_folder(src, version=1, step=1, keep=2)
    shutil.rmtree(src)
    return root, sum(f.bytes for f in store.manifest(1).files)


def worker(args) -> None:
    """One simulated worker: READY once its peer server is up, fetch on GO, DONE + stats,
    then keep serving peers until EXIT."""
    import dataclasses

    from buffer.weights.net_client import WeightFetcher

    cfg = _cfg(args.port, args.rate_mb_s, args.fanout, args.chunk_kb)
    f = WeightFetcher(cfg.grpc_address, TOKEN, cfg, args.worker)
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        return
    start = time.monotonic()
    f.fetch(1, args.dest)  # raises unless every chunk and every file verified
    # seconds: the transfer (FetchStats); fetch_s: also the chunk list and the final check of
    # every file against the manifest
    print("DONE", json.dumps({**dataclasses.asdict(f.stats[1]), "fetch_s": time.monotonic() - start}), flush=True)
    sys.stdin.readline()  # EXIT (or EOF)
    f.close()


def one_run(work: str, root: str, nbytes: int, n: int, fanout: bool, args) -> dict:
    """Start a trainer server and n workers, say GO, wait for every DONE."""
    import grpc
    from conftest import free_port

    from buffer.weights.fs import WeightStore
    from buffer.weights.net_server import add_weight_service

    port = free_port()
    cfg = _cfg(port, args.rate_mb_s, fanout, args.chunk_kb)
    cpu0 = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    store = WeightStore(root)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.grpc_server_threads))  # as the trainer's
    service = add_weight_service(server, lambda v: store.layout.version_dir(v), TOKEN, cfg)
    server.add_insecure_port(cfg.grpc_bind)
    server.start()
    service._holding(1)  # the chunk list is hashed before the clock starts (once per version)
    dests = [os.path.join(work, "workers", f"w{i}", "v000001") for i in range(n)]
    shutil.rmtree(os.path.join(work, "workers"), ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": ROOT_DIR, "TANDEM_GRPC_TOKEN": TOKEN}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                f"w{i}",
                "--port",
                str(port),
                "--dest",
                dests[i],
                "--rate-mb-s",
                str(args.rate_mb_s),
                "--chunk-kb",
                str(args.chunk_kb),
            ]
            + ([] if fanout else ["--direct"]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(n)
    ]
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line.startswith("READY"), f"worker did not start: {line!r}"
        start = time.monotonic()
        for p in procs:
            p.stdin.write("GO\n")
            p.stdin.flush()
        results = []
        for p in procs:  # each line comes when that worker's folder is verified
            line = p.stdout.readline()
            assert line.startswith("DONE"), f"worker failed: {line!r} (see its stderr)"
            results.append(json.loads(line.split(" ", 1)[1]))
        seconds = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        server.stop(1).wait(timeout=10)
    cpu = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    trainer_cpu, workers_cpu = (c.ru_utime + c.ru_stime - c0.ru_utime - c0.ru_stime for c, c0 in zip(cpu, cpu0))
    floor = nbytes / (args.rate_mb_s * 1e6)
    shutil.rmtree(os.path.join(work, "workers"), ignore_errors=True)
    return {
        "workers": n,
        "fanout": fanout,
        "model_bytes": nbytes,
        "seconds": round(seconds, 2),
        "floor_s": round(floor, 2),
        "ratio": round(seconds / floor, 3),
        "trainer_chunks_sent": service.stats["chunks"],
        "trainer_copies": round(service.stats["bytes"] / nbytes, 3),
        "chunks_from_peers": sum(r["from_peers"] for r in results),
        "chunks_from_trainer": sum(r["from_trainer"] for r in results),
        "corrupt": sum(r["corrupt"] for r in results),
        "duplicates": sum(r["duplicates"] for r in results),
        "peer_failures": sum(r["peer_failures"] for r in results),
        "busy_refusals": sum(r["busy"] for r in results),
        # each worker's transfer alone, without the final whole-file check
        "slowest_worker_s": round(max(r["seconds"] for r in results), 2),
        "fastest_worker_s": round(min(r["seconds"] for r in results), 2),
        "slowest_fetch_s": round(max(r.get("fetch_s", 0) for r in results), 2),
        "verified_folders": len(results),
        # CPU seconds used (start-up included): well under 2 x seconds = not CPU-bound
        "trainer_cpu_s": round(trainer_cpu, 1),
        "workers_cpu_s": round(workers_cpu, 1),
        "load_avg_1min_at_end": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-mb", type=int, default=1024)
    ap.add_argument("--direct-model-mb", type=int, default=16)
    ap.add_argument("--workers", default="1,8,32")
    ap.add_argument("--modes", default="fanout,direct")
    ap.add_argument("--rate-mb-s", type=float, default=4.0)
    ap.add_argument("--chunk-kb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--work", default="/tmp/weights_fanout")
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="64 MB, 1 and 8 workers")
    # a worker process
    ap.add_argument("--worker")
    ap.add_argument("--port", type=int)
    ap.add_argument("--dest")
    ap.add_argument("--direct", action="store_true")
    args = ap.parse_args()
    if args.worker:
        args.fanout = not args.direct
        return worker(args)
    if args.quick:
        args.model_mb, args.direct_model_mb, args.workers = 64, 8, "1,8"
    sys.path.insert(0, os.path.join(ROOT_DIR, "tests"))
    os.makedirs(args.work, exist_ok=True)
    counts = [int(x) for x in args.workers.split(",")]
    runs = []
    for rep in range(args.repeats):  # alternate sizes and modes so drift hits all alike
        for n in counts:
            for mode in args.modes.split(","):
                mb = args.model_mb if mode == "fanout" else args.direct_model_mb
                root, nbytes = publish_model(args.work, mb)
                r = one_run(args.work, root, nbytes, n, mode == "fanout", args)
                r["repeat"] = rep
                runs.append(r)
                print(json.dumps(r), flush=True)
    summary = {}
    for r in runs:
        summary.setdefault(f"{'fanout' if r['fanout'] else 'direct'}_{r['workers']}", []).append(r["ratio"])
    out = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, shared)",
        "date": time.strftime("%Y-%m-%d"),
        "rate_mb_s": args.rate_mb_s,
        "chunk_kb": args.chunk_kb,
        "load_avg_at_end": os.getloadavg(),
        "runs": runs,
        "ratio_median": {k: statistics.median(v) for k, v in summary.items()},
        "ratio_range": {k: [min(v), max(v)] for k, v in summary.items()},
    }
    print(json.dumps(out["ratio_median"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
