"""A reader several delta versions behind: the chain applied in memory against version by version.

    python -m benchmarks.delta_chain [--model-mb 256] [--lag 4] [--density 0.03] [--repeats 3]
        [--out benchmarks/results/delta_chain.json]

The trainer's WeightStore publishes a snapshot v0 and `--lag` deltas (each a random `--density`
share of the bf16 values changed, as an RL step at verl's usual learning rate changes 2-4 %:
benchmarks/README.md, issue 26); a reader on the shared folder that holds only v0 then asks for
the newest. `delta.resolve` rebuilds it either with the deltas between applied in memory (one
folder written and hashed: the default) or version by version (each delta rebuilt into a full
folder, hashed, then the next: the path before). Both results are checked against the trainer's
sha256 by the code under test. The two ways alternate, `--repeats` times each, on the same
published versions; the trainer's own rebuilt copies are removed before each, so both start
from the snapshot alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch


def _model(folder: str, mb: int) -> dict[str, torch.Tensor]:
    """bf16 matrices of 4 MiB each, `mb` MiB in all, and a config.json (the store publishes an
    HF folder)."""
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2"}, f)
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.w": torch.randn(1024, 2048, generator=g).bfloat16() for i in range(mb // 4)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-mb", type=int, default=256)
    p.add_argument("--lag", type=int, default=4, help="delta versions between the reader's and the newest")
    p.add_argument("--density", type=float, default=0.03)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from buffer.run import setup_trainer_run
    from buffer.weights import delta
    from buffer.weights.fs import FsWeightSource

    work = tempfile.mkdtemp(prefix="delta-chain-")
    try:
        tensors = _model(os.path.join(work, "model"), args.model_mb)
        trainer = setup_trainer_run(os.path.join(work, "run"))
        trainer.state.ensure_run_id()
        store = trainer.publisher
        store.publish_full_freq = args.lag + 1
        g = torch.Generator().manual_seed(1)
        for v in range(args.lag + 1):
            for t in tensors.values():
                hit = torch.rand(t.shape, generator=g) < (args.density if v else 0.0)
                t[hit] = (t[hit].float() + 0.01).bfloat16()
            store.publish_hf_folder(os.path.join(work, "model"), v, v, args.lag + 2, tensors=tensors)
        assert [store.manifest(v).base for v in range(args.lag + 1)] == [None, *range(args.lag)]
        reader = FsWeightSource(trainer.fs, trainer.files)
        rebuilt = os.path.join(store.dir, delta.FULL_DIR)
        seconds: dict[str, list[float]] = {"in_memory": [], "version_by_version": []}
        for _ in range(args.repeats):
            for way in seconds:
                shutil.rmtree(rebuilt, ignore_errors=True)
                os.sync()
                t0 = time.perf_counter()
                delta.resolve(args.lag, reader._published, store.dir, verified=set(), in_memory=way == "in_memory")
                seconds[way].append(time.perf_counter() - t0)
                print(f"{way}: {seconds[way][-1]:.2f} s", flush=True)
        result = {
            "model_mb": args.model_mb,
            "lag": args.lag,
            "density": args.density,
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
            "seconds": seconds,
            "median_s": {k: statistics.median(v) for k, v in seconds.items()},
        }
        result["speedup"] = result["median_s"]["version_by_version"] / result["median_s"]["in_memory"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
