"""Logprobs + entropy with and without the full (tokens x vocab) logits tensor (issue 25).

    python -m benchmarks.logprob_bench --out RES/logprob.json            # GPU: 0.5B head, 8 x 4096
    python -m benchmarks.logprob_bench --cpu --out /tmp/logprob.json     # CPU, toy size

A real Qwen2 (one decoder layer, the Qwen2.5 vocabulary and hidden size on GPU), one packed row
of `rows` sequences; forward + backward of sum(logprobs) + sum(entropy) through
`trainer.algo.response_logprobs`, full logits (chunk=None, the path before) against chunks of
LOGPROB_CHUNK_TOKENS. Peak memory: the CUDA allocator's on GPU; on CPU the process's resident
set sampled every 2 ms, above what it held before the pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest resident set above the start, sampled by a thread this object owns."""

    def __enter__(self):
        self.base, self.peak, self._stop = rss_bytes(), 0, threading.Event()
        self._t = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._t.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes() - self.base)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=5)
        self.peak = max(self.peak, rss_bytes() - self.base)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--rows", type=int, default=4)  # 4 x 4160 tokens: full logits peak ~60 GiB
    ap.add_argument("--response", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: the trainer's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.rollout_bench import QWEN25_05B
    from protocol.experience import Sample
    from trainer import algo
    from trainer.batch import collate

    device = torch.device("cpu" if args.cpu else "cuda")
    chunk_tokens = args.chunk or algo.LOGPROB_CHUNK_TOKENS
    shape = dict(QWEN25_05B, num_hidden_layers=1)
    if args.cpu:
        shape |= dict(hidden_size=128, intermediate_size=512, num_attention_heads=4, vocab_size=32000)
        args.rows, args.response = 2, 512
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, pad_token_id=0, attn_implementation="sdpa"))
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    prompt = 64
    samples = [
        Sample(f"s{i}", "g", "p", "w", 0, [2 + (i + j) % 1000 for j in range(prompt)],
               [3 + (7 * i + j) % 1000 for j in range(args.response)], [-1.0] * args.response, 0.0, "stop", 1.0,
               "x", 0.0, 0.0)
        for i in range(args.rows)
    ]  # fmt: skip
    batch = collate(samples).packed().to(device)
    result = {"device": str(device), "vocab": shape["vocab_size"], "hidden": shape["hidden_size"],
              "tokens": args.rows * args.response, "chunk": chunk_tokens, "paths": {}}  # fmt: skip
    for name, chunk in (("full_logits", None), ("chunked", chunk_tokens)) * 2:  # twice: warm
        times, peaks = [], []
        for _ in range(args.repeat):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            with PeakRSS() as rss:
                t0 = time.perf_counter()
                try:
                    lp, ent = algo.response_logprobs(model, batch, with_entropy=True, chunk=chunk)
                    (lp.sum() + ent.sum()).backward()
                except torch.OutOfMemoryError as e:  # the full-logits path at a size it cannot hold
                    result["paths"][name] = {"oom": str(e).split(".")[0]}
                    lp = ent = None
                    break
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            peaks.append((torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else rss.peak)
        if lp is not None:
            result["paths"][name] = {
                "seconds": min(times),
                "peak_mib": max(peaks) / 2**20,
                "logprob_sum": float(lp.sum()),
            }
        model.zero_grad(set_to_none=True)
        print(name, result["paths"][name], flush=True)
    p = result["paths"]
    if "oom" in p["full_logits"] or "oom" in p["chunked"]:
        print(json.dumps(result, indent=1))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return 0 if "oom" not in p["chunked"] else 1
    result["peak_ratio"] = p["full_logits"]["peak_mib"] / max(p["chunked"]["peak_mib"], 1e-9)
    result["time_ratio"] = p["chunked"]["seconds"] / p["full_logits"]["seconds"]
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
