"""Trainer throughput, MFU and weight-publish speed on GPUs.

    torchrun --nproc_per_node N benchmarks/trainer_bench.py --out results.json
    python benchmarks/trainer_bench.py --mix --shape 0.5b --out mix.json   # issue 25's length mix

With --mix: benchmarks/trainer_mix.py (a realistic length mix, 0.5B/1.5B/4B shapes, packed
against today's padded path in one process; benchmarks/trainer25.sh runs the acceptance table).
Without: equal-length rows, as issue 4 measured.

Qwen2.5-0.5B shape (random init, built locally), FSDP2 with bf16 compute and fp32 reduction,
the real `Trainer.train_step` (pi_old forward, verl GRPO advantage and PPO loss, backward,
AdamW) on synthetic groups, and the real `publish_version`. MFU counts 8·N FLOPs per token
(forward+backward = 6N, plus the pi_old forward = 2N) plus attention, against the dense bf16
peak of the GPU. Publish time is set against writing and fsyncing the same bytes to the same disk.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def published_equals_model(trainer, version: int, rank: int) -> bool | None:
    """Collective. On rank 0: does the published version hold exactly the model's weights (cast
    to the publish dtype)? Checks the whole publish path, device-to-host copies included."""
    import torch

    published = dict(trainer.store.tensors(version)) if rank == 0 else {}
    ok = True
    for name, tensor in trainer.model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if rank == 0 and name in published:
            ok &= torch.equal(published[name], full.detach().to(published[name].dtype).cpu())
    return ok and bool(published) if rank == 0 else None


def main() -> int:
    if "--mix" in sys.argv:
        from benchmarks.trainer_mix import main as mix

        return mix([a for a in sys.argv[1:] if a != "--mix"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/trainer_bench")
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples-per-rank", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=768)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from benchmarks.rollout_bench import QWEN25_05B, build_model
    from protocol.config import build
    from protocol.experience import Sample
    from trainer.config import TrainerConfig
    from trainer.main import Trainer, init_distributed

    rank = int(os.environ.get("RANK", "0"))
    model_dir = f"{args.work}/model"
    if rank == 0 and not os.path.exists(model_dir):
        build_model(model_dir)
    cfg = build(
        TrainerConfig,
        {
            "root": f"{args.work}/run-{os.environ.get('WORLD_SIZE', '1')}-{time.time_ns()}",
            "actor_rollout_ref.model.path": model_dir,
            "trainer.resume_mode": "disable",
            # groups of 8 per rank (see share()): one mini-batch of all of them per step
            "data.train_batch_size": str(-(-args.samples_per_rank // 8) * int(os.environ.get("WORLD_SIZE", "1"))),
            "actor_rollout_ref.actor.optim.lr": "1e-6",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": str(args.micro),
            "trainer.publish_dtype": "bfloat16",
        },
    )
    device = init_distributed(args.device, 1800)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cfg.root = [cfg.root]
    dist.broadcast_object_list(cfg.root, src=0)
    cfg.root = cfg.root[0]
    while not os.path.exists(os.path.join(model_dir, "config.json")):
        time.sleep(1)
    dist.barrier()
    trainer = Trainer(cfg, device)
    world = dist.get_world_size()
    rng = random.Random(rank)
    vocab = QWEN25_05B["vocab_size"]

    def share():
        samples = []
        for i in range(args.samples_per_rank):
            g = f"r{rank}-{i // 8}"
            samples.append(
                Sample(
                    f"{g}/{i}",
                    g,
                    "p",
                    "w",
                    0,
                    [rng.randrange(vocab) for _ in range(args.prompt)],
                    [rng.randrange(vocab) for _ in range(args.response)],
                    [-5.0] * args.response,
                    float(i % 2),
                    "length",
                    1.0,
                    "x",
                    0.0,
                    0.0,
                )
            )
        return samples

    times = []
    for step in range(args.steps):
        trainer.step = step + 1
        samples = share()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step(samples)
        sync()
        times.append(time.perf_counter() - t0)
    step_s = sum(times[2:]) / len(times[2:])  # after warm-up
    tokens = args.samples_per_rank * world * (args.prompt + args.response)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    seq = args.prompt + args.response
    L, H = QWEN25_05B["num_hidden_layers"], QWEN25_05B["hidden_size"]
    flops_per_token = 8 * n_params + 4 * 2 * L * H * seq  # attention scores+values, fwd x (1 + 2 + 1)
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), 989e12)
    mfu = tokens * flops_per_token / step_s / (peak * world)

    trainer.version = 1
    pub = trainer.publish(step=args.steps)
    trainer.version = 2
    pub2 = trainer.publish(step=args.steps)  # the steady state: files and page cache warm
    matches = published_equals_model(trainer, version=2, rank=rank)
    raw_s = None
    if rank == 0:
        blob = os.urandom(pub["weights/bytes"])
        path = os.path.join(args.work, "raw_write.bin")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        raw_s = time.perf_counter() - t0
        os.remove(path)
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "gpu": gpu,
            "gpus": world,
            "model": "Qwen2.5-0.5B shape, bf16 compute, fp32 master/reduce",
            "params": n_params,
            "tokens_per_step": tokens,
            "step_s": step_s,
            "step_times": times,
            "tokens_per_s": tokens / step_s,
            "tokens_per_s_per_gpu": tokens / step_s / world,
            "mfu": mfu,
            "publish_s": pub["weights/publish_s"],
            "publish_bytes": pub["weights/bytes"],
            "publish_gather_s": pub["weights/gather_s"],
            "publish_write_wait_s": pub["weights/write_wait_s"],
            "publish_second_s": pub2["weights/publish_s"],
            "publish_equals_model": matches,
            "raw_write_s": raw_s,
            "publish_over_raw_write": pub["weights/publish_s"] / raw_s,
        }
        print(json.dumps(result, indent=1))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    trainer.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
