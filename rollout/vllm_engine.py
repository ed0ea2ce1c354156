"""vLLM engine for GPU rollout nodes (tested against vLLM 0.26).

The engine runs in vLLM's default mode: the model lives in separate engine processes (one per
tensor-parallel rank), started fresh by vLLM, with CUDA graphs unless `enforce_eager`.
Logprobs are requested in `processed_logprobs` mode, i.e. of the distribution the sampler drew
from (temperature applied), which is what the trainer's importance weights need.

New weights: `WeightLoader` is registered as vLLM's `worker_extension_cls`, so every engine
process gains a `tandem_load_files` method that `collective_rpc` calls by name. Only file paths
cross the process boundary (no pickled functions or tensors, no insecure serialization): each
engine process reads the version's safetensors files itself (memory-mapped, one tensor at a time,
so host memory stays bounded) and hands HF-named full tensors to the model's own `load_weights`,
which shards them for tensor parallelism and copies them into the existing parameters, so CUDA
graphs stay valid. Checksums are verified once, by the caller, before the call.

Engine processes are *spawned*, never forked (`VLLM_WORKER_MULTIPROC_METHOD=spawn` unless the
environment sets it): vLLM forks by default and switches to spawn only when torch says CUDA is
initialised in this process, but a worker imports reward code that touches the CUDA driver
without initialising torch's CUDA state: `import verl` (for its reward functions) calls
`torch.cuda.is_available()`, which poisons fork, so a forked engine process died at start with
"Cannot re-initialize CUDA in forked subprocess". A user's `custom_reward_function` may do the
same in ways no check here can see. Spawn costs a few seconds once per engine start and works
whatever was imported before.

Adapter-only (LoRA) versions (issue 27): with `lora_rank` > 0 (the first version's rank) the
engine starts from the base with LoRA enabled, `max_lora_rank` from
`actor_rollout_ref.rollout.max_lora_rank` or, when that is 0, the adapter's rank rounded up to
vLLM's sizes (as verl derives it from `model.lora_rank`), one adapter in a batch
(`max_loras=1`) and two in the CPU cache (the new one is added before the old is removed, so a
failed add leaves the old one in use, never the bare base). Each version is added under a new
id (`LoRARequest("v<N>", id, folder)`: vLLM loads it from the verified folder in every engine
process), every request is generated with it, and the previous id is removed. The prefix cache
keys blocks by adapter id, so nothing cached under the old adapter is reused.

Debugging: `VLLM_ENABLE_V1_MULTIPROCESSING=0` in the environment (with `enforce_eager=true`)
runs the model in this process, where its errors surface directly; never needed in production.
"""

from __future__ import annotations

import json
import os
from typing import Any

from rollout.engine_types import Completion, SamplingSettings

RELOAD_TIMEOUT_S = 600.0  # a reload that takes longer is a hung engine process, not a slow disk


class WeightLoader:
    """Mixed into vLLM's worker class in each engine process (`worker_extension_cls`)."""

    model_runner: Any  # the vLLM worker's, which this class is mixed into

    def tandem_load_files(self, paths: list[str]) -> int:
        """Load HF-named tensors from verified safetensors files into the running model."""
        from buffer.weights.fs import read_tensors

        count = 0

        def counted():
            nonlocal count
            for item in read_tensors(paths):
                count += 1
                yield item

        self.model_runner.model.load_weights(weights=counted())
        return count


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.26's MaxLoRARanks (vllm/config/lora.py)


def max_lora_rank(rank: int, configured: int = 0) -> int:
    """The engine's max_lora_rank: `configured` (actor_rollout_ref.rollout.max_lora_rank) when
    set, else the smallest of vLLM's sizes that holds `rank`."""
    wanted = configured or rank
    for size in VLLM_LORA_RANKS:
        if wanted <= size:
            if configured and configured != size:
                raise ValueError(
                    f"actor_rollout_ref.rollout.max_lora_rank={configured}: vLLM takes one of {list(VLLM_LORA_RANKS)}"
                )
            return size
    raise ValueError(f"LoRA rank {wanted}: vLLM's largest max_lora_rank is {VLLM_LORA_RANKS[-1]}")


class VLLMEngine:
    def __init__(self, model_dir: str, cfg, lora_rank: int = 0):
        from transformers import AutoTokenizer
        from vllm import LLM

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # Read by vLLM when it starts its processes, i.e. inside LLM(...) below (module doc).
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.max_lora_rank = max_lora_rank(lora_rank, cfg.max_lora_rank) if lora_rank else 0
        lora = (
            dict(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1, max_cpu_loras=2)
            if self.max_lora_rank
            else {}
        )
        self.lora: Any = None  # the LoRARequest every request is generated with (None: no adapter)
        self._lora_ids = 0
        self.llm = LLM(
            model=model_dir,
            tokenizer=model_dir,
            dtype=cfg.dtype,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_model_parallel_size,
            enforce_eager=cfg.enforce_eager,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            seed=0,
            worker_extension_cls=f"{__name__}.{WeightLoader.__qualname__}",
            **lora,
        )

    def generate(self, prompts: list[list[int]], params: SamplingSettings) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        top_k = {"top_k": params.top_k} if params.top_k > 0 else {}  # temperature 0: greedy
        sampling = SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            logprobs=0,
            seed=params.seed,
            detokenize=False,
            **top_k,
        )  # the worker decodes what it scores
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False, lora_request=self.lora
        )
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

    def load_files(self, paths: list[str]) -> int:
        # Every tensor-parallel rank reads all files; each keeps its own shard.
        counts = self.llm.collective_rpc("tandem_load_files", timeout=RELOAD_TIMEOUT_S, args=(list(paths),))
        self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
        return counts[0]

    def load_adapter(self, folder: str, version: int) -> int:
        """The adapter-only version in `folder` under a new adapter id; the old id removed."""
        from safetensors import safe_open
        from vllm.lora.request import LoRARequest

        from protocol.weights import ADAPTER_WEIGHTS
        from rollout.versions import Refused

        if not self.max_lora_rank:
            raise RuntimeError("this vLLM engine was started for full weights, without LoRA")
        with open(os.path.join(folder, "adapter_config.json")) as f:
            rank = int(json.load(f)["r"])
        if rank > self.max_lora_rank:
            raise Refused(
                f"weight version {version}: adapter rank {rank} is above the engine's max_lora_rank "
                f"{self.max_lora_rank} (set actor_rollout_ref.rollout.max_lora_rank)",
                version=version,
                rank=rank,
                max_lora_rank=self.max_lora_rank,
            )
        self._lora_ids += 1
        request = LoRARequest(f"v{version}", self._lora_ids, folder)
        engine = self.llm.llm_engine
        if not engine.add_lora(request):  # loads it in every engine process; raises on a bad adapter
            raise RuntimeError(f"vLLM did not add the adapter of weight version {version} from {folder}")
        old, self.lora = self.lora, request
        if old is not None:
            engine.remove_lora(old.lora_int_id)
        with safe_open(os.path.join(folder, ADAPTER_WEIGHTS), framework="pt") as f:
            return len(list(f.keys()))

    def loras(self) -> set[int]:
        """The adapter ids the engine holds (tests: the old one is gone)."""
        return set(self.llm.llm_engine.list_loras())

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()  # the engine processes, now, not at exit
        self.llm = None
