"""Trainer throughput on a realistic length mix, packed (issue 25) against today's padded path.

    python -m benchmarks.trainer_mix --shape 0.5b --paths packed,padded --out RES/0.5b.json
    python -m benchmarks.trainer_mix --cpu --out /tmp/mix.json      # wiring check, tiny shape

The real `Trainer.train_step` (pi_old forward, verl GRPO advantage and PPO loss with truncated
IS, backward, AdamW) on one GPU, Qwen2.5 shapes (random init, built here), bf16 compute with fp32
master weights. Each step: groups of 8 samples, prompts uniform in 64-512 tokens, responses
long-tailed (64 + lognormal, median 400, clipped at --max-response), the same samples for every
path. Paths, in one process on the same model:
  packed  use_remove_padding, token-budget micro-batches (--token-budget real tokens, first
          fit), chunked lm_head logprobs, varlen attention;
  padded  today's: micro-batches of --padded-micro rows padded to the longest, full logits;
  packed-every-pass  packed, with FSDP reducing the gradients after every pass, as before
          trainer.update.gradient_sync (one rank: once per optimizer step): its A/B;
  packed-eager-logprob  packed, the logprob blocks' element-wise work eager even with --compile
          (as before it was compiled with trainer.compile_layers): its A/B.
Reported per path: tokens/s (prompt + response tokens trained per second), peak memory, MFU
under 6·N per trained token (the usual convention), and MFU counting every forward (pi_old,
the recompute of activation checkpointing) plus causal attention, against the dense bf16 peak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.rollout_bench import QWEN25_05B, QWEN25_15B  # noqa: E402

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
# Qwen3-4B's dimensions (hidden 2560, 36 layers, 32/8 heads of 128, MLP 9728, tied 151,936
# vocabulary) on the Qwen2 architecture tandem trains (q/k/v biases, no q/k norm): ~4.0 B.
QWEN_4B = dict(
    QWEN25_05B,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)
TINY = dict(
    QWEN25_05B,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
SHAPES = {"tiny": TINY, "0.5b": QWEN25_05B, "1.5b": QWEN25_15B, "4b": QWEN_4B}
GROUP = 8


def build_model(path: str, shape: dict, device: str) -> None:
    """Random-init weights written in bf16 (the trainer loads them in fp32)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollout import builtin_task

    torch.manual_seed(0)
    config = Qwen2Config(**shape, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    config.max_position_embeddings = 1 << 15
    with torch.device(device):  # 4 B parameters initialise in seconds on the GPU, minutes on CPU
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    builtin_task.build_tokenizer().save_pretrained(path)


def length_mix(rng: random.Random, n: int, max_prompt: int, max_response: int, min_len: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompts uniform, responses 64 + lognormal(median 400, sigma 1)
    clipped at the maximum (the long tail that padding pays for)."""
    out = []
    for _ in range(n):
        p = rng.randint(min_len, max_prompt)
        r = min(max_response, min_len + int(rng.lognormvariate(math.log(max(1, max_response // 10)), 1.0)))
        out.append((p, r))
    return out


def make_samples(rng: random.Random, lengths: list[tuple[int, int]], vocab: int, step: int) -> list:
    from protocol.experience import Sample

    out = []
    for i, (p, r) in enumerate(lengths):
        g = f"s{step}-g{i // GROUP}"
        out.append(
            Sample(
                f"{g}/{i}",
                g,
                "p",
                "w",
                0,
                [rng.randrange(2, vocab) for _ in range(p)],
                [rng.randrange(2, vocab) for _ in range(r)],
                [-5.0] * r,
                float(i % 2),
                "length",
                1.0,
                "x",
                0.0,
                0.0,
            )
        )
    return out


def flops(
    shape: dict, n_params: int, lengths: list[tuple[int, int]], ckpt_share: float, pi_old_pass: bool = True
) -> tuple[float, float]:
    """(6·N per trained token; every pass counted: pi_old forward 2N (when a separate pass
    runs), train 6N, recompute 2N x the share of layers checkpointed (`ckpt_share`: 0 without
    activation checkpointing, 1 with every layer), plus causal attention 2·L²·heads·head_dim per
    layer and forward, x3 for forward + backward)."""
    tokens = sum(p + r for p, r in lengths)
    six_n = 6.0 * n_params * tokens
    head_dim = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    attn_fwd = sum(2.0 * (p + r) ** 2 * shape["num_attention_heads"] * head_dim for p, r in lengths)
    attn_fwd *= shape["num_hidden_layers"]
    forwards = int(pi_old_pass) + ckpt_share  # pi_old, the recompute
    every = six_n + forwards * 2.0 * n_params * tokens + (3 + forwards) * attn_fwd
    return six_n, every


def use_path(trainer, path: str, packed_attn: str, pi_old_pass: bool = False) -> None:
    """Switch the trainer between the packed and today's padded path, in place. Today's path
    always ran a separate pi_old pass; the packed one takes pi_old from the update's forward
    (one mini-batch, one epoch here) unless `pi_old_pass`."""
    from trainer import algo

    packed = path.startswith("packed")
    trainer.cfg.actor_rollout_ref.actor.old_log_prob_from_update = packed and not pi_old_pass
    trainer.logprob_compiled = packed and trainer.cfg.trainer.compile_layers and path != "packed-eager-logprob"
    trainer.packed = packed
    trainer.logprob_chunk = algo.LOGPROB_CHUNK_TOKENS if packed else None
    trainer.cfg.actor_rollout_ref.actor.use_dynamic_bsz = packed
    want = packed_attn if packed else "sdpa"
    if trainer.model.config._attn_implementation != want:
        trainer.model.set_attn_implementation(want)


def agreement(trainer, samples, packed_attn: str) -> float:
    """max |pi_old packed - pi_old padded| over one micro-batch's response tokens: the varlen
    kernel keeps rows apart exactly when this is bf16 noise (~1e-2), not O(1)."""
    import torch

    from trainer import algo, update
    from trainer.batch import collate

    batch = collate(samples[:GROUP], trainer.pad_id).to(trainer.device)
    rows = torch.arange(len(batch))
    out = []
    for path in ("packed", "padded"):
        use_path(trainer, path, packed_attn)
        with torch.no_grad():
            lp, _ = algo.response_logprobs(
                trainer.model, update.micro(batch, rows, path == "packed"), chunk=trainer.logprob_chunk
            )
        out.append(lp)
    return float((out[0] - out[1]).abs().max())


def run_path(
    trainer, path, steps_samples, packed_attn, device, profile: str | None = None, pi_old_pass: bool = False
) -> dict:
    """Train every step of `steps_samples` on `path`: step times, the trainer's own phase
    timings (`timing_s/*`, verl's names) per step, peak memory; `profile`: one more step (the
    last batch again, not timed: the profiler slows it) under torch.profiler, its top operators
    by device time written to that file."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    use_path(trainer, path, packed_attn, pi_old_pass)
    with reduce_every_pass(path == "packed-every-pass"):
        return _timed_steps(trainer, path, steps_samples, device, sync, profile)


@contextlib.contextmanager
def reduce_every_pass(on: bool):
    """With `on`: trainer.update.optimize has FSDP reduce after every pass (the trainer before
    gradient_sync), for the A/B in one process on the same compiled model."""
    from trainer import update

    kept = update.gradient_sync
    if on:
        update.gradient_sync = lambda model: lambda reduce: None
    try:
        yield
    finally:
        update.gradient_sync = kept


def _timed_steps(trainer, path, steps_samples, device, sync, profile) -> dict:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times, phases, compiled = [], [], []
    try:
        for step, samples in enumerate(steps_samples):
            trainer.step = step + 1
            sync()
            t0 = time.perf_counter()
            metrics = trainer.train_step(samples)
            sync()
            times.append(time.perf_counter() - t0)
            phases.append({k: round(v, 4) for k, v in metrics.items() if k.startswith("timing_s/")})
            compiled.append(metrics.get("perf/compiled_graphs", 0))  # > 0 after step 1: a recompile
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        if profile:
            trainer.step += 1
            with profiled(profile, device, f"{path}, one step of {len(steps_samples[-1])} samples"):
                trainer.train_step(steps_samples[-1])
                sync()
    except torch.OutOfMemoryError as e:
        return {"path": path, "error": f"out of memory: {str(e)[:200]}", "step_times": times}
    return {
        "path": path,
        "step_times": times,
        "phases": phases,
        "compiled_graphs": compiled,
        "peak_memory_gib": peak / 2**30 if peak else None,
    }


@contextlib.contextmanager
def profiled(out: str | None, device, title: str, rows: int = 40):
    """torch.profiler around the block when `out` is set: the `rows` operators with the most
    self device time (CPU time on CPU), appended to `out` under `title`."""
    if out is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(out, "a") as f:
        f.write(f"== {title}\n{prof.key_averages().table(sort_by=key, row_limit=rows)}\n")


ACCEPT = {"0.5b": "packed/padded >= 2", "1.5b": "MFU 6N >= 35 %", "4b": "MFU 6N >= 40 %"}


def write_table(folder: str) -> str:
    """The acceptance table of every stage's JSON in `folder` (markdown), and all of them in one JSON."""
    import glob

    results = []
    for f in sorted(glob.glob(os.path.join(folder, "stage-*.json"))):
        with open(f) as fh:
            results.append(json.load(fh))
    rows = [
        "| shape | path | tokens/s | peak GiB | MFU 6·N | MFU every pass | packed/padded | acceptance "
        "| recompiled (timed steps) | MFU 6·N without them |"
    ]
    rows.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        for path, p in r["paths"].items():
            every = r.get("checkpoint_every", 1)
            ckpt = (" +ckpt" + (f"/{every}" if every > 1 else "")) if r["grad_ckpt"] else ""
            label = f"{r['shape']}{ckpt}{' +compile' if r.get('compile_layers') else ''}"
            if "error" in p:
                rows.append(f"| {label} | {path} | {p['error'][:60]} | | | | | | | |")
                continue
            peak = f"{p['peak_memory_gib']:.1f}" if p.get("peak_memory_gib") else "-"
            ratio = f"{r['packed_over_padded']:.2f}" if path == "packed" and "packed_over_padded" in r else ""
            accept = ACCEPT.get(r["shape"], "") if path == "packed" else ""
            name = f"{path} +pi_old pass" if path == "packed" and p.get("pi_old_pass") else path
            again = ", ".join(map(str, p.get("recompiled_steps", []))) or ("none" if r.get("compile_layers") else "")
            steady = f"{100 * p['mfu_6n_without_recompiles']:.1f} %" if "mfu_6n_without_recompiles" in p else ""
            rows.append(
                f"| {label} | {name} | {p['tokens_per_s']:,.0f} | {peak} | {100 * p['mfu_6n']:.1f} % | "
                f"{100 * p['mfu_every_pass']:.1f} % | {ratio} | {accept} | {again} | {steady} |"
            )
    notes = [
        f"- {r['shape']}: {r['device']}, {r['params'] / 1e9:.2f} B params, attention {r['packed_attention']}, "
        f"{r['samples_per_step']} samples/step, max response {r['max_response']}, token budget {r['token_budget']}, "
        f"padded micro {r['padded_micro']}, "
        f"pi_old max |packed - padded| {r['pi_old_max_abs_diff_packed_vs_padded']:.3g}"
        + (f", reduce once / every pass {r['once_over_every_pass']:.3f}" if "once_over_every_pass" in r else "")
        + (
            f", logprob blocks compiled / eager {r['compiled_over_eager_logprob']:.3f}"
            if "compiled_over_eager_logprob" in r
            else ""
        )
        for r in results
    ]
    text = "\n".join(rows + [""] + notes) + "\n"
    with open(os.path.join(folder, "table.md"), "w") as f:
        f.write(text)
    with open(os.path.join(folder, "trainer25.json"), "w") as f:
        json.dump(results, f, indent=1)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument(
        "--paths",
        default="packed,padded",
        help="comma-separated: packed, padded, packed-every-pass, packed-eager-logprob (docstring)",
    )
    ap.add_argument("--samples", type=int, default=64, help="samples per step (groups of 8)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per path, after one warm-up step")
    ap.add_argument("--max-response", type=int, default=4096)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--token-budget", type=int, default=32768, help="packed: real tokens per micro-batch")
    ap.add_argument("--padded-micro", type=int, default=8, help="padded: rows per micro-batch")
    ap.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing")
    ap.add_argument("--ckpt-every", type=int, default=1, help="with --grad-ckpt: trainer.checkpoint_every")
    ap.add_argument(
        "--compile", action="store_true", help="trainer.compile_layers=true (the warm-up step pays the compile)"
    )
    ap.add_argument(
        "--pi-old-pass",
        action="store_true",
        help="packed: a separate pi_old pass (old_log_prob_from_update=false), the ablation",
    )
    ap.add_argument("--profile", help="torch.profiler over each path's last step: top operators to this file")
    ap.add_argument("--work", default="/tmp/trainer_mix")
    ap.add_argument("--cpu", action="store_true", help="wiring check on CPU: tiny shape, short rows")
    ap.add_argument("--out", help="the result JSON")
    ap.add_argument("--table", metavar="DIR", help="instead: DIR/*.json to DIR/table.md and DIR/trainer25.json")
    args = ap.parse_args(argv)
    if args.table:
        print(write_table(args.table))
        return 0
    if not args.out:
        ap.error("--out is required")
    if args.cpu:
        args.shape, args.samples, args.steps, args.max_prompt, args.max_response = "tiny", 16, 1, 24, 48
        args.token_budget = 256
    min_len = 8 if args.cpu else 64

    import torch

    from protocol.config import build
    from trainer.config import TrainerConfig
    from trainer.main import Trainer, init_distributed
    from trainer.model import packed_attention

    shape = SHAPES[args.shape]
    device = init_distributed("cpu" if args.cpu else "cuda", 1800)
    model_dir = f"{args.work}/model-{args.shape}"
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        t0 = time.perf_counter()
        build_model(model_dir, shape, device.type)
        print(f"built {model_dir} in {time.perf_counter() - t0:.1f} s", flush=True)
    cfg = build(
        TrainerConfig,
        {
            "root": f"{args.work}/run-{time.time_ns()}",
            "actor_rollout_ref.model.path": model_dir,
            "actor_rollout_ref.model.enable_gradient_checkpointing": str(args.grad_ckpt).lower(),
            "trainer.compile_layers": str(args.compile).lower(),
            "trainer.checkpoint_every": str(args.ckpt_every),
            "trainer.resume_mode": "disable",
            "data.train_batch_size": str(args.samples // GROUP),
            "actor_rollout_ref.actor.optim.lr": "1e-6",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": str(args.padded_micro),
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": str(args.token_budget),
        },
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg, device)  # packed by default (use_remove_padding=true)
    load_s = time.perf_counter() - t0
    packed_attn = packed_attention(device)
    rng = random.Random(0)
    vocab = shape["vocab_size"]
    batches = [
        length_mix(rng, args.samples, args.max_prompt, args.max_response, min_len) for _ in range(args.steps + 1)
    ]
    steps_samples = [make_samples(rng, b, vocab, i) for i, b in enumerate(batches)]
    n_params = sum(p.numel() for p in trainer.model.parameters())
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), 989e12)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": gpu,
        "shape": args.shape,
        "params": n_params,
        "grad_ckpt": args.grad_ckpt,
        "checkpoint_every": args.ckpt_every,
        "compile_layers": args.compile,
        "packed_attention": packed_attn,
        "samples_per_step": args.samples,
        "token_budget": args.token_budget,
        "padded_micro": args.padded_micro,
        "load_s": load_s,
        "max_response": args.max_response,
        "lengths": batches,
        "pi_old_max_abs_diff_packed_vs_padded": agreement(trainer, steps_samples[0], packed_attn),
        "paths": {},
    }
    for path in args.paths.split(","):
        r = run_path(trainer, path, steps_samples, packed_attn, device, args.profile, args.pi_old_pass)
        actor = trainer.cfg.actor_rollout_ref.actor
        if "error" in r and path == "padded" and actor.ppo_micro_batch_size_per_gpu > 1:
            actor.ppo_micro_batch_size_per_gpu //= 2  # today's path at the largest micro-batch that fits
            r = run_path(trainer, path, steps_samples, packed_attn, device) | {"first_try": r["error"]}
        r["micro_rows"] = actor.ppo_micro_batch_size_per_gpu if path == "padded" else None
        timed = r["step_times"][1:]  # step 1: warm-up
        if "error" not in r and timed:
            lengths = [x for b in batches[1 : len(timed) + 1] for x in b]
            separate = path == "padded" or args.pi_old_pass
            layers = shape["num_hidden_layers"]
            share = -(-layers // args.ckpt_every) / layers if args.grad_ckpt else 0.0
            six_n, every = flops(shape, n_params, lengths, share, separate)
            r["pi_old_pass"] = separate
            seconds = sum(timed)
            r |= {
                "tokens": sum(p + q for p, q in lengths),
                "tokens_per_s": sum(p + q for p, q in lengths) / seconds,
                "mfu_6n": six_n / seconds / peak,
                "mfu_every_pass": every / seconds / peak,
            }
            # the same over the timed steps that compiled nothing (a recompile is a compile, as
            # the warm-up step's: both figures are reported, the table names the steps left out)
            fresh = [i for i, n in enumerate(r["compiled_graphs"][1:]) if n]
            if fresh and len(fresh) < len(timed):
                kept = [b for i, b in enumerate(batches[1 : len(timed) + 1]) if i not in fresh]
                six_k, _ = flops(shape, n_params, [x for b in kept for x in b], share, separate)
                r["recompiled_steps"] = [i + 1 for i in fresh]
                r["mfu_6n_without_recompiles"] = six_k / sum(t for i, t in enumerate(timed) if i not in fresh) / peak
        result["paths"][path] = r
        print(json.dumps({k: v for k, v in r.items() if k not in ("step_times", "phases")}), flush=True)
    p = result["paths"]
    if "tokens_per_s" in p.get("packed", {}) and "tokens_per_s" in p.get("padded", {}):
        result["packed_over_padded"] = p["packed"]["tokens_per_s"] / p["padded"]["tokens_per_s"]
    if "tokens_per_s" in p.get("packed", {}) and "tokens_per_s" in p.get("packed-every-pass", {}):
        result["once_over_every_pass"] = p["packed"]["tokens_per_s"] / p["packed-every-pass"]["tokens_per_s"]
    if "tokens_per_s" in p.get("packed", {}) and "tokens_per_s" in p.get("packed-eager-logprob", {}):
        result["compiled_over_eager_logprob"] = p["packed"]["tokens_per_s"] / p["packed-eager-logprob"]["tokens_per_s"]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    trainer.close()
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
