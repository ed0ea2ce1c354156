"""Adapter-only (LoRA) weight versions for the rollout tests, made as the trainer makes them: PEFT
adapters on the real tiny model (lora_B perturbed, else the adapter is the base), saved in PEFT's
layout and published through the WeightStore with the manifest's `adapter` field (issue 27)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from buffer.weights.fs import WeightStore, copy_model_metadata
from protocol.experience import Sample
from protocol.weights import ADAPTER_CONFIG, ADAPTER_WEIGHTS, base_checksum


def make_adapter(base_dir, out_dir, seed: int, rank: int = 4, alpha: float = 8.0, scale: float = 0.3, values=None):
    """A PEFT model (the "trainer's" model: eval mode, float32) of the base in `base_dir` with a
    random adapter of `rank`, saved by PEFT to `out_dir`. `values`: a dtype the adapter's values
    are rounded to (kept in float32), so that an engine that holds it in that dtype holds the
    same numbers (vLLM's LoRA runs in the base's bfloat16)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear", bias="none"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:  # B starts at 0 (the adapter is the base): move it
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            if values is not None and ".lora_" in name:
                p.copy_(p.to(values).float())
    model.save_pretrained(out_dir)
    return model.eval()


def publish_adapter(store: WeightStore, adapter_dir, base_dir, version: int, base: str | None = None, keep: int = 4):
    """Publish the adapter folder as `version` (base: base_checksum of `base_dir` unless given)."""
    import json

    config = json.loads(Path(adapter_dir, ADAPTER_CONFIG).read_text())
    staged = store.stage(version)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copyfile(Path(adapter_dir, name), Path(staged, name))
    copy_model_metadata(str(base_dir), staged)  # config and tokenizer, as the trainer's publish_adapter
    field = {
        "base": base or base_checksum(base_dir),
        "rank": int(config["r"]),
        "alpha": config["lora_alpha"],
        "target_modules": sorted(config["target_modules"]),
    }
    return store.publish(staged, version, version, keep, adapter=field)


def trainer_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """The trainer's own logprob function (trainer/algo.py) on `model`."""
    from trainer import algo
    from trainer.batch import collate

    s = Sample(
        "s", "g", "p", "w", 0, prompt, response, [0.0] * len(response), 0.0, "length", temperature, "x", 0.0, 0.0
    )
    with torch.no_grad():
        return algo.response_logprobs(model, collate([s]))[0][0].tolist()
