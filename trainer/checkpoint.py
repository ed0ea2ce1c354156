"""Trainer checkpoints that are visible only when complete, and resumable on any number of ranks.

Every rank writes its shard of the model and optimizer (and of the critic and its optimizer, when
there is one) with torch.distributed.checkpoint into a hidden temporary folder; rank 0 adds
`trainer_state.json` (step, weight version, the experience ledger: consumed shards and reader
counters) and `pool.arrow` (groups read but not yet trained).
After a barrier, rank 0 renames the folder to `step_<N>`: that rename is the commit, so a
checkpoint killed half-written is never found by `resume_mode=auto`. DCP reshards on load, so a
run saved on 2 ranks resumes on 1 (or 4).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from buffer.checkpoints import STATE_FILE, FsCheckpoints, pool_file, state_file
from buffer.experience.reader import Group
from buffer.storage import is_disk_full
from protocol.experience import decode, encode, from_table, to_table
from trainer import lora

log = logging.getLogger(__name__)


def resume_path(mode: str, ckpts: FsCheckpoints, setting: str = "trainer.resume_mode") -> str | None:
    """The checkpoint to resume from: 'disable' none, 'auto' the newest complete one of the run
    (if any), else `mode` is a checkpoint folder."""
    if mode == "disable":
        return None
    if mode == "auto":
        return ckpts.latest_complete()
    if not os.path.isdir(mode):
        raise FileNotFoundError(f"{setting}: {mode} is not a checkpoint folder")
    return mode


def _options(model) -> StateDictOptions:
    """A LoRA model (PeftModel) saves and loads its trainable tensors only (the adapters, a
    critic's value head): the frozen base is model.path's, which the checkpoint names by
    checksum (`lora_state`)."""
    if lora.is_peft(model):
        return StateDictOptions(ignore_frozen_params=True, strict=False)
    return StateDictOptions()


def _modules(model, optimizer, critic) -> dict:
    """The DCP state of the actor ("model", "optim") and of the critic ("critic", "critic_optim")."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    out = {"model": model_sd, "optim": optim_sd}
    if critic is not None:
        out["critic"], out["critic_optim"] = get_state_dict(
            critic.model, critic.optimizer, options=_options(critic.model)
        )
    return out


def lora_state(spec, base: str | None, critic=None) -> dict:
    """What trainer_state.json records of LoRA, and a resume must match: the actor's adapter
    settings and base checksum, the critic's settings (None: full weights)."""
    critic_spec = getattr(critic, "lora", None)
    return {
        "lora": None if spec is None else spec.describe() | {"base": base},
        "critic_lora": None if critic_spec is None else critic_spec.describe(),
    }


def check_lora(path: str, saved: dict, expected: dict) -> None:
    """Refuse a checkpoint whose LoRA settings or base differ from this run's, naming both."""
    for key, setting in (("lora", "actor_rollout_ref.model"), ("critic_lora", "critic.model")):
        if saved.get(key) != expected.get(key):
            raise ValueError(
                f"{path}: saved with {key}={saved.get(key)}, this run has {expected.get(key)} "
                f"({setting}.lora_rank / lora_alpha / target_modules / exclude_modules / lora_dropout, "
                f"and the base model's checksum): resume with the same settings and base, or start a new run folder"
            )


def save(
    model,
    optimizer,
    ckpts: FsCheckpoints,
    step: int,
    state: dict | None,
    pool: list[Group] | None,
    keep: int,
    critic=None,
) -> str | None:
    """Collective. `state` and `pool` are rank 0's; other ranks pass None. `critic`:
    trainer.critic.Critic or None. Returns the committed folder, or None when the disk was full:
    the attempt is removed, training goes on and the next save tries again (retention prunes only
    after a committed checkpoint, so skipping one loses nothing)."""
    rank0 = dist.get_rank() == 0
    owner = [f"{socket.gethostname()}-{os.getpid()}" if rank0 else None]
    dist.broadcast_object_list(owner, src=0)  # every rank writes into rank 0's folder
    tmp = ckpts.tmp(step, owner[0])

    def rank0_writes(write) -> bool:
        """Run rank 0's part; every rank learns whether the disk was full."""
        full = None
        if rank0:
            try:
                write()
            except OSError as e:
                if not is_disk_full(e):
                    raise
                full = str(e)
        return _skipped(full, tmp, step)

    def fresh_folder() -> None:
        ckpts.remove_debris()
        os.makedirs(tmp)

    if rank0_writes(fresh_folder):
        return None
    try:
        dcp.save(_modules(model, optimizer, critic), checkpoint_id=tmp)
    except CheckpointException as e:  # raised on every rank, whichever failed
        full = [exc for exc, _ in e.failures.values() if _from_full_disk(exc)]
        # torch's own file writer reports a short write as a RuntimeError ("unexpected pos"),
        # not ENOSPC: rank 0 also looks at the space left, before the attempt is removed
        verdict = [str(full[0]) if full else (_nearly_full(tmp) if rank0 else None)]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is None:
            raise
        _skipped(verdict[0], tmp, step, agreed=True)
        return None

    def state_and_pool():
        with open(state_file(tmp), "w") as f:
            json.dump(state | {"critic": critic is not None}, f)
        if pool is not None:
            samples = [s for g in pool for s in g.samples]
            with open(pool_file(tmp), "wb") as f:
                f.write(encode(to_table(samples)))

    if rank0_writes(state_and_pool):  # every rank's shard is on disk once this agrees
        return None
    final = ckpts.commit(tmp, step, keep) if rank0 else ckpts.path(step)
    dist.barrier()
    return final


NEARLY_FULL_BYTES = 16 << 20  # what a failed write leaves free on a disk it filled


def _from_full_disk(exc: BaseException | None) -> bool:
    while exc is not None:
        if is_disk_full(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _nearly_full(path: str) -> str | None:
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    return f"{free} bytes left" if free < NEARLY_FULL_BYTES else None


def _skipped(full: str | None, tmp: str, step: int, agreed: bool = False) -> bool:
    """Collective unless `agreed`: True (and the attempt removed) if rank 0 found the disk full."""
    box = [full]
    if not agreed:
        dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return False
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning(
            "disk full at %s (%s): checkpoint of step %d skipped; training goes on and the next save tries again",
            tmp,
            box[0],
            step,
        )
    return True


def load(model, optimizer, path: str, critic=None, lora_expected: dict | None = None) -> tuple[dict, list[Group]]:
    """Collective: restore model and optimizer (and the critic's) in place; returns
    (trainer state, pool). `lora_expected` (`lora_state` of this run, on every rank): refused
    before anything is loaded when the checkpoint's differs."""
    if not os.path.isfile(state_file(path)):
        raise FileNotFoundError(f"{path}: not a complete tandem checkpoint (no {STATE_FILE})")
    with open(state_file(path)) as f:
        trainer_state = json.load(f)
    check_lora(path, trainer_state, lora_expected or lora_state(None, None))
    if critic is not None and not trainer_state.get("critic"):
        raise ValueError(
            f"{path}: this run trains a critic (algorithm.adv_estimator=gae or "
            "critic.enable) but the checkpoint has none; resume without it or "
            "start a new run folder"
        )
    state = _modules(model, optimizer, critic)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_options(model)
    )
    if critic is not None:
        set_state_dict(
            critic.model,
            critic.optimizer,
            model_state_dict=state["critic"],
            optim_state_dict=state["critic_optim"],
            options=_options(critic.model),
        )
    samples = []
    if os.path.isfile(pool_file(path)):  # SFT checkpoints have no pool
        with open(pool_file(path), "rb") as f:
            samples = from_table(decode(f.read()))
    groups: dict[str, list] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    return trainer_state, [Group(gid, m[0].weight_version, m, pool_path(path)) for gid, m in groups.items()]


def pool_path(checkpoint: str) -> str:
    """The file in a committed checkpoint that holds the reader's pool (its groups are read
    from there once their shards may be pruned)."""
    return pool_file(checkpoint)
