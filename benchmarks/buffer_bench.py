"""The filesystem experience buffer: throughput against raw pyarrow, and 1,000+ concurrent writers.

    python benchmarks/buffer_bench.py --out benchmarks/results/buffer_bench_cpu_<date>.json

1. Throughput. The same samples go, alternately and `--repeats` times each, through
     tandem   ShardWriter.add_group (to_table, IPC encode + sha256 trailer, temp + fsync + rename)
              then ExperienceReader.next_batch (probe, read, trailer + schema + value checks with
              vocab_size, back to Sample objects)
     raw      the same work without the transport: to_table, pyarrow IPC stream written to a file,
              read back, from_table (no checksum, no fsync/rename, no validation, no discovery)
   and, for the record, `raw bytes`: pyarrow alone writing and reading the same pre-built tables
   (no Python objects). The ratio tandem/raw (samples/s over write+read) is the issue's measure.
2. Concurrency. `--writers` threads (one ShardWriter each, its own worker id) publish `--shards`
   small shards each at random times, while one ExperienceReader in another process polls. Every
   shard's publish time (when flush returns, i.e. after rename + directory fsync) and discovery
   time (when discover() first returns it) are recorded with time.time(); the report gives the
   latency percentiles and checks 0 lost / 0 duplicated sample ids. It also times one probing poll
   against one full listing of the folder the run left behind.
3. Scale. `--scale-workers` folders of `--scale-shards` old (consumed) shard names each: the cost
   of one probing poll against one full listing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pyarrow as pa  # noqa: E402

from buffer.config import BufferConfig  # noqa: E402
from buffer.experience.reader import ExperienceReader  # noqa: E402
from buffer.writer import ShardWriter  # noqa: E402
from protocol.experience import Sample, from_table, to_table  # noqa: E402

VOCAB = 151_936


def make_samples(
    worker: str, groups: int, n: int, prompt_len: int, response_len: int, seed: int = 0
) -> list[list[Sample]]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        group = []
        for k in range(n):
            length = rng.randint(response_len // 2, response_len)
            group.append(
                Sample(
                    sample_id=f"{worker}/x/{g}/{k}",
                    group_id=f"{worker}/x/{g}",
                    prompt_id=f"p{g}",
                    worker_id=worker,
                    weight_version=3,
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(VOCAB) for _ in range(length)],
                    behaviour_logprobs=[-rng.random() * 5 for _ in range(length)],
                    reward=float(k % 2),
                    finish_reason="stop",
                    temperature=1.0,
                    data_source="bench",
                    created_at=time.time(),
                    finished_at=time.time(),
                )
            )
        out.append(group)
    return out


def run_tandem(root: str, groups: list[list[Sample]], n: int, shard_samples: int) -> dict:
    cfg = BufferConfig(flush_samples=shard_samples, flush_interval=3600.0, discovery="poll", poll_interval=0.01)
    t0 = time.perf_counter()
    w = ShardWriter.at(root, "bench", cfg)
    for g in groups:
        w.add_group(list(g))
    w.flush()
    t1 = time.perf_counter()
    reader = ExperienceReader(root, cfg, max_staleness=10**6, vocab_size=VOCAB)
    try:
        got = reader.next_batch(len(groups), current_version=3, timeout_s=600)
    finally:
        reader.close()
    t2 = time.perf_counter()
    assert sum(len(x.samples) for x in got) == len(groups) * n
    assert reader.stats["bad_shards"] == 0
    nbytes = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs)
    return {"write_s": t1 - t0, "read_s": t2 - t1, "bytes": nbytes, "shards": w.shards_written}


def _chunks(groups, n, shard_samples):
    per = -(-shard_samples // n)
    return [groups[i : i + per] for i in range(0, len(groups), per)]


def run_raw(root: str, groups: list[list[Sample]], n: int, shard_samples: int) -> dict:
    os.makedirs(root, exist_ok=True)
    t0 = time.perf_counter()
    paths = []
    for i, chunk in enumerate(_chunks(groups, n, shard_samples)):
        table = to_table([s for g in chunk for s in g])
        path = os.path.join(root, f"{i:09d}.arrow")
        with pa.OSFile(path, "wb") as f, pa.ipc.new_stream(f, table.schema) as wr:
            wr.write_table(table)
        paths.append(path)
    t1 = time.perf_counter()
    samples = []
    for path in paths:
        with pa.OSFile(path, "rb") as f:
            samples += from_table(pa.ipc.open_stream(f).read_all())
    t2 = time.perf_counter()
    assert len(samples) == len(groups) * n
    return {"write_s": t1 - t0, "read_s": t2 - t1, "bytes": sum(map(os.path.getsize, paths))}


def run_raw_bytes(root: str, tables: list[pa.Table]) -> dict:
    os.makedirs(root, exist_ok=True)
    t0 = time.perf_counter()
    for i, table in enumerate(tables):
        with pa.OSFile(os.path.join(root, f"{i}.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as wr:
            wr.write_table(table)
    t1 = time.perf_counter()
    rows = 0
    for i in range(len(tables)):
        with pa.OSFile(os.path.join(root, f"{i}.arrow"), "rb") as f:
            rows += pa.ipc.open_stream(f).read_all().num_rows
    t2 = time.perf_counter()
    return {"write_s": t1 - t0, "read_s": t2 - t1}


def throughput(args) -> dict:
    n = args.n
    groups = make_samples("bench", args.groups, n, args.prompt_len, args.response_len)
    samples = len(groups) * n
    tables = [to_table([s for g in c for s in g]) for c in _chunks(groups, n, args.shard_samples)]
    runs = collections.defaultdict(list)
    base = tempfile.mkdtemp(prefix="buffer_bench_", dir=args.tmp)
    try:
        for r in range(args.repeats):
            for kind in ("tandem", "raw", "raw_bytes"):
                d = os.path.join(base, f"{kind}{r}")
                if kind == "tandem":
                    res = run_tandem(d, groups, n, args.shard_samples)
                elif kind == "raw":
                    res = run_raw(d, groups, n, args.shard_samples)
                else:
                    res = run_raw_bytes(d, tables)
                runs[kind].append(res)
                shutil.rmtree(d)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    nbytes = runs["tandem"][0]["bytes"]
    out = {
        "samples": samples,
        "shards": runs["tandem"][0]["shards"],
        "shard_bytes_total": nbytes,
        "tokens_per_sample_mean": sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g) / samples,
    }
    for kind, rs in runs.items():
        w = statistics.median(r["write_s"] for r in rs)
        rd = statistics.median(r["read_s"] for r in rs)
        tot = statistics.median(r["write_s"] + r["read_s"] for r in rs)
        out[kind] = {
            "write_s": w,
            "read_s": rd,
            "total_s": tot,
            "write_samples_per_s": samples / w,
            "read_samples_per_s": samples / rd,
            "samples_per_s": samples / tot,
            "MB_per_s": nbytes / tot / 1e6,
            "write_MB_per_s": nbytes / w / 1e6,
            "read_MB_per_s": nbytes / rd / 1e6,
            "runs": rs,
        }
    out["ratio_tandem_over_raw"] = out["tandem"]["samples_per_s"] / out["raw"]["samples_per_s"]
    out["ratio_write"] = out["raw"]["write_s"] / out["tandem"]["write_s"]
    out["ratio_read"] = out["raw"]["read_s"] / out["tandem"]["read_s"]
    return out


# --- 1,000+ writers against one reader ---------------------------------------------------------


def reader_main(root: str, out: str, expected: int, timeout_s: float, poll: float, discovery: str) -> None:
    cfg = BufferConfig(discovery=discovery, poll_interval=poll, full_scan_interval=60.0)
    reader = ExperienceReader(root, cfg, max_staleness=10**6, vocab_size=VOCAB)
    seen, ids, poll_s = {}, collections.Counter(), []
    deadline = time.monotonic() + timeout_s
    with open(out + ".ready", "w"):
        pass
    while len(seen) < expected and time.monotonic() < deadline:
        t0 = time.perf_counter()
        found = reader.discover()
        poll_s.append(time.perf_counter() - t0)
        now = time.time()
        for key, path in found:
            seen.setdefault(key, now)
            reader._ingest(key, path)
        for g in reader.pool:
            ids.update(s.sample_id for s in g.samples)
        reader.pool.clear()
        if not found:
            reader._wake.wait(poll)
            reader._wake.clear()
    # cost of one probing poll vs one full listing, on the folder as it is now
    t0 = time.perf_counter()
    reader._probe()
    probe = time.perf_counter() - t0
    t0 = time.perf_counter()
    reader._full_scan()
    full = time.perf_counter() - t0
    reader.close()
    with open(out, "w") as f:
        json.dump(
            {
                "seen": seen,
                "ids": ids,
                "stats": dict(reader.stats),
                "poll_s": poll_s,
                "probe_poll_s": probe,
                "full_listing_s": full,
            },
            f,
        )


def concurrency(args, discovery: str) -> dict:
    base = tempfile.mkdtemp(prefix="buffer_sim_", dir=args.tmp)
    root = os.path.join(base, "run")
    out = os.path.join(base, "reader.json")
    expected = args.writers * args.shards
    published: dict[str, float] = {}
    written_ids: list[str] = []
    lock = threading.Lock()
    errors = []
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--reader-proc",
            root,
            out,
            str(expected),
            str(args.sim_timeout),
            str(args.poll),
            discovery,
        ]
    )
    try:
        t_ready = time.monotonic() + 60
        while not os.path.exists(out + ".ready"):
            assert time.monotonic() < t_ready and proc.poll() is None, "reader did not start"
            time.sleep(0.05)
        start = threading.Barrier(args.writers + 1)

        def writer(i: int) -> None:
            try:
                wid = f"w{i:05d}"
                rng = random.Random(i)
                w = ShardWriter.at(root, wid, BufferConfig(flush_samples=1, flush_interval=3600.0))
                groups = make_samples(wid, args.shards, 2, 16, 32, seed=i)
                start.wait(timeout=120)
                for g in groups:
                    time.sleep(rng.uniform(0, 2 * args.spread / args.shards))
                    path = w.add_group(g)
                    t = time.time()
                    with lock:
                        published[f"{wid}/{w.seq - 1}"] = t
                        written_ids.extend(s.sample_id for s in g)
                    assert path is not None
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(args.writers)]
        for t in threads:
            t.start()
        start.wait(timeout=120)
        t_start = time.time()
        for t in threads:
            t.join(timeout=args.sim_timeout)
        t_written = time.time()
        proc.wait(timeout=args.sim_timeout + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    with open(out) as f:
        r = json.load(f)
    shutil.rmtree(base, ignore_errors=True)
    lat = sorted(r["seen"][k] - published[k] for k in published if k in r["seen"])
    ids = collections.Counter(r["ids"])
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1000  # noqa: E731
    return {
        "discovery": discovery,
        "poll_interval_s": args.poll,
        "writers": args.writers,
        "shards_per_writer": args.shards,
        "writer_errors": errors[:5],
        "publish_window_s": t_written - t_start,
        "published_shards": len(published),
        "discovered_shards": len(r["seen"]),
        "published_samples": len(written_ids),
        "lost_samples": len(set(written_ids) - set(ids)),
        "duplicated_samples": sum(1 for c in ids.values() if c > 1),
        "unexpected_samples": len(set(ids) - set(written_ids)),
        "latency_ms": {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "max": lat[-1] * 1000, "min": lat[0] * 1000},
        "reader_poll_ms_mean": 1000 * statistics.mean(r["poll_s"]),
        "reader_polls": len(r["poll_s"]),
        "reader_stats": r["stats"],
        "one_probe_poll_ms": r["probe_poll_s"] * 1000,
        "one_full_listing_ms": r["full_listing_s"] * 1000,
    }


def scale(args) -> dict:
    """One poll's cost when the folder holds many old shards: probing vs a full listing."""
    base = tempfile.mkdtemp(prefix="buffer_scale_", dir=args.tmp)
    try:
        root = os.path.join(base, "run")
        keys = set()
        for w in range(args.scale_workers):
            d = os.path.join(root, "experience", f"w{w:05d}")
            os.makedirs(d)
            for seq in range(args.scale_shards):
                open(os.path.join(d, f"{seq:09d}.arrow"), "wb").close()
                keys.add(f"w{w:05d}/{seq}")
        reader = ExperienceReader(root, BufferConfig(discovery="poll"), 0, consumed=keys)
        t0 = time.perf_counter()
        reader.discover()  # the first poll is a full listing
        first = time.perf_counter() - t0
        probes = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert reader.discover() == []
            probes.append(time.perf_counter() - t0)
        fulls = []
        for _ in range(3):
            t0 = time.perf_counter()
            reader._full_scan()
            fulls.append(time.perf_counter() - t0)
        reader.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "workers": args.scale_workers,
        "shards": args.scale_workers * args.scale_shards,
        "first_poll_ms": first * 1000,
        "probe_poll_ms": 1000 * statistics.median(probes),
        "full_listing_ms": 1000 * statistics.median(fulls),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--reader-proc":
        a = sys.argv[2:]
        reader_main(a[0], a[1], int(a[2]), float(a[3]), float(a[4]), a[5])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tmp", default=None, help="folder for the run folders (default: $TMPDIR)")
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--response-len", type=int, default=1024)
    ap.add_argument("--shard-samples", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--writers", type=int, default=1000)
    ap.add_argument("--shards", type=int, default=3, help="shards per simulated writer")
    ap.add_argument(
        "--spread", type=float, default=15.0, help="seconds over which each writer spreads its shards (on average)"
    )
    ap.add_argument("--poll", type=float, default=0.1)
    ap.add_argument("--discovery", default="poll,auto")
    ap.add_argument("--sim-timeout", type=float, default=300.0)
    ap.add_argument("--scale-workers", type=int, default=200)
    ap.add_argument("--scale-shards", type=int, default=500, help="old shards per worker")
    ap.add_argument("--skip", default="", help="any of 'throughput', 'concurrency', 'scale'")
    args = ap.parse_args()
    res = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
    }
    if "throughput" not in args.skip:
        res["throughput"] = throughput(args)
        t = res["throughput"]
        print(
            f"throughput: tandem {t['tandem']['samples_per_s']:.0f} samples/s "
            f"{t['tandem']['MB_per_s']:.1f} MB/s, raw {t['raw']['samples_per_s']:.0f} "
            f"samples/s {t['raw']['MB_per_s']:.1f} MB/s, ratio {t['ratio_tandem_over_raw']:.2f}; "
            f"raw bytes {t['raw_bytes']['MB_per_s']:.0f} MB/s",
            flush=True,
        )
    if "concurrency" not in args.skip:
        res["concurrency"] = []
        for mode in args.discovery.split(","):
            c = concurrency(args, mode)
            res["concurrency"].append(c)
            print(
                f"concurrency ({mode}): {c['writers']} writers, {c['published_shards']} shards, "
                f"p50 {c['latency_ms']['p50']:.0f} ms p99 {c['latency_ms']['p99']:.0f} ms, "
                f"lost {c['lost_samples']} duplicated {c['duplicated_samples']}",
                flush=True,
            )
    if "scale" not in args.skip:
        res["scale"] = sc = scale(args)
        print(
            f"scale: {sc['shards']} old shards in {sc['workers']} worker folders: probing poll "
            f"{sc['probe_poll_ms']:.1f} ms, full listing {sc['full_listing_ms']:.0f} ms",
            flush=True,
        )
    text = json.dumps(res, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
