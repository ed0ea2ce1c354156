"""Reward-model scoring throughput, and its share of a worker's time per batch (issue 28).

    python benchmarks/reward_server_bench.py --out RES/reward.json           # one GPU
    python benchmarks/reward_server_bench.py --out /tmp/rm.json --cpu        # wiring check, tiny model

Part `score`: a Qwen2.5-0.5B-shaped sequence classifier (one label, random init, built from a
config here: no download), bf16 on the GPU, scores (prompt, response) rows of `--seq-len` tokens
(default 512) in micro-batches of a token budget (`--budgets`, rows = budget // seq-len) through
the reward server's own scorer (rollout/reward_model.py: RewardScorer.score_rows); samples/s per
budget after `--warmup` batches, peak memory. Part `generate` (in its own process, needs vLLM):
a 0.5B policy (random init, same shape) generates one worker batch (`--prompts` x `--n`
responses of `--response-len` tokens from prompts of `--seq-len - --response-len` tokens,
ignore_eos), timed; with the best samples/s of part `score`, the batch's scoring time is batch /
samples_s and its share of the worker's time is score / (generate + score), the worker waiting
on the server for its scores (no overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

GENERATE_TIMEOUT_S = 300  # a fresh machine's first engine start took 113-166 s (../shared/device/README.md)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.rollout_bench import QWEN25_05B  # noqa: E402

TINY = dict(QWEN25_05B, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
TINY.update(vocab_size=1000, num_key_value_heads=2)


def classifier(shape: dict, device: str):
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = Qwen2Config(**shape, num_labels=1, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return Qwen2ForSequenceClassification(config).to(device=device, dtype=dtype).eval()


def scorer_folder(shape: dict) -> str:
    """The classifier saved as a reward model folder (with the built-in tokenizer: the rows are
    token ids already, the tokenizer only has to load), as a reward server is given one."""
    import tempfile

    from rollout import builtin_task

    folder = tempfile.mkdtemp(prefix="rm-bench-")
    classifier(shape, "cpu").save_pretrained(folder)
    builtin_task.build_tokenizer().save_pretrained(folder)
    return folder


def score_part(args, shape: dict, device: str) -> list[dict]:
    """samples/s of the reward server's scorer (rollout.reward_model.RewardScorer.score_rows:
    micro-batches of the token budget, padding, the scores back on the CPU) per budget."""
    import torch

    from rollout.reward_model import RewardScorer, Row

    folder = scorer_folder(shape)
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for budget in args.budgets:
        rows = max(1, budget // args.seq_len)
        scorer = RewardScorer(folder, device, args.seq_len, micro_batch_rows=rows, token_budget=budget)
        ids = torch.randint(2, shape["vocab_size"], (rows, args.seq_len), generator=gen).tolist()
        batch = [Row(i, r) for i, r in enumerate(ids)]
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            for i in range(args.warmup + args.batches):
                if i == args.warmup:
                    _sync(device)
                    t0 = time.perf_counter()
                scores = scorer.score_rows(batch)
            _sync(device)
        except torch.OutOfMemoryError:
            rows_out.append({"budget_tokens": budget, "rows": rows, "oom": True})
            del scorer
            torch.cuda.empty_cache()
            continue
        seconds = time.perf_counter() - t0
        row = {
            "budget_tokens": budget,
            "rows": rows,
            "samples_s": round(rows * args.batches / seconds, 1),
            "tokens_s": round(rows * args.seq_len * args.batches / seconds),
            "batch_ms": round(1000 * seconds / args.batches, 2),
            "finite": bool(torch.isfinite(torch.tensor(scores)).all()),
        }
        if device == "cuda":
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
        del scorer
    return rows_out


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def generate_part(args) -> dict:
    """One worker batch through the worker's own engine (`rollout.vllm_engine.VLLMEngine`: vLLM's
    default multiprocess mode, CUDA graphs, logprobs), in its own process: vLLM holds the GPU's memory."""
    import tempfile

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollout import builtin_task
    from rollout.config import RolloutSamplingConfig
    from rollout.engine_types import SamplingSettings
    from rollout.vllm_engine import VLLMEngine

    path = tempfile.mkdtemp(prefix="rm-bench-policy-")
    torch.manual_seed(0)  # built on the CPU before vLLM starts (see ../shared/device/README.md)
    cfg = Qwen2Config(**QWEN25_05B, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    builtin_task.build_tokenizer().save_pretrained(path)
    print(f"starting the worker's vLLM engine on {path}", flush=True)
    engine = VLLMEngine(path, RolloutSamplingConfig(name="vllm", dtype="bfloat16", gpu_memory_utilization=0.6))
    plen = args.seq_len - args.response_len
    gen = torch.Generator().manual_seed(1)
    # Random ids of Qwen's vocabulary; a random-init model draws eos (id 1) with p ~ 1/151936 per token.
    prompts = [torch.randint(2, 151936, (plen,), generator=gen).tolist() for _ in range(args.prompts)]
    sp = SamplingSettings(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.response_len, seed=0)
    engine.generate(prompts[:2], sp)  # warm-up (compile, graphs)
    times, tokens = [], 0
    for r in range(args.gen_rounds):
        t0 = time.perf_counter()
        groups = engine.generate(prompts, sp)
        times.append(time.perf_counter() - t0)
        tokens = sum(len(c.token_ids) for g in groups for c in g)
        print(f"round {r}: {times[-1]:.2f} s, {tokens} response tokens", flush=True)
    engine.close()
    samples = sum(len(g) for g in groups)
    return {
        "samples": samples,
        "response_tokens": tokens,
        "generate_s": round(min(times), 3),
        "generate_s_all": [round(t, 3) for t in times],
    }


def run_generate_child(args) -> dict:
    """`generate_part` in a fresh process, its output streamed to a log beside --out, a line every 30 s."""
    log_path = os.path.splitext(args.out)[0] + "_generate.log"
    cmd = [sys.executable, __file__, "--out", "-", "--part", "generate", "--seq-len", str(args.seq_len)]
    cmd += ["--prompts", str(args.prompts), "--n", str(args.n), "--response-len", str(args.response_len)]
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            waited = time.monotonic() - t0
            if waited > GENERATE_TIMEOUT_S:
                proc.kill()
                proc.wait()
                break
            print(f"waiting for the vLLM batch process ({waited:.0f} s of {GENERATE_TIMEOUT_S} s; log {log_path})")
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
    with open(log_path) as f:
        text = f.read()
    line = next((x for x in text.splitlines() if x.startswith("GENERATE ")), None)
    if line is None:
        return {"error": f"rc {proc.returncode} after {time.monotonic() - t0:.0f} s: " + text[-2000:]}
    return json.loads(line[len("GENERATE ") :])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file of the results")
    p.add_argument("--cpu", action="store_true", help="tiny classifier on the CPU, no vLLM part: a wiring check")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per (prompt, response) row")
    p.add_argument("--budgets", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batches", type=int, default=10, help="timed micro-batches per budget")
    p.add_argument("--prompts", type=int, default=64, help="generate part: prompts per worker batch")
    p.add_argument("--n", type=int, default=8, help="generate part: responses per prompt")
    p.add_argument("--response-len", type=int, default=256, help="generate part: response tokens")
    p.add_argument("--gen-rounds", type=int, default=3)
    p.add_argument("--part", choices=("all", "score", "generate"), default="all")
    args = p.parse_args(argv)
    if args.seq_len < 8 or not 0 < args.response_len < args.seq_len or min(args.budgets) < 1 or args.batches < 1:
        p.error("--seq-len >= 8, 0 < --response-len < --seq-len, budgets and --batches >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part == "generate":
        print("GENERATE " + json.dumps(generate_part(args)), flush=True)
        return 0
    device = "cpu" if args.cpu else "cuda"
    import torch

    result = {
        "machine": platform.node(),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "shape": "tiny" if args.cpu else "Qwen2.5-0.5B",
        "seq_len": args.seq_len,
        "score": score_part(args, TINY if args.cpu else QWEN25_05B, device),
    }
    best = max((r for r in result["score"] if "samples_s" in r), key=lambda r: r["samples_s"], default=None)
    if args.part == "all" and not args.cpu and best:
        torch.cuda.empty_cache()
        g = run_generate_child(args)
        if "error" not in g:
            g["score_s"] = round(g["samples"] / best["samples_s"], 3)
            g["score_share"] = round(g["score_s"] / (g["generate_s"] + g["score_s"]), 3)
        result["generate"] = g
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
