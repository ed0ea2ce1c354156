"""LoRA against full fine-tuning on one GPU (issue 27): bytes per weight version, publish
seconds, trainer tokens/s and peak memory.

    bash benchmarks/lora_bench.sh OUT                 # H200: 0.5B and 1.5B shapes, full / r16 / r64
    torchrun --standalone --nproc_per_node 1 benchmarks/lora_bench.py --tiny --device cpu --out x.json

Random-init Qwen2.5-0.5B / 1.5B shapes built locally from a config (benchmarks/rollout_bench.py's
build_model: no hub). For each shape and each of full fine-tuning, LoRA rank 16 and rank 64
(all-linear, alpha = 2 x rank): the real trainer paths, in one process, one after the other —
`SFTTrainer.train_step` (packed token-budget micro-batches, bf16 compute, fp32 master weights,
AdamW on what trains: every weight, or the adapters alone) on a synthetic length mix
(sft_bench.py's, shorter), then the version a trainer step publishes: `publish_version` (full
weights, bf16) or `publish_adapter` (the adapter alone, bf16, PEFT layout) into a fresh run
folder, timed and sized from its manifest. Peak memory is torch's max_memory_allocated over the
training steps of that configuration (the counter reset between configurations).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIX = {
    "full": dict(prompt=200, prompt_sigma=0.7, response=400, response_sigma=0.9, max_length=2048),
    "tiny": dict(prompt=8, prompt_sigma=0.5, response=16, response_sigma=0.7, max_length=64),
}


def one(shape_name: str, model_dir: str, rank_: int, args, device, mix: dict) -> dict:
    """Train `args.steps` steps and publish two versions with LoRA rank `rank_` (0: full)."""
    import torch
    import torch.distributed as dist

    from benchmarks.sft_bench import synthetic
    from protocol.config import build
    from protocol.weights import base_checksum
    from trainer.publish import publish_adapter, publish_version
    from trainer.sft import SFTTrainer
    from trainer.sft_config import SFTConfig

    out_dir = f"{args.work}/run-{shape_name}-r{rank_}-{time.time_ns()}"
    cfg = build(
        SFTConfig,
        {
            "data.train_files": "[synthetic]",
            "model.partial_pretrain": model_dir,
            "trainer.default_local_dir": out_dir,
            "trainer.resume_mode": "disable",
            "data.train_batch_size": str(args.batch),
            "data.max_token_len_per_gpu": str(args.budget),
            "data.max_length": str(mix["max_length"]),
            "model.enable_gradient_checkpointing": "false",
            "model.lora_rank": str(rank_),
            "model.lora_alpha": str(2 * rank_ if rank_ else 16),
            "optim.lr": "1e-5",
            "trainer.total_training_steps": str(args.steps),
        },
    )
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    seqs = synthetic(args.batch * args.steps, vocab, mix)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = SFTTrainer(cfg, device, seqs, None)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    times, tokens = [], []
    for step in range(1, args.steps + 1):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        m = trainer.train_step(step)
        sync()
        times.append(time.perf_counter() - t0)
        tokens.append(m["tokens/step"])
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    base = base_checksum(model_dir) if rank_ else None  # once per trainer start, not per version
    checksum_s = time.perf_counter() - t0
    publishes = []
    for version in (1, 2):  # the first warms up the writer threads and the page cache
        t0 = time.perf_counter()
        if rank_:
            out = publish_adapter(trainer.model, trainer.store, model_dir, version, version, 3, base, dtype)
        else:
            out = publish_version(trainer.model, trainer.store, model_dir, version, version, 3, dtype)
        publishes.append((time.perf_counter() - t0, out["weights/published_bytes"]))
    measured = slice(2, None)
    result = {
        "shape": shape_name,
        "lora_rank": rank_,
        "mode": f"LoRA r{rank_}" if rank_ else "full fine-tuning",
        "params": total,
        "trainable_params": trainable,
        "tokens_per_s": sum(tokens[measured]) / sum(times[measured]),
        "step_s": sum(times[measured]) / len(times[measured]),
        "step_times": times,
        "peak_memory_gib": peak / 2**30,
        "version_bytes": publishes[-1][1],
        "publish_s": publishes[-1][0],
        "publish_s_first": publishes[0][0],
        "base_checksum_s": checksum_s if rank_ else None,
    }
    trainer.close()
    del trainer
    gc.collect()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/lora_bench")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    ap.add_argument("--budget", type=int, default=8192, help="tokens per packed micro-batch (default 8192)")
    ap.add_argument("--steps", type=int, default=5, help="training steps per configuration; the first 2 warm up")
    ap.add_argument("--shapes", default="0.5b,1.5b", help="Qwen2.5 shapes (default 0.5b,1.5b)")
    ap.add_argument("--ranks", default="0,16,64", help="LoRA ranks; 0 is full fine-tuning (default 0,16,64)")
    ap.add_argument("--tiny", action="store_true", help="the built-in tiny model: smoke-tests this script on CPU")
    ap.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be at least 3 (2 warm-up steps)")

    import torch.distributed as dist

    from benchmarks.rollout_bench import QWEN25_05B, QWEN25_15B, build_model
    from rollout import builtin_task
    from trainer.main import init_distributed

    mix = MIX["tiny" if args.tiny else "full"]
    if args.tiny:
        args.budget, args.batch = min(args.budget, 256), min(args.batch, 8)
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    device = init_distributed(args.device, 1800)
    rank0 = dist.get_rank() == 0
    results = []
    for shape in shapes:
        model_dir = f"{args.work}/model-{shape}"
        if rank0 and not os.path.exists(os.path.join(model_dir, "config.json")):
            dims = {"0.5b": QWEN25_05B, "1.5b": QWEN25_15B}.get(shape)
            builtin_task.write_model(model_dir) if args.tiny else build_model(model_dir, dims)
        dist.barrier()
        for r in (int(x) for x in args.ranks.split(",")):
            res = one(shape, model_dir, r, args, device, mix)
            results.append(res)
            if rank0:
                print(
                    f"{shape} {res['mode']}: {res['tokens_per_s']:.0f} tokens/s, peak "
                    f"{res['peak_memory_gib']:.1f} GiB, version {res['version_bytes'] / 2**20:.2f} MiB "
                    f"published in {res['publish_s']:.2f} s",
                    flush=True,
                )
    if rank0:
        import torch

        gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
        summary = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "batch_seqs": args.batch, "mix": mix}
        with open(args.out, "w") as f:
            json.dump({**summary, "results": results}, f, indent=1)
        print(json.dumps({**summary, "results": results}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
