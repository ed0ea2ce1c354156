"""Export a trainer checkpoint as an HF model folder (config, tokenizer, safetensors).

    python -m launch.export --checkpoint RUN/checkpoints/step_00000100 --out HF_DIR
    python -m launch.export --checkpoint global_step_100/actor --out HF_DIR      # a verl FSDP one
    python -m launch.export --checkpoint global_step_100/actor --out HF_DIR      # a verl Megatron one
    python -m launch.export --checkpoint RUN/checkpoints/step_00000100 --out DIR --adapter-only  # LoRA

A tandem LoRA checkpoint (lora_rank > 0: the adapter and its optimizer state) exports merged
(the base, from trainer_state.json's model_path after its checksum is checked, with the adapter
folded in: an HF folder transformers loads) or, with --adapter-only, as the adapter alone in
PEFT's layout.

Accepts a tandem checkpoint (torch.distributed.checkpoint shards + trainer_state.json) or a verl
FSDP actor checkpoint (`model_world_size_W_rank_R.pt`, `fsdp_config.json`, `huggingface/`),
which is what verl's model merger takes. Runs in one process, no GPU needed. The folder appears
only when complete (written beside it, then renamed).

A verl Megatron actor checkpoint (`model/dist_ckpt/`, `model/huggingface/`) is handed to verl's
own merger, `python -m verl.model_merger merge --backend megatron`, where its dependencies
(megatron-core) are installed; elsewhere it is refused, naming what to install.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import sys

import torch

from buffer.checkpoints import state_file
from buffer.storage import respect_umask
from buffer.weights.fs import copy_model_metadata

_VERL_SHARD = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")


class ExportError(ValueError):
    pass


def _empty_model(config_dir: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to_empty(device="cpu")


def tandem_state(checkpoint: str) -> tuple[dict, str]:
    """Full HF-named tensors from a tandem DCP checkpoint, and the model folder it started from."""
    import torch.distributed.checkpoint as dcp

    with open(state_file(checkpoint)) as f:
        model_path = json.load(f)["model_path"]
    model = _empty_model(model_path)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return state["model"], model_path


def lora_model(checkpoint: str, saved: dict):
    """The PeftModel of a LoRA checkpoint: its base (trainer_state's model_path, checked against
    the checksum the checkpoint names) with the adapter it saved."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from protocol.weights import base_checksum
    from trainer import lora

    spec, model_path = saved["lora"], saved["model_path"]
    if not os.path.isdir(model_path):
        raise ExportError(f"{checkpoint}: a LoRA checkpoint of the base {model_path}, which is not there")
    if (found := base_checksum(model_path)) != spec["base"]:
        raise ExportError(
            f"{checkpoint}: a LoRA checkpoint of a base with checksum {spec['base']}; {model_path} "
            f"now has {found}: its adapter does not apply to it"
        )
    targets = spec["target_modules"]
    lora_spec = lora.LoraSpec(
        spec["rank"],
        spec["alpha"],
        targets if isinstance(targets, str) else tuple(targets),
        tuple(spec["exclude_modules"]),
        spec["dropout"],
    )
    model = lora.apply(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), lora_spec)
    state = {"model": {k: v for k, v in model.state_dict().items() if ".lora_" in k}}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if unexpected or any(".lora_" in k for k in missing):
        raise ExportError(f"{checkpoint}: adapter tensors do not match its settings {spec}: {unexpected[:3]}")
    return model.eval(), model_path


def export_lora(checkpoint: str, saved: dict, tmp: str, adapter_only: bool) -> None:
    """A LoRA checkpoint into `tmp`: the adapter alone in PEFT's layout (adapter_config.json,
    adapter_model.safetensors; PeftModel.from_pretrained and vLLM's LoRA loader read it), or
    the merged model (PEFT's merge_and_unload: W + alpha/r * B @ A) as a plain HF folder."""
    model, model_path = lora_model(checkpoint, saved)
    if adapter_only:
        model.save_pretrained(tmp)
    else:
        model.merge_and_unload().save_pretrained(tmp)
    copy_model_metadata(model_path, tmp)  # tokenizer and configs; never old weights


def _load(path: str) -> dict:
    """A verl shard with torch's safe unpickler: tensors, DTensors and their placements only
    (torch allowlists those once torch.distributed.tensor is imported), never code named in
    the file."""
    import torch.distributed.tensor  # noqa: F401 - registers DTensor for weights_only loads

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ExportError(
            f"{path}: refused to load (not plain tensors; weights_only=True): {str(e).splitlines()[0]}"
        ) from None


def verl_state(actor_dir: str) -> tuple[dict, str]:
    """Merge verl's per-rank FSDP shards (DTensor local shards, or plain tensors) into full ones."""
    shards = {}
    for name in os.listdir(actor_dir):
        if m := _VERL_SHARD.match(name):
            shards[int(m.group(2))] = (int(m.group(1)), os.path.join(actor_dir, name))
    world = {w for w, _ in shards.values()}
    if len(world) != 1 or sorted(shards) != list(range(next(iter(world)))):
        raise ExportError(
            f"{actor_dir}: expected model_world_size_W_rank_0..W-1.pt, found ranks "
            f"{sorted(shards)} of sizes {sorted(world)}"
        )
    parts = [_load(shards[r][1]) for r in sorted(shards)]
    full = {}
    for key in parts[0]:
        pieces = [p[key] for p in parts]
        first = pieces[0]
        if hasattr(first, "placements"):  # FSDP2 DTensor: concatenate the local shards
            shard = next((pl for pl in first.placements if pl.is_shard()), None)
            locals_ = [p.to_local() for p in pieces]
            full[key] = torch.cat(locals_, dim=shard.dim) if shard else locals_[0]
        else:
            full[key] = first
    return full, os.path.join(actor_dir, "huggingface")


def is_megatron(checkpoint: str) -> bool:
    """verl's Megatron actor layout: model/dist_ckpt/ (older releases: dist_ckpt/ at the top)."""
    return any(os.path.isdir(os.path.join(checkpoint, *p)) for p in (("model", "dist_ckpt"), ("dist_ckpt",)))


def merge_megatron(checkpoint: str, tmp: str) -> None:
    """verl's own Megatron merger into `tmp`; refused, naming what to install, where it cannot run."""
    import importlib.util

    missing = [
        name
        for name, mod in (("megatron-core", "megatron.core"), ("verl", "verl.model_merger"))
        if importlib.util.find_spec(mod.split(".")[0]) is None or importlib.util.find_spec(mod) is None
    ]
    if missing:
        raise ExportError(
            f"--checkpoint {checkpoint}: a verl Megatron checkpoint; launch.export hands "
            f"it to verl's merger (python -m verl.model_merger merge --backend megatron), "
            f"which needs {' and '.join(missing)}: pip install {' '.join(missing)} "
            "(megatron-core with a torch build it supports; see verl's Megatron install docs)"
        )
    if not os.path.isdir(os.path.join(checkpoint, "model", "huggingface")):
        raise ExportError(
            f"--checkpoint {checkpoint}: no model/huggingface/ (an older verl layout): "
            "run verl's scripts/migrate_megatron_checkpoint_layout.py on it first"
        )
    with open(os.path.join(checkpoint, "model", "huggingface", "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    cmd = [
        sys.executable,
        "-m",
        "verl.model_merger",
        "merge",
        "--backend",
        "megatron",
        "--local_dir",
        checkpoint,
        "--target_dir",
        tmp,
        *(["--tie-word-embedding"] if tied else []),
    ]
    import subprocess

    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ExportError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def export(checkpoint: str, out: str, adapter_only: bool = False) -> str:
    """`adapter_only`: a LoRA checkpoint's adapter in PEFT's layout instead of merged weights."""
    if os.path.exists(out):
        raise ExportError(f"--out {out} already exists; choose a new folder")
    saved = {}
    if os.path.isfile(state_file(checkpoint)):
        with open(state_file(checkpoint)) as f:
            saved = json.load(f)
    if saved.get("lora"):
        tmp = f"{out.rstrip('/')}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        export_lora(checkpoint, saved, tmp, adapter_only)
        respect_umask(tmp)
        os.replace(tmp, out)
        return out
    if adapter_only:
        raise ExportError(f"--adapter-only: {checkpoint} holds full weights, no LoRA adapter (lora_rank was 0)")
    if is_megatron(checkpoint):
        tmp = f"{out.rstrip('/')}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        merge_megatron(checkpoint, tmp)
        respect_umask(tmp)
        os.replace(tmp, out)
        return out
    if os.path.isfile(state_file(checkpoint)):
        state, config_dir = tandem_state(checkpoint)
    elif os.path.isfile(os.path.join(checkpoint, "fsdp_config.json")):
        state, config_dir = verl_state(checkpoint)
    else:
        raise ExportError(
            f"--checkpoint {checkpoint}: neither a tandem checkpoint (trainer_state.json), "
            "a verl FSDP actor folder (fsdp_config.json) nor a verl Megatron one "
            "(model/dist_ckpt/)"
        )
    model = _empty_model(config_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ExportError(
            f"{checkpoint}: tensors do not match the model config in {config_dir}: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    if model.config.tie_word_embeddings:
        model.tie_weights()
    tmp = f"{out.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    copy_model_metadata(config_dir, tmp)  # tokenizer and generation config; never old weights
    respect_umask(tmp)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launch.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--checkpoint", required=True, help="checkpoint folder (tandem, or a verl FSDP or Megatron actor folder)"
    )
    p.add_argument("--out", required=True, help="HF model folder to create")
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA checkpoint: write its adapter alone in PEFT's layout (default: the merged full weights)",
    )
    args = p.parse_args(argv)
    try:
        print(f"exported {args.checkpoint} -> {export(args.checkpoint, args.out, args.adapter_only)}")
    except (ExportError, FileNotFoundError, KeyError) as e:
        print(f"launch.export: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
