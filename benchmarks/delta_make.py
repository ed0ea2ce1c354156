"""The trainer's side of a delta: `delta.make_delta` on one thread against several, side by side.

    python -m benchmarks.delta_make [--model-mb 1024] [--density 0.02] [--threads 1,4] [--repeats 3]
        [--out benchmarks/results/delta_make.json]

Two full versions of a bf16 model in the trainer's layout (safetensors files of 256 MiB, as
`trainer/publish.py`'s buckets) are published by the WeightStore, the second with a random
`--density` share of the values changed (the 0.5B RL run at lr 1e-6 changed 1.6-2.3 % a step on
one H200: benchmarks/README.md, issue 26). `make_delta` then writes the delta of the second
against the first, `--repeats` times per thread count, the counts alternating, each into a fresh
folder; every result's counts are checked to be the same. torch runs on one thread, as in the
trainer (`trainer/main.py`: OMP_NUM_THREADS, default 1), so the files' threads are the
parallelism. On one H200 the trainer's publish of a delta took 1-2 s more than a full one's,
on its critical path (the trainer waits for it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import torch

FILE_MB = 256  # trainer/publish.py's BUCKET_BYTES


def _folder(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """An HF folder of `tensors` in files of FILE_MB (and the index naming them)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2"}, f)
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0  # bytes in the last file
    for key, t in tensors.items():
        if size >= FILE_MB << 20:
            files.append({})
            size = 0
        files[-1][key] = t
        size += t.numel() * t.element_size()
    weight_map = {}
    for i, part in enumerate(files):
        name = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        save_file(part, os.path.join(path, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-mb", type=int, default=1024)
    p.add_argument("--density", type=float, default=0.02)
    p.add_argument("--threads", default="1,4", help="comma-separated thread counts to compare")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--torch-threads", type=int, default=1, help="torch's own threads (default 1: the trainer's, trainer/main.py)"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    from buffer.run import setup_trainer_run
    from buffer.weights import delta

    work = tempfile.mkdtemp(prefix="delta-make-")
    try:
        g = torch.Generator().manual_seed(0)
        tensors = {
            f"model.layers.{i}.w": torch.randn(1024, 2048, generator=g).bfloat16() for i in range(args.model_mb // 4)
        }
        store = setup_trainer_run(os.path.join(work, "run")).publisher
        for v in (0, 1):
            if v:
                for t in tensors.values():
                    hit = torch.rand(t.shape, generator=g) < args.density
                    t[hit] = (t[hit].float() + 0.01).bfloat16()
            _folder(os.path.join(work, f"m{v}"), tensors)
            store.publish_hf_folder(os.path.join(work, f"m{v}"), v, v, 3)
        folders = [store.layout.version_dir(v) for v in (0, 1)]
        manifests = [delta.read_manifest(f) for f in folders]
        counts = [int(c) for c in args.threads.split(",")]
        seconds: dict[int, list[float]] = {c: [] for c in counts}
        changed = set()
        for _ in range(args.repeats):
            for c in counts:
                out = os.path.join(work, "delta")
                shutil.rmtree(out, ignore_errors=True)
                os.makedirs(out)
                t0 = time.perf_counter()
                made = delta.make_delta(folders[1], manifests[1], folders[0], manifests[0], out, threads=c)
                seconds[c].append(time.perf_counter() - t0)
                assert made is not None
                changed.add((made[1].changed, made[1].delta_bytes))
                print(f"{c} thread(s): {seconds[c][-1]:.2f} s", flush=True)
        assert len(changed) == 1, changed  # every thread count wrote the same delta
        ((n, nbytes),) = changed
        result = {
            "host": platform.node(),
            "cpus": len(os.sched_getaffinity(0)),
            "torch_threads": args.torch_threads,
            "model_mb": args.model_mb,
            "files": len(manifests[1].files),
            "density": n / sum(t.numel() for t in tensors.values()),
            "delta_mb": nbytes / 1e6,
            "seconds": seconds,
            "median_s": {c: statistics.median(s) for c, s in seconds.items()},
            "load_avg": os.getloadavg(),
        }
        print(json.dumps(result, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
