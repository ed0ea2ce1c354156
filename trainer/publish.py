"""Gather the sharded actor into full HF-named tensors and publish a weight version."""
from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from buffer.weights import WeightStore

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def copy_model_metadata(model_path: str, dest: str) -> None:
    """Config, generation config and tokenizer files: what makes a version an HF model folder."""
    for name in os.listdir(model_path):
        src = os.path.join(model_path, name)
        if os.path.isfile(src) and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(src, os.path.join(dest, name))


def publish_version(model, store: WeightStore, model_path: str, version: int, step: int,
                    keep: int) -> dict:
    """Collective: every rank calls it; rank 0 writes. Returns timing and size metrics."""
    from safetensors.torch import save_file
    t0 = time.monotonic()
    # full_state_dict + cpu_offload: all ranks join the all-gathers, only rank 0 keeps tensors.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    gathered = time.monotonic()
    nbytes = 0
    if dist.get_rank() == 0:
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # HF folders store tied weights once
        state = {k: v.contiguous() for k, v in state.items()}
        nbytes = sum(v.numel() * v.element_size() for v in state.values())
        staged = store.stage(version)
        save_file(state, os.path.join(staged, "model.safetensors"), metadata={"format": "pt"})
        copy_model_metadata(model_path, staged)
        store.publish(staged, version, step, keep)
    dist.barrier()
    return {"weights/published": version, "weights/publish_s": time.monotonic() - t0,
            "weights/gather_s": gathered - t0, "weights/bytes": nbytes}
