"""SFT throughput and MFU on GPUs.

    torchrun --standalone --nproc_per_node 1 benchmarks/sft_bench.py --out results.json
    torchrun --standalone --nproc_per_node 1 benchmarks/sft_bench.py --tiny --device cpu --out x.json

Qwen2.5-0.5B shape (random init, built locally, as trainer_bench.py), the real
`SFTTrainer.train_step`: sequences balanced over ranks by tokens, packed into token-budget
micro-batches without padding, bf16 compute with fp32 master weights and reduction, loss on
response tokens at those positions only, AdamW. Data: synthetic token ids with a realistic
length mix, the same on every rank and run (seeded): prompt ~ lognormal(median 200, sigma 0.7),
response ~ lognormal(median 400, sigma 0.9), clipped to data.max_length 4096 — mean ~800 tokens,
a long tail of chain-of-thought answers as in MetaMathQA / OpenHermes-style SFT sets.

FLOP conventions: `mfu_6n` counts 6·N per token alone (the usual one). `mfu` (trainer_bench.py's, minus
its pi_old forward): per token 6·N (forward +
backward; N = all parameters, tied embeddings counted once) plus causal attention 6·L·H·s for a
token of a sequence of length s (2·L·H·s per forward, x3 for forward + backward). Only real tokens
count; MFU is against the dense bf16 peak of the GPU. With sdpa, a packed micro-batch's attention
runs over its whole block-diagonal mask, so the kernels do more attention work than counted here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Length mix (medians in tokens, lognormal sigmas) and shape per mode.
MIX = {
    "full": dict(prompt=200, prompt_sigma=0.7, response=400, response_sigma=0.9, max_length=4096),
    "tiny": dict(prompt=8, prompt_sigma=0.5, response=16, response_sigma=0.7, max_length=64),
}


def synthetic(n: int, vocab: int, mix: dict, seed: int = 0):
    """`n` sequences of random token ids: prompt then response (the loss tokens)."""
    import numpy as np

    from trainer.sft_data import Sequences

    rng = np.random.default_rng(seed)
    prompts = np.maximum(rng.lognormal(np.log(mix["prompt"]), mix["prompt_sigma"], n).astype(int), 2)
    responses = np.maximum(rng.lognormal(np.log(mix["response"]), mix["response_sigma"], n).astype(int), 2)
    seqs = Sequences([], [])
    for p, r in zip(prompts, responses):
        p = min(p, mix["max_length"] // 2)
        total = min(p + r, mix["max_length"])
        target = np.zeros(total, dtype=bool)
        target[p:] = True
        seqs.ids.append(rng.integers(3, vocab, total))
        seqs.target.append(target)
    return seqs


def step_flops(lengths: list[int], n_params: int, layers: int, hidden: int) -> float:
    return float(sum(s * (6 * n_params + 6 * layers * hidden * s) for s in lengths))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/sft_bench")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=128, help="sequences per step, all ranks (default 128)")
    ap.add_argument(
        "--budget",
        type=int,
        default=8192,
        help="data.max_token_len_per_gpu: tokens per micro-batch per rank (default 8192, the config's default)",
    )
    ap.add_argument("--steps", type=int, default=10, help="steps; the first 2 are warm-up")
    ap.add_argument(
        "--attn", default="auto", help="model.attn_implementation (auto: flash_attention_2 if installed, else sdpa)"
    )
    ap.add_argument(
        "--shape",
        default="0.5b",
        choices=("0.5b", "1.5b"),
        help="Qwen2.5 shape of the random-init model (default 0.5b)",
    )
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing on")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="the built-in tiny model and short sequences: smoke-tests this script on CPU",
    )
    ap.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be at least 3 (2 warm-up steps)")

    import torch
    import torch.distributed as dist

    from benchmarks.rollout_bench import QWEN25_05B, QWEN25_15B, build_model
    from benchmarks.trainer_bench import PEAK_BF16
    from protocol.config import build
    from rollout import builtin_task
    from trainer.main import init_distributed
    from trainer.sft import SFTTrainer
    from trainer.sft_config import SFTConfig

    mix = MIX["tiny" if args.tiny else "full"]
    if args.tiny:
        args.budget = min(args.budget, 256)
        args.batch = min(args.batch, 16)
    rank = int(os.environ.get("RANK", "0"))
    shape_name = "tiny" if args.tiny else f"qwen25-{args.shape.replace('.', '')}"
    model_dir = f"{args.work}/model-{shape_name}"
    if rank == 0 and not os.path.exists(model_dir):
        dims = {"0.5b": QWEN25_05B, "1.5b": QWEN25_15B}[args.shape]
        builtin_task.write_model(model_dir) if args.tiny else build_model(model_dir, dims)
    device = init_distributed(args.device, 1800)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out_dir = [f"{args.work}/run-{time.time_ns()}"]
    dist.broadcast_object_list(out_dir, src=0)
    while not os.path.exists(os.path.join(model_dir, "config.json")):
        time.sleep(1)
    dist.barrier()
    cfg = build(
        SFTConfig,
        {
            "data.train_files": "[synthetic]",
            "model.partial_pretrain": model_dir,
            "trainer.default_local_dir": out_dir[0],
            "trainer.resume_mode": "disable",
            "data.train_batch_size": str(args.batch),
            "data.max_token_len_per_gpu": str(args.budget),
            "data.max_length": str(mix["max_length"]),
            "model.attn_implementation": args.attn,
            "model.enable_gradient_checkpointing": str(args.grad_ckpt),
            "optim.lr": "1e-5",
            "trainer.total_training_steps": str(args.steps),
        },
    )
    from transformers import AutoConfig

    shape = AutoConfig.from_pretrained(model_dir)
    seqs = synthetic(args.batch * args.steps, shape.vocab_size, mix)
    lengths = seqs.lengths
    trainer = SFTTrainer(cfg, device, seqs, None)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    layers, hidden = shape.num_hidden_layers, shape.hidden_size

    times, flops, flops_6n, tokens, loss_tokens, fills, mbs = [], [], [], [], [], [], []
    for step in range(1, args.steps + 1):
        indices = trainer.batch(step)
        plan = [mb for mb in trainer.plan(indices, "train") if mb]  # this rank's micro-batches
        mbs.append(len(plan))
        fills.append(sum(lengths[i] for mb in plan for i in mb) / (max(1, len(plan)) * args.budget))
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        m = trainer.train_step(step)
        sync()
        times.append(time.perf_counter() - t0)
        tokens.append(m["tokens/step"])
        loss_tokens.append(m["tokens/loss"])
        flops.append(step_flops([lengths[i] for i in indices], n_params, layers, hidden))
        flops_6n.append(6.0 * n_params * sum(lengths[i] for i in indices))
    world = dist.get_world_size()
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), 989e12)
    measured = slice(2, None)  # after warm-up
    step_s = sum(times[measured]) / len(times[measured])
    if rank == 0:
        lengths = sorted(lengths)
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "gpu": gpu,
            "gpus": world,
            "model": ("tiny built-in Qwen2" if args.tiny else f"Qwen2.5-{args.shape.upper()} shape")
            + (", bf16 compute, fp32 master/reduce" if device.type == "cuda" else ", fp32"),
            "params": n_params,
            "attn_implementation": trainer.model.config._attn_implementation,
            "gradient_checkpointing": args.grad_ckpt,
            "batch_seqs": args.batch,
            "budget_tokens_per_micro_batch": args.budget,
            "length_mix": {
                **mix,
                "mean": sum(lengths) / len(lengths),
                "p50": lengths[len(lengths) // 2],
                "p90": lengths[int(len(lengths) * 0.9)],
                "max": lengths[-1],
            },
            "tokens_per_step": sum(tokens[measured]) / len(tokens[measured]),
            "loss_tokens_per_step": sum(loss_tokens[measured]) / len(loss_tokens[measured]),
            "micro_batches_per_rank": sum(mbs[measured]) / len(mbs[measured]),
            "budget_fill": sum(fills[measured]) / len(fills[measured]),
            "step_s": step_s,
            "step_times": times,
            "tokens_per_s": sum(tokens[measured]) / sum(times[measured]),
            "tokens_per_s_per_gpu": sum(tokens[measured]) / sum(times[measured]) / world,
            "mfu": sum(flops[measured]) / sum(times[measured]) / (peak * world),
            "mfu_6n": sum(flops_6n[measured]) / sum(times[measured]) / (peak * world),
            "flop_convention": "mfu: 6N per token + causal attention 6*L*H*s per token of a length-s "
            "sequence; mfu_6n: 6N per token alone (the usual convention); real "
            f"tokens only; peak {peak:.3g} FLOP/s per device",
        }
        print(json.dumps(result, indent=1))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    trainer.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
