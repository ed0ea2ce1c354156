"""Rollout worker throughput against raw vLLM, and in-place reload against a plain disk read.

    python benchmarks/rollout_bench.py --out results.json      # on a GPU machine with vLLM

One engine, one model (Qwen2.5-0.5B shape, random init, built locally), the same prompts and
sampling, measured alternately in one process:
  raw     LLM.generate on the prompt token ids
  worker  RolloutWorker.run_batch: generate + decode + reward + Arrow shard publish
and the reload of a published version (checksums verified, bucketed into the running engine)
against reading the same safetensors bytes from disk.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6)


def build_model(path: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from rollout import builtin_task
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B, eos_token_id=1, pad_token_id=0,
                                         bos_token_id=None)).to(torch.bfloat16)
    model.save_pretrained(path)
    builtin_task.build_tokenizer().save_pretrained(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/rollout_bench")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import shutil
    shutil.rmtree(args.work, ignore_errors=True)
    model_dir, root = f"{args.work}/model", f"{args.work}/run"
    build_model(model_dir)  # on the CPU, before CUDA is initialised
    from buffer.weights import WeightStore
    WeightStore(root).publish_hf_folder(model_dir, 0, 0, keep=3)
    from rollout import builtin_task
    builtin_task.write_parquet(f"{args.work}/train.parquet", builtin_task.make_rows(args.prompts, 24))

    import torch
    from protocol.config import build
    from rollout.config import WorkerConfig
    from rollout.worker import RolloutWorker
    cfg = build(WorkerConfig, {
        "root": root, "data.train_files": f"[{args.work}/train.parquet]", "worker.id": "bench",
        "data.shuffle": "false", "data.max_response_length": str(args.max_tokens),
        "actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.dtype": "bfloat16",
        "actor_rollout_ref.rollout.n": str(args.n),
        "actor_rollout_ref.rollout.prompts_per_batch": str(args.prompts),
        "actor_rollout_ref.rollout.gpu_memory_utilization": "0.5",
        "buffer.flush_samples": "100000", "buffer.max_backlog_samples": "100000000"})
    worker = RolloutWorker(cfg)
    worker.start()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in worker.prompts.prompts]

    def raw() -> float:
        sp = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens,
                            logprobs=0, seed=worker.batches, detokenize=False)
        t0 = time.perf_counter()
        outs = worker.engine.llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        return sum(len(c.token_ids) for o in outs for c in o.outputs) / dt

    def via_worker() -> float:
        tokens0 = worker.tokens
        t0 = time.perf_counter()
        worker.run_batch()
        worker.writer.flush()  # the shard publish is part of the worker's cost
        return (worker.tokens - tokens0) / (time.perf_counter() - t0)

    raw(), via_worker()  # warm-up
    raws, workers = [], []
    for _ in range(args.reps):
        raws.append(raw())
        workers.append(via_worker())

    # Reload: publish the same bytes as v1, load it in place; compare to a plain read.
    worker.store.publish_hf_folder(model_dir, 1, 1, keep=3)
    weights = os.path.join(worker.layout.version_dir(1), "model.safetensors")
    t0 = time.perf_counter()
    with open(weights, "rb") as f:
        while f.read(64 << 20):
            pass
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    worker.maybe_reload()
    reload_s = time.perf_counter() - t0
    assert worker.version == 1

    result = {
        "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0),
        "host": platform.node(), "model": "Qwen2.5-0.5B shape, random init, bf16",
        "prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens,
        "raw_tok_s": sorted(raws)[len(raws) // 2], "worker_tok_s": sorted(workers)[len(workers) // 2],
        "raw_all": raws, "worker_all": workers,
        "reload_s": reload_s, "disk_read_s": read_s, "weights_bytes": os.path.getsize(weights)}
    result["worker_over_raw"] = result["worker_tok_s"] / result["raw_tok_s"]
    result["reload_over_read"] = reload_s / read_s
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
