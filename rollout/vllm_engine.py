"""vLLM engine for GPU rollout nodes (tested against vLLM 0.26).

Logprobs are requested in `processed_logprobs` mode, i.e. of the distribution the sampler drew
from (temperature applied), which is what the trainer's importance weights need. New weights go
into the running engine through `collective_rpc`: every vLLM worker calls the model's own
`load_weights`, which takes HF names and full tensors and shards them for tensor parallelism.
Tensors travel in buckets of at most `bucket_bytes`, so host memory stays bounded.
"""
from __future__ import annotations

import os
from typing import Iterable

import torch

from rollout.engine import Completion, SamplingSettings

BUCKET_BYTES = 512 << 20


def _load_bucket(worker, bucket: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker process (module-level so it pickles by reference)."""
    worker.model_runner.model.load_weights(weights=bucket)
    return len(bucket)


class VLLMEngine:
    def __init__(self, model_dir: str, cfg):
        from transformers import AutoTokenizer
        from vllm import LLM
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.llm = LLM(model=model_dir, tokenizer=model_dir, dtype=cfg.dtype,
                       gpu_memory_utilization=cfg.gpu_memory_utilization,
                       tensor_parallel_size=cfg.tensor_model_parallel_size,
                       enforce_eager=cfg.enforce_eager, logprobs_mode="processed_logprobs",
                       enable_prefix_caching=True, seed=0)

    def generate(self, prompts: list[list[int]], params: SamplingSettings) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        sampling = SamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                                  max_tokens=params.max_tokens, logprobs=0, seed=params.seed,
                                  detokenize=False)  # the worker decodes what it scores
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling,
                                    use_tqdm=False)
        results = []
        for out in outputs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                # logprobs=0 returns the sampled token's logprob at each position.
                lps = [step[tok].logprob for step, tok in zip(c.logprobs, ids)]
                group.append(Completion(ids, lps, "stop" if c.finish_reason == "stop" else "length"))
            results.append(group)
        return results

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]],
                     bucket_bytes: int = BUCKET_BYTES) -> int:
        loaded, bucket, size = 0, [], 0
        for name, t in tensors:
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                loaded += self.llm.collective_rpc(_load_bucket, args=(bucket,))[0]
                bucket, size = [], 0
        if bucket:
            loaded += self.llm.collective_rpc(_load_bucket, args=(bucket,))[0]
        self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
        return loaded

    def close(self) -> None:
        self.llm = None
