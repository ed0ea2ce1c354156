"""launch.export: tandem and verl FSDP checkpoints to HF folders that transformers loads."""

import json
import os
import subprocess
import sys

import torch
from conftest import launch_local
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from buffer.weights.fs import WeightStore
from rollout import builtin_task

VERL_SAVER = """
import json, os, shutil, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
dist.init_process_group("gloo")
src, actor = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
with torch.no_grad():  # move the weights away from the source so the test can tell them apart
    for p in model.parameters():
        p.mul_(1.5)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
rank, world = dist.get_rank(), dist.get_world_size()
torch.save(model.state_dict(), f"{actor}/model_world_size_{world}_rank_{rank}.pt")
if rank == 0:
    json.dump({"FSDP_version": 2, "world_size": world}, open(f"{actor}/fsdp_config.json", "w"))
    shutil.copytree(src, f"{actor}/huggingface", ignore=shutil.ignore_patterns("*.safetensors"))
dist.barrier()
dist.destroy_process_group()
"""


def _export(ckpt, out):
    return subprocess.run(
        [sys.executable, "-m", "launch.export", "--checkpoint", str(ckpt), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_verl_fsdp_checkpoint_exports_to_the_same_weights(tmp_path):
    builtin_task.write_model(tmp_path / "src")
    actor = tmp_path / "global_step_7" / "actor"
    actor.mkdir(parents=True)
    (tmp_path / "saver.py").write_text(VERL_SAVER)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(tmp_path / "saver.py"),
            str(tmp_path / "src"),
            str(actor),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    proc = _export(actor, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    src = load_file(str(tmp_path / "src" / "model.safetensors"))
    sd = exported.state_dict()
    for k, v in src.items():
        assert torch.allclose(sd[k], v * 1.5), k
    assert (tmp_path / "hf" / "tokenizer.json").exists()
    # a second export onto the same folder is refused, naming it
    again = _export(actor, tmp_path / "hf")
    assert again.returncode == 1 and "already exists" in again.stderr


def test_tandem_checkpoint_exports_the_trainers_weights(tmp_path):
    """Train a few steps through the whole pipeline with checkpoints, export the last one, and
    compare with the weights the trainer published at that step."""
    root = tmp_path / "run"
    proc = subprocess.run(
        launch_local(
            "--root",
            str(root),
            "--steps",
            "4",
            "--timeout",
            "400",
            "--test-freq",
            "0",  # no validator: only the checkpoint and the published weights are compared
            "--trainer",
            "trainer.save_freq=4",
        ),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = root / "checkpoints" / "step_00000004"
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 4
    out = _export(ckpt, tmp_path / "hf")
    assert out.returncode == 0, out.stderr
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    published = dict(WeightStore(str(root)).tensors(4))
    init = load_file(str(root / "init_model" / "model.safetensors"))
    for k, v in published.items():
        assert torch.equal(exported[k], v), k
    assert any(not torch.equal(published[k], init[k]) for k in published)  # it did train


def test_export_names_a_folder_that_is_no_checkpoint(tmp_path):
    out = _export(tmp_path, tmp_path / "hf")
    assert out.returncode == 1 and "neither a tandem checkpoint" in out.stderr
