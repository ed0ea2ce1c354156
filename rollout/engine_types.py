"""What every generation engine takes and returns (rollout/engine.py's HFEngine,
rollout/vllm_engine.py's VLLMEngine): imported by both, so neither imports the other."""

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
