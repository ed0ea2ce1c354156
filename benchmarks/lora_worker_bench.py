"""Rollout worker throughput with an adapter-only (LoRA) version against full weights, and the
seconds of an adapter reload (issue 27).

    python -m benchmarks.lora_worker_bench --work W --prep                 # CPU: model, adapters
    python -m benchmarks.lora_worker_bench --work W --stage full --out S.json   # one GPU each
    python -m benchmarks.lora_worker_bench --work W --stage r16 --out S.json
    python -m benchmarks.lora_worker_bench --table OUT                     # OUT/stage-*.json -> table
    bash benchmarks/lora_worker_bench.sh OUT [--cpu]                       # all of it

The model is Qwen2.5-0.5B- or 1.5B-shaped (`--prep --shape`), random init, bf16
(benchmarks/rollout_bench.py's, built on the CPU). A stage is one process running a
`RolloutWorker` with the product's defaults on vLLM's default engine (multiprocess, CUDA graphs,
torch.compile): `full` on full-weight versions (no LoRA in the engine), `r16`/`r64` on adapter-
only versions of rank 16/64 (all linear layers, as trainer/lora.py's 'all-linear'; vLLM's
max_lora_rank derived from the rank). Each stage starts the worker on v0 (timed), runs one warm-
up batch, then `--batches` timed ones (generate + score + shard: tokens / generating seconds, as
the heartbeat's tokens_per_s), then publishes `--reloads` new versions one at a time and times
each in-place load (`maybe_reload`: checksums, then the engine's load; for an adapter: add under
a new id, remove the old). `--cpu` runs the same on the CPU's hf engine with a tiny model: the
wiring check, not a measurement.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))  # lora_helpers: adapters as the trainer publishes them

STAGES = {"full": 0, "r16": 16, "r64": 64}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)
CPU_SIZES = dict(prompts=4, n=2, max_tokens=8, batches=2, reloads=2)  # --cpu: the wiring, in seconds


def prep(args) -> None:
    """The base (HF folder), the prompts, and per rank `reloads + 1` random adapters (saved in
    PEFT's layout): CPU only, before any engine starts."""
    import torch

    from benchmarks.rollout_bench import QWEN25_05B, QWEN25_15B, build_model
    from rollout import builtin_task

    t0 = time.monotonic()
    dims = {"0.5b": QWEN25_05B, "1.5b": QWEN25_15B}[args.shape]
    build_model(f"{args.work}/base", dict(dims, **TINY) if args.cpu else dims)
    with open(f"{args.work}/shape", "w") as f:  # the stages' rows name it
        f.write("tiny" if args.cpu else args.shape)
    builtin_task.write_parquet(f"{args.work}/train.parquet", builtin_task.make_rows(args.prompts, 24))
    torch.set_num_threads(os.cpu_count() or 1)
    for rank in (16, 64):
        peft_model = None
        for v in range(args.reloads + 1):
            peft_model = random_adapter(f"{args.work}/base", f"{args.work}/r{rank}/a{v}", rank, v, peft_model)
    print(f"prep: {time.monotonic() - t0:.1f} s", flush=True)


def random_adapter(base_dir: str, out: str, rank: int, seed: int, peft_model=None):
    """A rank-`rank` adapter on every linear layer with random A and B (B small: the policy
    stays near the base, so response lengths stay alike), saved by PEFT; the PEFT model is
    reused for the next seed (building it on a 0.5B base takes seconds)."""
    import torch

    if peft_model is None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
        peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.01 if ".lora_B." in name else 1 / rank**0.5))
    peft_model.save_pretrained(out)
    return peft_model


def stage(args) -> dict:
    from lora_helpers import publish_adapter

    from benchmarks.rollout_bench import publish_like_trainer
    from buffer.weights.fs import WeightStore
    from protocol.config import build
    from rollout.config import WorkerConfig
    from rollout.worker import RolloutWorker

    rank = STAGES[args.stage]
    base, root = f"{args.work}/base", f"{args.work}/run-{args.stage}"
    shutil.rmtree(root, ignore_errors=True)  # a stage killed at its limit left its versions: start afresh
    store = WeightStore(root)

    def publish(v: int) -> None:
        if rank:
            publish_adapter(store, f"{args.work}/r{rank}/a{v}", base, v, keep=3)
        elif args.cpu:  # the hf engine wants an HF folder's file names
            store.publish_hf_folder(base, v, v, keep=3)
        else:  # 256 MiB files as trainer/publish.py writes them (vLLM reads any *.safetensors)
            publish_like_trainer(store, base, v)

    publish(0)
    cfg = build(
        WorkerConfig,
        {
            "root": root,
            "data.train_files": f"[{args.work}/train.parquet]",
            "worker.id": "bench",
            "data.shuffle": "false",
            "data.max_response_length": str(args.max_tokens),
            "actor_rollout_ref.model.path": base,
            "actor_rollout_ref.rollout.name": "hf" if args.cpu else "vllm",
            "actor_rollout_ref.rollout.n": str(args.n),
            "actor_rollout_ref.rollout.prompts_per_batch": str(args.prompts),
            "buffer.flush_samples": "100000",
            "buffer.max_backlog_samples": "100000000",
        },
    )
    t0 = time.monotonic()
    worker = RolloutWorker(cfg)
    worker.start()
    started_s = time.monotonic() - t0
    worker.run_batch()  # warm-up
    rates, tokens = [], []
    for b in range(args.batches):
        tok0, gen0 = worker.tokens, worker.gen_seconds
        worker.run_batch()
        rates.append((worker.tokens - tok0) / (worker.gen_seconds - gen0))
        tokens.append(worker.tokens - tok0)
        print(f"{args.stage} batch {b + 1}/{args.batches}: {rates[-1]:,.0f} tok/s ({tokens[-1]} tokens)", flush=True)
    reloads = []
    for v in range(1, args.reloads + 1):
        publish(v)
        t0 = time.monotonic()
        assert worker.maybe_reload() and worker.version == v, f"v{v} did not load"
        reloads.append({"seconds": time.monotonic() - t0, "bytes": store.version_bytes(v)})
        print(f"{args.stage} reload v{v}: {reloads[-1]}", flush=True)
    rates.append(_after_reload_rate(worker))
    worker.writer.close()
    worker.engine.close()
    with open(f"{args.work}/shape") as f:
        shape = f.read()
    return {
        "stage": args.stage,
        "shape": shape,
        "lora_rank": rank,
        "startup_s": started_s,
        "tok_s": spread(rates[:-1]),
        "tok_s_after_reloads": rates[-1],
        "tokens_per_batch": spread(tokens),
        "reload_s": spread([r["seconds"] for r in reloads]),
        "reload_bytes": reloads[-1]["bytes"] if reloads else None,
        "reloads": reloads,
    }


def _after_reload_rate(worker) -> float:
    """One batch on the last version loaded: generating is as fast after reloads."""
    tok0, gen0 = worker.tokens, worker.gen_seconds
    worker.run_batch()
    return (worker.tokens - tok0) / (worker.gen_seconds - gen0)


def spread(xs: list[float]) -> dict | None:
    if not xs:
        return None
    s = sorted(xs)
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "all": xs}


def table(out: str) -> str:
    """OUT/stage-*.json as a markdown table (a missing stage is named), also in OUT/table.md
    and OUT/lora_worker.json."""
    rows = {}
    for path in sorted(glob.glob(os.path.join(out, "stage-*.json"))):
        with open(path) as f:
            row = json.load(f)
        rows[row["stage"]] = row
    full = (rows.get("full") or {}).get("tok_s") or {}
    shapes = sorted({r.get("shape", "0.5b") for r in rows.values()})
    lines = [
        f"shape: {', '.join(shapes) or '-'}",
        "",
        "| stage | start s | tok/s (median) | vs full | tok/s after reloads | reload s (median, max) | MB/reload |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in STAGES:
        r = rows.get(name)
        if r is None:
            lines.append(f"| {name} | missing (see stage-{name}.log) | | | | | |")
            continue
        ratio = r["tok_s"]["median"] / full["median"] if full else None
        rel = r["reload_s"] or {}
        mb = "-" if r["reload_bytes"] is None else f"{r['reload_bytes'] / 1e6:,.1f}"
        lines.append(
            f"| {name} | {r['startup_s']:.0f} | {r['tok_s']['median']:,.0f} | "
            f"{'-' if ratio is None else f'{ratio:.3f}'} | {r['tok_s_after_reloads']:,.0f} | "
            f"{rel.get('median', float('nan')):.3f}, {rel.get('max', float('nan')):.3f} | {mb} |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "lora_worker.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "stages": rows}, f, indent=1)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/lora_worker_bench")
    ap.add_argument("--prep", action="store_true", help="build the base, prompts and adapters (CPU)")
    ap.add_argument("--stage", choices=sorted(STAGES), help="one measured worker")
    ap.add_argument("--table", metavar="OUT", help="summarise OUT/stage-*.json")
    ap.add_argument("--out", help="the stage's JSON")
    ap.add_argument("--cpu", action="store_true", help="tiny model, hf engine: the wiring check")
    ap.add_argument("--shape", choices=("0.5b", "1.5b"), default="0.5b", help="--prep: the base's Qwen2.5 shape")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--reloads", type=int, default=3)
    args = ap.parse_args()
    if args.cpu:
        vars(args).update(CPU_SIZES)
    if args.table:
        print(table(args.table), end="")
        return 0
    if args.prep:
        shutil.rmtree(args.work, ignore_errors=True)
        os.makedirs(args.work)
        prep(args)
        return 0
    if not args.stage or not args.out:
        ap.error("--stage and --out (or --prep, or --table)")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    result = stage(args)
    if not args.cpu:
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
    result.update(date=time.strftime("%Y-%m-%d"), prompts=args.prompts, n=args.n, max_tokens=args.max_tokens)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
