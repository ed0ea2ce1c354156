"""Trainer checkpoints that are visible only when complete, and resumable on any number of ranks.

Every rank writes its shard of the model and optimizer (and of the critic and its optimizer, when
there is one) with torch.distributed.checkpoint into a hidden temporary folder; rank 0 adds `trainer_state.json` (step, weight version, the experience
ledger: consumed shards and reader counters) and `pool.arrow` (groups read but not yet trained).
After a barrier, rank 0 renames the folder to `step_<N>`: that rename is the commit, so a
checkpoint killed half-written is never found by `resume_mode=auto`. DCP reshards on load, so a
run saved on 2 ranks resumes on 1 (or 4).
"""
from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from buffer.layout import RunLayout
from buffer.reader import Group
from buffer.storage import fsync_tree
from protocol.experience import decode, encode, from_table, to_table


def latest_complete(layout: RunLayout) -> str | None:
    if not os.path.isdir(layout.checkpoints_dir):
        return None
    steps = [RunLayout.checkpoint_step(n) for n in os.listdir(layout.checkpoints_dir)]
    complete = [s for s in sorted(x for x in steps if x is not None)
                if os.path.isfile(os.path.join(layout.checkpoint(s), "trainer_state.json"))]
    return layout.checkpoint(complete[-1]) if complete else None


def resume_path(mode: str, layout: RunLayout, setting: str = "trainer.resume_mode") -> str | None:
    """The checkpoint to resume from: 'disable' none, 'auto' the newest complete one of the run
    (if any), else `mode` is a checkpoint folder."""
    if mode == "disable":
        return None
    if mode == "auto":
        return latest_complete(layout)
    if not os.path.isdir(mode):
        raise FileNotFoundError(f"{setting}: {mode} is not a checkpoint folder")
    return mode


def _modules(model, optimizer, critic) -> dict:
    """The DCP state of the actor ("model", "optim") and of the critic ("critic", "critic_optim")."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    out = {"model": model_sd, "optim": optim_sd}
    if critic is not None:
        out["critic"], out["critic_optim"] = get_state_dict(critic.model, critic.optimizer)
    return out


def save(model, optimizer, layout: RunLayout, step: int, state: dict | None,
         pool: list[Group] | None, keep: int, critic=None) -> str:
    """Collective. `state` and `pool` are rank 0's; other ranks pass None. `critic`:
    trainer.critic.Critic or None."""
    tmp = layout.checkpoint_tmp(step)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
        os.makedirs(tmp)
    dist.barrier()
    dcp.save(_modules(model, optimizer, critic), checkpoint_id=tmp)
    final = layout.checkpoint(step)
    if dist.get_rank() == 0:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state | {"critic": critic is not None}, f)
        if pool is not None:
            samples = [s for g in pool for s in g.samples]
            with open(os.path.join(tmp, "pool.arrow"), "wb") as f:
                f.write(encode(to_table(samples)))
    dist.barrier()  # every rank's shard is on disk
    if dist.get_rank() == 0:
        fsync_tree(tmp)
        os.rename(tmp, final)
        for old in sorted(RunLayout.checkpoint_step(n) for n in os.listdir(layout.checkpoints_dir)
                          if RunLayout.checkpoint_step(n) is not None)[:-keep]:
            shutil.rmtree(layout.checkpoint(old), ignore_errors=True)
    dist.barrier()
    return final


def load(model, optimizer, path: str, critic=None) -> tuple[dict, list[Group]]:
    """Collective: restore model and optimizer (and the critic's) in place; returns
    (trainer state, pool)."""
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise FileNotFoundError(f"{path}: not a complete tandem checkpoint (no trainer_state.json)")
    with open(os.path.join(path, "trainer_state.json")) as f:
        trainer_state = json.load(f)
    if critic is not None and not trainer_state.get("critic"):
        raise ValueError(f"{path}: this run trains a critic (algorithm.adv_estimator=gae or "
                         "critic.enable) but the checkpoint has none; resume without it or "
                         "start a new run folder")
    state = _modules(model, optimizer, critic)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if critic is not None:
        set_state_dict(critic.model, critic.optimizer, model_state_dict=state["critic"],
                       optim_state_dict=state["critic_optim"])
    samples = []
    if os.path.isfile(os.path.join(path, "pool.arrow")):  # SFT checkpoints have no pool
        with open(os.path.join(path, "pool.arrow"), "rb") as f:
            samples = from_table(decode(f.read()))
    groups: dict[str, list] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    return trainer_state, [Group(gid, m[0].weight_version, m) for gid, m in groups.items()]

