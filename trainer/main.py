"""Trainer: consume experience, take GRPO/PPO steps on an FSDP2 actor, publish weight versions.

    torchrun --nproc_per_node 2 -m trainer.main root=RUN actor_rollout_ref.model.path=MODEL

Rank 0 owns the experience reader (exactly-once consumption, staleness filter) and deals whole
groups to the ranks by name (shard or checkpoint pool file, group id, digest); each rank reads its
own; every rank trains on its share (mini-batches, epochs and micro-batches
as verl's, see trainer/update.py); with GAE a critic trains beside the actor (trainer/critic.py).
Weight versions of the actor are gathered and written by rank 0. One console line and one JSON
line per step.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from buffer.control import backpressure, sync
from buffer.experience import retention
from buffer.experience.reader import Group, read_groups
from buffer.ledger import Ledger
from buffer.run import setup_trainer_run
from buffer.storage import DISK_FULL_TIMEOUT_S, is_disk_full
from buffer.weights.fs import hf_folder_problem
from protocol.config import parse_cli, to_dict
from protocol.weights import base_checksum
from trainer import algo, checkpoint, lora, update
from trainer.batch import collate
from trainer.config import TrainerConfig, device_problem
from trainer.critic import Critic
from trainer.lifeline import die_with_agent, leave, trace_native_crashes
from trainer.lora import LoraSpec
from trainer.metrics import MetricsLog, generation_seconds, length_metrics, memory_metrics, mfu, timed
from trainer.model import adamw, build_actor, compiled_graphs, log_recompiles, packed_attention
from trainer.publish import publish_adapter, publish_version
from trainer.run_lock import RunLock, RunLocked
from trainer.validation import ValidationLog, validation_due

log = logging.getLogger("trainer")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_pref: str, timeout_s: float) -> torch.device:
    """Join the torchrun job (or form a 1-rank job when started without torchrun)."""
    if problem := device_problem(device_pref):  # one line, not CUDA's traceback
        if os.environ.get("RANK", "0") == "0":
            print(f"config error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    if "RANK" not in os.environ:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return device


def say_restart(name: str) -> None:
    """One line when torchrun has restarted this job's ranks (--max-restarts) after one died, and
    one when a restart could hang in its rendezvous: a torchrun that lends its store to the ranks
    (launch/torchrun.py says why; tandem's launchers set what prevents it)."""
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restarts not in ("", "0"):
        log.warning(
            "%s: torchrun shares its rendezvous store with the ranks and may restart them (--max-restarts "
            "%s): a restarted rank can read the dead attempt's peer address and fail or hang in its "
            "rendezvous (pytorch/pytorch#135712); start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "(tandem's launchers do: launch/torchrun.py)",
            name,
            restarts,
        )
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if count:
        log.warning(
            "%s: torchrun restart %d of %s: a rank of the earlier attempt died (its log says why); "
            "resuming from the last checkpoint",
            name,
            count,
            os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"),
        )


class StopRequested(Exception):
    """ROOT/trainer.stop appeared: checkpoint and exit (to be requeued, or stopped by hand)."""


def publishes_at(tc, step: int) -> bool:
    """Whether a version is published after `step` (`tc`: the trainer section)."""
    return step % tc.publish_freq == 0 or step == tc.total_training_steps or validation_due(tc, step, first=False)


def sync_groups(tc, train_batch_size: int, step: int) -> int:
    """Synchronous mode: the groups the trainer takes with the version published after `step`,
    one batch per step until the next publish (0 after the last step)."""
    last = tc.total_training_steps
    until = next((t for t in range(step + 1, last + 1) if publishes_at(tc, t)), step)
    return train_batch_size * (until - step)


class Trainer:
    def __init__(self, cfg: TrainerConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cfg.data.train_batch_size < self.world:
            raise ValueError(
                f"data.train_batch_size={cfg.data.train_batch_size} must be at least "
                f"the number of ranks ({self.world}): groups are not split"
            )
        torch.manual_seed(cfg.trainer.seed)
        self.model_path = os.path.expanduser(cfg.actor_rollout_ref.model.path)  # verl writes ~/models/...
        grad_ckpt = cfg.actor_rollout_ref.model.enable_gradient_checkpointing
        self.packed = cfg.actor_rollout_ref.model.use_remove_padding  # every pass: pi_old, ref, policy
        attn = packed_attention(device) if self.packed else None
        # LoRA (actor_rollout_ref.model.lora_rank > 0): adapters on the frozen base; versions are
        # the adapter alone, naming the base by its checksum (rank 0 publishes; computed once).
        self.lora = LoraSpec.of(cfg.actor_rollout_ref.model)
        self.base_checksum = base_checksum(self.model_path) if self.lora else None
        compiled = cfg.trainer.compile_layers
        if compiled:
            log_recompiles()
        self.model = build_actor(
            self.model_path,
            device,
            gradient_checkpointing=grad_ckpt,
            attn_implementation=attn,
            lora=self.lora,
            compile_layers=compiled,
            checkpoint_every=cfg.trainer.checkpoint_every,
        )
        self.use_ref = cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        # With LoRA the reference is the same model with its adapter disabled: no second copy.
        self.ref_model = (
            build_actor(self.model_path, device, trainable=False, attn_implementation=attn, compile_layers=compiled)
            if self.use_ref and self.lora is None
            else None
        )
        if self.lora is not None:
            log.info(
                "LoRA rank %d alpha %s on %d modules: %d trainable parameters of %d%s",
                self.lora.rank,
                self.lora.alpha,
                len(lora.adapted_modules(self.model)),
                sum(p.numel() for p in lora.trainable(self.model)),
                sum(p.numel() for p in self.model.parameters()),
                "; the reference is the base (adapter disabled)" if self.use_ref else "",
            )
        optim = cfg.actor_rollout_ref.actor.optim
        self.optimizer = adamw(lora.trainable(self.model), optim.lr, optim.weight_decay, optim.betas)
        self.critic = Critic(cfg.critic, device, compiled, cfg.trainer.checkpoint_every) if cfg.use_critic else None
        from verl.trainer.ppo.core_algos import get_kl_controller

        self.kl_ctrl = get_kl_controller(cfg.algorithm.kl_ctrl)  # used with use_kl_in_reward
        self.pad_id = self.model.config.pad_token_id or 0
        self.stores = setup_trainer_run(cfg.root)  # the trainer's own run folder (it serves it to others)
        self.vocab_size = self.model.config.vocab_size
        self.logprob_chunk: int | None = algo.LOGPROB_CHUNK_TOKENS
        self.logprob_compiled = compiled  # the logprob blocks' element-wise work, as the layers
        self.rank_reads = self._ranks_share_run()
        self._own: list[Group] = []  # rank 0: its own share of the step's groups
        self.store = self.stores.publisher
        self.store.publish_full_freq = cfg.trainer.publish_full_freq
        # trainer.max_staleness=0: synchronous rollouts (buffer/control/sync.py)
        self.rounds = sync.TrainerRounds(
            self.stores.sync, cfg.trainer.max_staleness == 0, self.stores.is_local(), cfg.root
        )
        self.at_published = True  # the model holds exactly the weights of `self.version`
        self.version = 0
        self.step = 0
        self.skipped_steps = self.nonfinite_in_row = 0  # steps skipped for non-finite values
        self.reader = self.metrics = None
        self._reported = (-1, 0.0)  # samples retired and time at the last progress report
        resume = self._resume_path()
        if resume is None and self.store.versions():
            if cfg.trainer.resume_mode != "auto":
                raise FileExistsError(
                    f"{self.store.dir} already holds weight "
                    "versions and trainer.resume_mode=disable: start with a new "
                    "run folder"
                )
            # Killed before its first checkpoint: start over (no shard was pruned yet, so all
            # are read again); versions keep counting, so workers see the restart as new weights.
            self.version = max(self.store.versions()) + 1
            log.warning(
                "no complete checkpoint in %s: starting again from step 0 and the initial "
                "model; weight versions continue at v%d",
                self.stores.checkpoints.dir,
                self.version,
            )
        if self.rank == 0:
            self.store.remove_debris()  # staging folders of killed publishes (we hold the run)
            if os.path.exists(self.stores.files.trainer_stop):  # addressed to an earlier trainer
                os.remove(self.stores.files.trainer_stop)
            self.reader = self.stores.reader(
                cfg.buffer,
                cfg.trainer.max_staleness,
                vocab_size=self.model.config.vocab_size,
                run_id=self.stores.state.run_id(),
            )
            self.metrics = MetricsLog(
                self.stores.files.metrics,
                cfg.trainer.total_training_steps,
                cfg.trainer.logger,
                cfg.trainer.project_name,
                cfg.trainer.experiment_name,
                to_dict(cfg),
                self.stores.files.tensorboard_dir,
                self.stores.files.swanlab_dir,
            )
        self.validation = (
            ValidationLog(self.stores.validation, self.metrics)
            if self.rank == 0 and cfg.trainer.test_freq > 0
            else None
        )
        if resume is not None:
            self._resume(resume)
        self.server = None
        if self.rank == 0:  # the run folder served to the workers, if they do not share it
            self.server = self.stores.serve(
                cfg.buffer,
                consumed=lambda: self.reader.consumed,
                retired=lambda: backpressure.retired(self.reader.stats),
                step_samples=lambda: cfg.data.train_batch_size * self.reader.stats["group_size"],
            )

    def _resume_path(self) -> str | None:
        return checkpoint.resume_path(self.cfg.trainer.resume_mode, self.stores.checkpoints)

    def _resume(self, path: str) -> None:
        """Restore weights, optimizer, step and the experience ledger; continue the version count."""
        lora_state = checkpoint.lora_state(self.lora, self.base_checksum, self.critic)
        state, pool = checkpoint.load(self.model, self.optimizer, path, self.critic, lora_state)
        self.step = state["step"]
        self.kl_ctrl.value = state.get("kl_coef", self.kl_ctrl.value)
        torch.set_rng_state(torch.tensor(state["rng"]["cpu"], dtype=torch.uint8))
        if state["rng"]["cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(torch.tensor(state["rng"]["cuda"], dtype=torch.uint8))
        # Versions published after the checkpoint by the crashed run keep their numbers; the
        # restored weights are published next under a fresh one (`run` does it first).
        versions = self.store.versions()
        self.version = max([state["version"], *versions]) + (1 if versions else 0)
        if self.rank == 0:
            self.reader.consumed = state["consumed"]  # the reader reads both ledger formats
            self.reader.stats.update(state["stats"])
            self.reader.pool.extend(pool)
        log.info("resumed from %s at step %d; publishing the restored weights as v%d", path, self.step, self.version)

    def save_checkpoint(self) -> str | None:
        state = pool = None
        if self.rank == 0:
            state = {
                "step": self.step,
                "version": self.version,
                "model_path": self.model_path,
                "rng": {
                    "cpu": torch.get_rng_state().tolist(),
                    "cuda": (torch.cuda.get_rng_state().tolist() if self.device.type == "cuda" else None),
                },
                "consumed": self.reader.consumed.to_json(),
                "stats": dict(self.reader.stats),
                "kl_coef": self.kl_ctrl.value,
                **checkpoint.lora_state(self.lora, self.base_checksum, self.critic),
            }
            pool = list(self.reader.pool)
        t0 = time.monotonic()
        path = checkpoint.save(
            self.model,
            self.optimizer,
            self.stores.checkpoints,
            self.step,
            state,
            pool,
            self.cfg.trainer.max_ckpt_to_keep,
            self.critic,
        )
        if path is None:  # disk full: skipped, nothing new is covered
            return None
        if self.rank == 0:  # pooled groups' shards may be pruned now: read them from the pool file
            for g in self.reader.pool:
                g.source = checkpoint.pool_path(path)
        log.info("checkpoint %s written in %.2f s", path, time.monotonic() - t0)
        if self.rank == 0 and self.cfg.buffer.retention != "keep":
            # Only now are the ledger's shards covered by a committed checkpoint.
            # The saved snapshot, not the live ledger (which may grow past the checkpoint).
            covered = Ledger.from_json(state["consumed"])
            pruned = retention.prune_consumed(self.stores.root, covered, mode=self.cfg.buffer.retention)
            temps = retention.clean_stale_temps(self.stores.root, self.cfg.buffer.tmp_timeout_s)
            log.info("retention: %s, %d stale temporaries removed", pruned, temps)
        return path

    # --- data: rank 0 decides, every rank reads its own whole groups --------------------------
    def _ranks_share_run(self) -> bool:
        """Collective: whether every rank sees rank 0's run folder (its run id there). Then rank 0
        sends each rank the names of its groups (GroupRef) and the rank reads them itself;
        otherwise (ranks on nodes that do not mount the folder) it sends the samples."""
        if self.world == 1:
            return True
        ids: list = [None] * self.world
        dist.all_gather_object(ids, self.stores.state.run_id())
        shared = all(i is not None and i == ids[0] for i in ids)
        if not shared and self.rank == 0:
            log.warning(
                "not every trainer rank sees %s (run ids %s): rank 0 sends each rank its samples", self.cfg.root, ids
            )
        return shared

    def next_share(self) -> tuple[list, list[int], dict]:
        """This rank's samples, the step-wide number of each one's group, and the step's info."""
        payloads = None
        if self.rank == 0:
            payloads = self._read_and_split()
        out: list = [None]
        dist.scatter_object_list(out, payloads, src=0)
        share: dict = out[0]
        if "error" in share:
            raise RuntimeError(share["error"])
        if "stop" in share:
            raise StopRequested(share["stop"])
        if "refs" in share:  # names only: read them here (rank 0 holds its own already)
            groups = self._own if self.rank == 0 else read_groups(self.cfg.root, share["refs"], self.vocab_size)
            share["samples"] = [s for g in groups for s in g.samples]
        return share["samples"], share["groups"], share.get("info", {})

    def _read_and_split(self) -> list[dict]:
        t0 = time.monotonic()
        try:
            self._check_stop()
            groups: list[Group] = self.reader.next_batch(
                self.cfg.data.train_batch_size,
                self.version,
                self.cfg.trainer.data_timeout_s,
                on_wait=self._report_and_check,
            )
        except TimeoutError as e:
            return [{"error": f"rank 0: {e}{self.rounds.why_missing(self.version)}"}] * self.world
        except StopRequested as e:  # also while waiting for experience
            return [{"stop": str(e)}] * self.world
        self._report_progress(force=True)
        samples = [s for g in groups for s in g.samples]
        info: dict[str, Any] = {"sample_ids": [s.sample_id for s in samples]} if self.cfg.trainer.log_sample_ids else {}
        info |= length_metrics("prompt_length", [len(s.prompt_ids) for s in samples], self.cfg.data.max_prompt_length)
        info["timing_s/gen"] = generation_seconds(samples)
        info |= {
            "wait_s": time.monotonic() - t0,
            "seqs": len(samples),
            "tokens": sum(len(s.response_ids) for s in samples),
            "perf/total_num_tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples),
            "reward/mean": sum(s.reward for s in samples) / len(samples),
            "staleness/mean": sum(self.version - s.weight_version for s in samples) / len(samples),
            "staleness/max": max(self.version - s.weight_version for s in samples),
            "response_length/mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "response_length/max": max(len(s.response_ids) for s in samples),
            "response_length/min": min(len(s.response_ids) for s in samples),
            "response_length/clip_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
        }
        # Group i goes to rank i % world; its number i places it in mini-batch i // mini_size.
        self._own = groups[:: self.world]
        return [
            {
                **(
                    {"refs": [g.ref() for g in groups[r :: self.world]] if r else []}
                    if self.rank_reads
                    else {"samples": [s for g in groups[r :: self.world] for s in g.samples]}
                ),
                "groups": [i for i in range(r, len(groups), self.world) for _ in groups[i].samples],
                **({"info": info} if r == 0 else {}),  # only rank 0 logs
            }
            for r in range(self.world)
        ]

    def _report_and_check(self) -> None:
        """While waiting for experience: report progress (workers' backpressure), then stop if asked."""
        self._report_progress()
        self._check_stop()

    def _check_stop(self) -> None:
        path = self.stores.files.trainer_stop
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                raise StopRequested(f"{path}: {f.read().strip() or 'stop requested'}")

    def stop_for_resume(self, why: StopRequested) -> None:
        """Collective: checkpoint now and return without DONE; a trainer started again with
        trainer.resume_mode=auto continues from this checkpoint."""
        path = self.save_checkpoint()
        if self.rank == 0:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.stores.files.trainer_stop)
        log.info(
            "%s; %s; exiting, a restart with trainer.resume_mode=auto resumes at step %d",
            why,
            f"checkpoint {path} written" if path else "NO checkpoint (disk full)",
            self.step + 1,
        )

    def _report_progress(self, force: bool = False) -> None:
        """progress.json for the workers' backpressure: at every step, and while waiting
        whenever samples were retired (dropped, quarantined) or every 10 s (alive)."""
        retired_now = backpressure.retired(self.reader.stats)
        if force or retired_now != self._reported[0] or time.monotonic() - self._reported[1] > 10:
            try:
                self.stores.progress.write(
                    backpressure.progress_report(
                        self.reader.stats,
                        self.version,
                        self.cfg.data.train_batch_size,
                        self.step,
                        self.cfg.trainer.total_training_steps,
                    )
                )
            except OSError as e:
                if not is_disk_full(e):
                    raise
                log.warning(
                    "disk full at %s: progress not reported (the next report tries again)", self.stores.progress.where()
                )
                return
            self._reported = (retired_now, time.monotonic())

    # --- one optimisation step, top to bottom ------------------------------------------------
    def train_step(self, samples: list, group_index: list[int] | None = None) -> dict:
        """`group_index`: the step-wide number of each sample's group (None: this rank's groups
        in order of appearance, numbered as rank 0 deals them)."""
        graphs = compiled_graphs() if self.cfg.trainer.compile_layers else 0
        batch = collate(samples, self.pad_id).to(self.device)
        if group_index is None:
            order = {g: i for i, g in enumerate(dict.fromkeys(batch.group_ids))}
            group_index = [order[g] * self.world + self.rank for g in batch.group_ids]
        groups = torch.tensor(group_index)

        # 1. The step's anchors at its starting weights, before any update: pi_old, pi_ref, V_old.
        actor = self.cfg.actor_rollout_ref.actor
        timing: dict[str, float] = {}
        packed = self.packed
        passes = update.plan([torch.arange(len(batch))], batch, actor, packed)[0].passes
        # pi_old from the update's own forward (None here, filled by update_actor) when that is exact
        reuse = self.old_from_update()
        old = None
        if reuse:
            timing["timing_s/old_log_prob"] = 0.0  # verl's series stays: no separate pass ran
        else:
            with timed(timing, "old_log_prob"), lora.dropout(self.model, False):
                old = update.infer(lambda c: self.logprobs(self.model, c)[0], batch, passes, packed)
        ref = values = None
        if self.use_ref:
            with timed(timing, "ref"), self.reference() as ref_model, lora.dropout(self.model, False):
                ref = update.infer(lambda c: self.logprobs(ref_model, c)[0], batch, passes, packed)
        if self.critic is not None:
            with timed(timing, "values"):
                values = self.critic.values(batch)
        # Engine/trainer mismatch on the samples of the version pi_old holds; truncated IS share.
        fresh = torch.tensor([self.at_published and s.weight_version == self.version for s in samples])

        def mismatch(old: torch.Tensor) -> dict:
            sums = algo.mismatch_sums(
                old,
                batch.behaviour_logprobs,
                batch.response_mask,
                fresh.to(self.device),
                self.cfg.algorithm.rollout_is_threshold,
            )
            return algo.mismatch_metrics(update.all_sum(sums, self.device).tolist())

        rollout = mismatch(old) if old is not None else {}

        # 2. Rewards (optionally KL-penalised) and advantages over the whole batch of all ranks.
        with timed(timing, "adv"):
            adv, returns, metrics = self.advantages(batch, groups, old, ref, values)
        metrics |= rollout

        # 3. The critic, then (after trainer.critic_warmup) the actor, as verl's fit loop.
        seed = [self.cfg.trainer.seed, self.step, self.rank]
        num_groups = self.cfg.data.train_batch_size
        if self.critic is not None:
            with timed(timing, "update_critic"):
                metrics |= self.critic.update(
                    batch,
                    groups,
                    num_groups,
                    values,
                    returns,
                    self.step,
                    self.cfg.trainer.total_training_steps,
                    seed + [1],
                )
            metrics["perf/mfu/critic"] = self.mfu(
                self.critic.model, samples, timing["timing_s/update_critic"], self.cfg.critic.ppo_epochs
            )
        if self.step >= self.cfg.trainer.critic_warmup:
            if old is None:  # filled pass by pass with the update's forwards at the starting weights
                old = torch.zeros_like(batch.response_mask, dtype=torch.float32)
            with timed(timing, "update_actor"):
                metrics |= self.update_actor(batch, groups, old, ref, adv, seed + [0], fill_old=reuse)
            metrics["perf/mfu/actor"] = self.mfu(self.model, samples, timing["timing_s/update_actor"], actor.ppo_epochs)
            if reuse:
                metrics |= mismatch(old)
        if self.cfg.trainer.compile_layers:  # graphs compiled in this step (a recompile after step 1)
            metrics["perf/compiled_graphs"] = compiled_graphs() - graphs
        return metrics | timing

    def old_from_update(self) -> bool:
        """Whether pi_old can be the update's own forward, detached (actor.old_log_prob_from_update):
        one mini-batch and one epoch (every pass runs before the only optimizer step, at the
        starting weights), the actor updated this step, no dropout in the update's forwards (the
        separate pass runs without), and no KL in the reward (the advantages need pi_old first)."""
        actor, cfg = self.cfg.actor_rollout_ref.actor, self.cfg
        one_step = actor.ppo_epochs == 1 and cfg.data.train_batch_size == actor.ppo_mini_batch_size
        dropout = (self.lora is not None and self.lora.dropout > 0) or float(
            getattr(self.model.config, "attention_dropout", 0.0) or 0.0
        ) > 0
        return (
            actor.old_log_prob_from_update
            and one_step
            and not dropout
            and not cfg.algorithm.use_kl_in_reward
            and self.step >= cfg.trainer.critic_warmup
        )

    def reference(self):
        """The reference policy for pi_ref: the frozen copy, or with LoRA the base (adapter off)."""
        return contextlib.nullcontext(self.ref_model) if self.ref_model is not None else lora.reference(self.model)

    def logprobs(self, model, batch, **kwargs):
        """algo.response_logprobs, chunked by `self.logprob_chunk` tokens (None: full logits,
        the path before issue 25, which benchmarks/trainer_bench.py sets to compare), each
        block's element-wise work compiled with trainer.compile_layers."""
        return algo.response_logprobs(model, batch, chunk=self.logprob_chunk, compiled=self.logprob_compiled, **kwargs)

    def mfu(self, model, samples: list, seconds: float, epochs: int) -> float:
        """verl's perf/mfu/<role>: the mean over ranks of each rank's MFU of an update (epochs
        passes over its samples in `seconds`). Collective."""
        seqlens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        mine = mfu(model.config, seqlens, seconds, epochs, self.device)
        return float(update.all_sum(torch.tensor([mine]), self.device)) / self.world

    def advantages(self, batch, groups, old, ref, values) -> tuple:
        """(advantages, returns) of this rank's rows, (B, R) each, and verl's data metrics.
        Estimators whiten over the batch (gae, reinforce_plus_plus) or per group, so the
        inputs of every rank are gathered and each rank computes the same global result."""
        alg = self.cfg.algorithm
        mask = batch.response_mask
        local = {"scores": batch.token_level_rewards, "mask": mask, "old": old, "ref": ref, "values": values}
        names = [
            "scores",
            "mask",
            *(["old", "ref"] if alg.use_kl_in_reward else []),
            *(["values"] if values is not None else []),
        ]
        glob, first = update.gather_rows(torch.stack([local[n] for n in names]))
        g = dict(zip(names, glob))
        index, _ = update.gather_rows(groups.to(self.device).view(1, -1, 1))
        metrics: dict[str, Any] = {}
        rewards = g["scores"]
        if alg.use_kl_in_reward:
            rewards, metrics = algo.kl_in_reward(
                g["scores"], g["old"], g["ref"], g["mask"], alg.kl_penalty, self.kl_ctrl
            )
        adv, returns = algo.compute_advantage(alg, rewards, g["mask"], index.flatten().cpu().numpy(), g.get("values"))
        metrics |= algo.data_metrics(g["scores"], rewards, adv, returns, g.get("values"), g["mask"])
        rows, r = slice(first, first + len(batch)), mask.shape[1]
        return adv[rows, :r], returns[rows, :r], metrics

    def update_actor(self, batch, groups, old, ref, adv, seed: list[int], fill_old: bool = False) -> dict:
        """Clipped policy gradient per mini-batch and epoch, truncated-IS weighted, plus the
        optional KL and entropy terms; verl's actor/* metrics. `fill_old` (old_from_update):
        each pass's logprobs, detached, are its pi_old, written into `old` (B, R)."""
        actor = self.cfg.actor_rollout_ref.actor
        rows = update.epochs(
            groups, actor.ppo_mini_batch_size, self.cfg.data.train_batch_size, actor.ppo_epochs, actor.shuffle, seed
        )
        minibatches = update.plan(rows, batch, actor, self.packed)

        def loss_fn(idx, mb):
            c = update.micro(batch, idx, self.packed)
            r = c.response_mask.shape[1]
            old_lp = old[idx, :r]
            loss_cfg = algo.actor_loss_config(actor, self.world, mb.tokens, mb.seqs)
            # verl logs the entropy whatever entropy_coeff; it enters the loss only with a coeff
            lp, entropy = self.logprobs(self.model, c, with_entropy=True, entropy_grad=actor.entropy_coeff > 0)
            if fill_old:  # a padding pass rewrites row 0 with its own value: the same weights
                old[idx, :r] = lp.detach()
                old_lp = old[idx, :r]
            w = algo.truncated_is_weights(
                old_lp, c.behaviour_logprobs, c.response_mask, self.cfg.algorithm.rollout_is_threshold
            )
            pg, m = algo.policy_loss(old_lp, lp, adv[idx, :r], c.response_mask, w, loss_cfg)
            kl, ent = algo.kl_and_entropy_terms(
                lp,
                ref[idx, :r] if ref is not None else None,
                entropy,
                c.response_mask,
                actor.kl_loss_type,
                actor.loss_agg_mode,
                loss_cfg,
            )
            loss = (
                pg
                + (actor.kl_loss_coef * kl if kl is not None else 0.0)
                - (actor.entropy_coeff * ent if actor.entropy_coeff > 0 else 0.0)
            )
            n = float(c.response_mask.sum())
            return loss, [
                pg.item(),
                m["actor/ppo_kl"] * n,
                m["actor/pg_clipfrac"] * n,
                m["actor/pg_clipfrac_lower"] * n,
                float(w.sum()),
                kl.item() if kl is not None else 0.0,
                ent.item() if ent is not None else 0.0,
                n,
            ]

        # The schedule counts the trainer steps that updated the actor (verl steps it once per
        # update_actor call), so critic warmup does not eat the actor's lr warmup.
        updates = self.step - max(self.cfg.trainer.critic_warmup, 1) + 1
        lr = algo.lr_at(
            updates,
            self.cfg.trainer.total_training_steps,
            actor.optim.lr,
            actor.optim.lr_warmup_steps_ratio,
            actor.optim.warmup_style,
            actor.optim.min_lr_ratio,
        )
        with lora.dropout_active(self.model, self.lora):
            totals, norms = update.optimize(self.model, self.optimizer, minibatches, lr, actor.grad_clip, loss_fn)
        pg, ppo_kl, clipfrac, lower, w, kl, ent, tokens = update.all_sum(totals, self.device).tolist()
        # Loss terms: each pass is scaled by world / (mini-batch tokens), so a mini-batch's sum
        # over ranks is world x its loss; reported as the mean over optimizer steps.
        steps = self.world * len(minibatches)
        return {
            "actor/pg_loss": pg / steps,
            "actor/ppo_kl": ppo_kl / tokens,
            "actor/pg_clipfrac": clipfrac / tokens,
            "actor/pg_clipfrac_lower": lower / tokens,
            "actor/is_weight_mean": w / tokens,
            "actor/kl_loss": kl / steps,
            "actor/entropy": ent / steps,
            "actor/lr": lr,
            "actor/grad_norm": sum(norms) / len(norms),
            "actor/optimizer_steps": len(norms),
            # optimize() skipped these: a non-finite (global) gradient norm
            "actor/skipped_nonfinite": sum(not math.isfinite(n) for n in norms),
        }

    def count_nonfinite(self, step: int, metrics: dict) -> None:
        """Count a step with skipped optimizer steps, actor's or critic's (actor/skipped_steps);
        stop after max_nonfinite_steps in a row. Every rank sees the same all-reduced grad
        norms, so every rank stops at the same step."""
        skipped = metrics.get("actor/skipped_nonfinite", 0) + metrics.get("critic/skipped_nonfinite", 0)
        if not skipped:
            self.nonfinite_in_row = 0
        else:
            self.skipped_steps += 1
            self.nonfinite_in_row += 1
            if self.rank == 0:
                log.warning(
                    "step %d skipped: non-finite loss or gradient (actor loss %s, grad "
                    "norm %s; critic grad norm %s): %d optimizer steps left the weights as "
                    "they were (%d such trainer steps in a row)",
                    step,
                    metrics.get("actor/pg_loss"),
                    metrics.get("actor/grad_norm"),
                    metrics.get("critic/grad_norm"),
                    skipped,
                    self.nonfinite_in_row,
                )
        metrics["actor/skipped_steps"] = self.skipped_steps

    def check_nonfinite_limit(self, step: int, metrics: dict) -> None:
        limit = self.cfg.trainer.max_nonfinite_steps
        if self.nonfinite_in_row >= limit:
            raise RuntimeError(
                f"stopping at step {step}: {limit} steps in a row had a non-finite loss or gradient "
                f"(last: actor loss {metrics.get('actor/pg_loss')}, grad norm "
                f"{metrics.get('actor/grad_norm')}, lr {metrics.get('actor/lr')}; critic grad norm "
                f"{metrics.get('critic/grad_norm')}); the published weights are finite. Lower "
                "actor_rollout_ref.actor.optim.lr (critic.optim.lr with a critic) or check the experience "
                "(trainer.max_nonfinite_steps)"
            )

    def publish(self, step: int) -> dict:
        # A finite loss and gradient can still overflow the weights (an absurd lr): never
        # publish them. One pass over the local shards, one all-reduce.
        bad = torch.zeros(1, device=self.device)
        for p in lora.trainable(self.model):  # a frozen base cannot have changed
            local = p.to_local() if hasattr(p, "to_local") else p
            bad += (~torch.isfinite(local.detach())).sum()
        dist.all_reduce(bad)
        if bad.item():
            raise RuntimeError(
                f"refusing to publish weight version {self.version} after step "
                f"{step}: {int(bad.item())} weights are not finite"
            )
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            self.cfg.trainer.publish_dtype, torch.bfloat16 if self.device.type == "cuda" else torch.float32
        )
        groups = sync_groups(self.cfg.trainer, self.cfg.data.train_batch_size, step)
        announce = self.rounds.announce(self.version, groups, opener=self.rank == 0)
        if self.lora is not None:
            out = publish_adapter(
                self.model,
                self.store,
                self.model_path,
                self.version,
                step,
                self.cfg.trainer.keep_versions,
                self.base_checksum,
                dtype,
                announce,
            )
        else:
            out = publish_version(
                self.model,
                self.store,
                self.model_path,
                self.version,
                step,
                self.cfg.trainer.keep_versions,
                dtype,
                announce,
            )
        self.rounds.published(self.version, opener=self.rank == 0)
        if self.server is not None:
            self.server.published(self.version)
        self.at_published = True
        return out

    def request_validation(self, step: int, due: bool) -> None:
        """Ask rollout.validate for the version just published (rank 0; never waits)."""
        if due and self.validation is not None:
            self.validation.request(self.version, step)

    def run(self) -> None:
        tc = self.cfg.trainer
        # v0 (or, on resume, the restored weights): every sample names a published version.
        self.publish(step=self.step)
        self.request_validation(self.step, validation_due(tc, self.step, first=True))
        for step in range(self.step + 1, tc.total_training_steps + 1):
            self.step = step
            t0 = time.monotonic()
            try:
                samples, groups, info = self.next_share()
            except StopRequested as e:
                self.step = step - 1  # this step has not been taken
                self.stop_for_resume(e)
                return
            metrics: dict[str, Any] = {"step": step, "weights/version": self.version}
            metrics.update(self.train_step(samples, groups))
            self.count_nonfinite(step, metrics)
            self.at_published = False
            validate = validation_due(tc, step, first=False)
            if publishes_at(tc, step):
                self.version += 1
                with timed(metrics, "update_weights"):
                    metrics.update(self.publish(step))
                self.request_validation(step, validate)
            if self.rank == 0:
                metrics.update({k: v for k, v in info.items() if k not in ("wait_s", "seqs", "tokens")})
                if "sample_ids" in metrics:
                    metrics["samples/ids"] = metrics.pop("sample_ids")
                step_s = time.monotonic() - t0
                metrics.update(
                    {
                        "timing_s/step": step_s,
                        "perf/time_per_step": step_s,
                        "perf/throughput": info["perf/total_num_tokens"] / (step_s * self.world),
                        **memory_metrics(self.device),
                        "samples/consumed": self.reader.stats["consumed_samples"],
                        "samples/step": info["seqs"],
                        "tokens/step": info["tokens"],
                        "time/wait_s": info["wait_s"],
                        "time/step_s": step_s,
                        "time/wait_fraction": info["wait_s"] / step_s,
                        "time/unix": time.time(),
                        "buffer/dropped_stale_samples": self.reader.stats["dropped_stale_samples"],
                        "buffer/bad_shards": self.reader.stats["bad_shards"],
                        "buffer/declared_lost_shards": self.reader.stats["declared_lost_shards"],
                    }
                )
                self.metrics.write(metrics)
                if self.validation is not None:
                    self.validation.collect(step)
            self.check_nonfinite_limit(step, metrics)
            if tc.save_freq > 0 and step % tc.save_freq == 0:
                self.save_checkpoint()
        if self.validation is not None:
            self.validation.finish(tc.val_timeout_s, self.step)
        if self.rank == 0:
            self.stores.state.mark_done({"steps": tc.total_training_steps, "version": self.version})

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.stop()
        if self.reader is not None:
            self.reader.close()
        if self.metrics is not None:
            self.metrics.close()


def main(argv: list[str] | None = None) -> int:
    die_with_agent()
    trace_native_crashes()
    cfg = parse_cli(
        TrainerConfig,
        argv,
        "python -m trainer.main",
        "Trainer: consumes experience shards, runs GRPO/PPO steps on an FSDP2 actor, "
        "and publishes weight versions for the rollout workers. Run under torchrun.",
    )
    if problem := hf_folder_problem(cfg.actor_rollout_ref.model.path):  # before loading anything
        print(f"python -m trainer.main: actor_rollout_ref.model.path: {problem}", file=sys.stderr)
        return 2
    # Collectives wait out the slowest rank: one waiting for experience or for disk space.
    device = init_distributed(cfg.trainer.device, max(cfg.trainer.data_timeout_s, DISK_FULL_TIMEOUT_S) + 600)
    logging.basicConfig(
        level=logging.INFO if dist.get_rank() == 0 else logging.WARNING,
        stream=sys.stdout,
        format=f"%(asctime)s %(levelname)s trainer[{dist.get_rank()}] %(message)s",
    )
    if dist.get_rank() == 0:
        say_restart("trainer")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        lock = hold_run(cfg.root)
    except RunLocked as e:
        log.error("%s", e)
        dist.destroy_process_group()
        return 1
    try:
        trainer = Trainer(cfg, device)
        try:
            trainer.run()
        finally:
            trainer.close()
    finally:
        if lock is not None:
            lock.release()
        dist.destroy_process_group()
    return 0


def hold_run(root: str) -> RunLock | None:
    """Collective: rank 0 takes the run's lock before anything touches the run folder (and
    gives the folder a run id if it has none); every rank fails with the holder named when
    another trainer has it."""
    lock = None
    refused: list[str | None] = [None]
    if dist.get_rank() == 0:
        run = setup_trainer_run(root)
        try:
            lock = RunLock.acquire(run)
        except RunLocked as e:
            refused = [str(e)]
        else:
            run.state.ensure_run_id()
    dist.broadcast_object_list(refused, src=0)
    if refused[0] is not None:
        raise RunLocked(refused[0])
    return lock


if __name__ == "__main__":
    leave(main())
