"""What every generation engine takes and returns (rollout/engine.py's HFEngine,
rollout/vllm_engine.py's VLLMEngine): imported by both, so neither imports the other. Torch-free:
launch.local checks the engine setting with it without importing torch (2 s of its start)."""

from __future__ import annotations

import dataclasses
from typing import Protocol


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" when the eos token ended it, else "length"


@dataclasses.dataclass
class SamplingSettings:
    n: int
    temperature: float  # 0: greedy decoding
    top_p: float
    max_tokens: int
    seed: int
    top_k: int = -1  # -1: no top-k truncation (training rollouts never truncate what mu describes)


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingSettings) -> list[list[Completion]]:
        """For each prompt, `params.n` completions."""

    def load_files(self, paths: list[str]) -> int:
        """Copy the HF-named tensors of verified safetensors files into the running model, in
        place; returns how many were loaded."""

    def load_adapter(self, folder: str, version: int) -> int:
        """Apply the adapter-only (LoRA) version in the verified `folder` (PEFT's adapter_config.json
        and adapter_model.safetensors) to the base in place, under a new adapter id, and drop the
        previous adapter; returns how many adapter tensors were loaded."""

    def close(self) -> None: ...


def engine_problem(name: str) -> str | None:
    """Why the engine `name` (actor_rollout_ref.rollout.name) cannot start here, if it cannot:
    said at start, not after the trainer's first weight version has been waited for."""
    import importlib.util

    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        return (
            "actor_rollout_ref.rollout.name=vllm: vLLM is not installed in this Python "
            "environment (pip install -e '.[gpu]' on a GPU node), or use "
            "actor_rollout_ref.rollout.name=hf"
        )
    return None
