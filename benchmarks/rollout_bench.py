"""Rollout worker throughput against raw vLLM at its best, and in-place reload against a read.

    python benchmarks/rollout_bench.py --out results.json      # a machine with 2 GPUs and vLLM

Two processes, one GPU each, both running vLLM's default engine (multiprocess, CUDA graphs,
torch.compile), on the same model (Qwen2.5-0.5B shape, random init, built locally), prompts
and sampling (n responses per prompt, logprobs of the sampled tokens):
  raw     `LLM.generate` on the prompt token ids, at 0.9 GPU memory, vLLM's own defaults
  worker  a `RolloutWorker` with the product's defaults: generate + decode + reward + Arrow
          shard publish (`run_batch` and a flush)
This parent never touches CUDA; it asks the two processes for one batch each in turn (never
at once, so they share the host fairly), `--rounds` times. Then the worker reloads `--reloads`
published versions in place (checksums verified, files read by the engine process), each timed
against a plain read of the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=1e6,
)
# Qwen2.5-1.5B's published config.json (hidden, layers, heads; vocabulary and tied embeddings as 0.5B)
QWEN25_15B = dict(
    QWEN25_05B,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
)
FILE_BYTES = 256 << 20  # the trainer publishes 256 MiB files (trainer/publish.py)


def build_model(path: str, shape: dict = QWEN25_05B) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollout import builtin_task

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, eos_token_id=1, pad_token_id=0, bos_token_id=None)).to(torch.bfloat16)
    model.save_pretrained(path)
    builtin_task.build_tokenizer().save_pretrained(path)


def publish_like_trainer(store, model_dir: str, version: int) -> None:
    """Publish the model's weights as the trainer does: 256 MiB safetensors files."""
    from safetensors.torch import load_file

    from buffer.weights.fs import copy_model_metadata

    state = load_file(os.path.join(model_dir, "model.safetensors"))
    staged, files, entries, part, size = store.stage(version), [], {}, {}, 0
    for name, t in state.items():
        part[name] = t
        size += t.numel() * t.element_size()
        if size >= FILE_BYTES or name == list(state)[-1]:
            entry, described = store.write_file(staged, f"model-{len(files):05d}.safetensors", part)
            files.append(entry)
            entries.update(described)
            part, size = {}, 0
    copy_model_metadata(model_dir, staged)
    store.publish(staged, version, version, keep=3, described=(files, entries))


# --- the two measured processes: one JSON command per stdin line, one JSON answer per line ---
def serve_raw(args) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rollout.dataset import load_prompts

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in load_prompts([args.data], tok, "prompt", 512)]
    llm = LLM(model=args.model, gpu_memory_utilization=0.9, seed=0)
    batches = 0
    for _line in sys.stdin:
        sp = SamplingParams(
            n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, logprobs=0, seed=batches, detokenize=False
        )
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        batches += 1
        answer({"tok_s": tokens / (time.perf_counter() - t0)})


def serve_worker(args) -> None:
    from protocol.config import build
    from rollout.config import WorkerConfig
    from rollout.worker import RolloutWorker

    cfg = build(
        WorkerConfig,
        {
            "root": args.root,
            "data.train_files": f"[{args.data}]",
            "worker.id": "bench",
            "data.shuffle": "false",
            "data.max_response_length": str(args.max_tokens),
            "actor_rollout_ref.rollout.name": "vllm",
            "actor_rollout_ref.rollout.n": str(args.n),
            "actor_rollout_ref.rollout.prompts_per_batch": str(args.prompts),
            "buffer.flush_samples": "100000",
            "buffer.max_backlog_samples": "100000000",
        },
    )
    worker = RolloutWorker(cfg)
    worker.start()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["do"] == "batch":
            tokens0, t0 = worker.tokens, time.perf_counter()
            worker.run_batch()
            worker.writer.flush()  # the shard publish is part of the worker's cost
            answer({"tok_s": (worker.tokens - tokens0) / (time.perf_counter() - t0)})
        else:  # reload the newest version; first time a plain read of the same files
            files = worker.store.files(worker.store.latest())
            t0 = time.perf_counter()
            for path in files:
                with open(path, "rb") as f:
                    while f.read(64 << 20):
                        pass
            read_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert worker.maybe_reload()
            answer(
                {
                    "reload_s": time.perf_counter() - t0,
                    "read_s": read_s,
                    "bytes": sum(os.path.getsize(p) for p in files),
                    "version": worker.version,
                }
            )


def answer(obj: dict) -> None:
    print("BENCH " + json.dumps(obj), flush=True)


class Child:
    def __init__(self, role: str, gpu: str, args, log_path: str):
        env = dict(
            os.environ,
            CUDA_VISIBLE_DEVICES=gpu,
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
        )
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--role",
                role,
                "--model",
                args.model,
                "--data",
                args.data,
                "--root",
                args.root,
                "--n",
                str(args.n),
                "--prompts",
                str(args.prompts),
                "--max-tokens",
                str(args.max_tokens),
                "--out",
                "-",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )

    def ask(self, cmd: dict, timeout_s: float = 600) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"bench process exited {self.proc.wait()}; see {self.log.name}")
            if line.startswith("BENCH "):
                return json.loads(line[6:])
            self.log.write(line)
        raise TimeoutError(f"no answer to {cmd} in {timeout_s} s")

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "all": xs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("parent", "raw", "worker"), default="parent")
    ap.add_argument("--work", default="/tmp/rollout_bench")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", default="0,1", help="GPU of the raw process, GPU of the worker")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--reloads", type=int, default=5)
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--root", default=None)
    args = ap.parse_args()
    if args.role == "raw":
        return serve_raw(args) or 0
    if args.role == "worker":
        return serve_worker(args) or 0

    import shutil

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    args.model, args.data, args.root = (f"{args.work}/model", f"{args.work}/train.parquet", f"{args.work}/run")
    build_model(args.model)
    from buffer.weights.fs import WeightStore
    from rollout import builtin_task

    store = WeightStore(args.root)
    publish_like_trainer(store, args.model, 0)
    builtin_task.write_parquet(args.data, builtin_task.make_rows(args.prompts, 24))
    gpu_raw, gpu_worker = args.gpus.split(",")
    t0 = time.monotonic()
    raw = Child("raw", gpu_raw, args, f"{args.work}/raw.log")
    worker = Child("worker", gpu_worker, args, f"{args.work}/worker.log")
    try:
        raw.ask({"do": "batch"}), worker.ask({"do": "batch"})  # start-up and warm-up
        started_s = time.monotonic() - t0
        raws, workers = [], []
        for r in range(args.rounds):
            raws.append(raw.ask({"do": "batch"})["tok_s"])
            workers.append(worker.ask({"do": "batch"})["tok_s"])
            print(f"round {r + 1}/{args.rounds}: raw {raws[-1]:.0f} tok/s, worker {workers[-1]:.0f} tok/s", flush=True)
        reloads = []
        for v in range(1, args.reloads + 1):
            publish_like_trainer(store, args.model, v)
            reloads.append(worker.ask({"do": "reload"}))
            print(f"reload v{v}: {reloads[-1]}", flush=True)
    finally:
        raw.close()
        worker.close()
    import torch

    ratios = [w / r for w, r in zip(workers, raws)]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0),
        "host": platform.node(),
        "model": "Qwen2.5-0.5B shape, random init, bf16",
        "engine": "vLLM default: multiprocess, CUDA graphs + torch.compile; raw at 0.9 memory, worker at its defaults",
        "gpus_raw_worker": args.gpus,
        "prompts": args.prompts,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "startup_and_warmup_s": started_s,
        "raw_tok_s": spread(raws),
        "worker_tok_s": spread(workers),
        "worker_over_raw_per_round": spread(ratios),
        "worker_over_raw": statistics.median(workers) / statistics.median(raws),
        "reloads": reloads,
        "reload_over_read": spread([x["reload_s"] / x["read_s"] for x in reloads]),
    }
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
