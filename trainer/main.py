"""Trainer: consume experience, take GRPO/PPO steps on an FSDP2 actor, publish weight versions.

    torchrun --nproc_per_node 2 -m trainer.main root=RUN actor_rollout_ref.model.path=MODEL

Rank 0 owns the experience reader (exactly-once consumption, staleness filter) and scatters
whole groups to the ranks; every rank trains on its share; weight versions are gathered and
written by rank 0. One console line and one JSON line per step.
"""
from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from buffer import retention
from buffer.ledger import Ledger
from buffer.reader import ExperienceReader, Group
from buffer.storage import atomic_write_json, filesystem
from buffer.weights import WeightStore, hf_folder_problem
from protocol.config import parse_cli, to_dict
from trainer import algo, checkpoint
from trainer.batch import collate
from trainer.config import TrainerConfig
from trainer.metrics import MetricsLog
from trainer.model import build_actor
from trainer.publish import publish_version

log = logging.getLogger("trainer")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_pref: str, timeout_s: float) -> torch.device:
    """Join the torchrun job (or form a 1-rank job when started without torchrun)."""
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s))
    return device


class Trainer:
    def __init__(self, cfg: TrainerConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cfg.data.train_batch_size < self.world:
            raise ValueError(f"data.train_batch_size={cfg.data.train_batch_size} must be at least "
                             f"the number of ranks ({self.world}): groups are not split")
        torch.manual_seed(cfg.trainer.seed)
        self.model_path = cfg.actor_rollout_ref.model.path
        grad_ckpt = cfg.actor_rollout_ref.model.enable_gradient_checkpointing
        self.model = build_actor(self.model_path, device, gradient_checkpointing=grad_ckpt)
        self.ref_model = (build_actor(self.model_path, device, trainable=False)
                          if cfg.actor_rollout_ref.actor.use_kl_loss else None)
        optim = cfg.actor_rollout_ref.actor.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr,
                                           weight_decay=optim.weight_decay, betas=tuple(optim.betas))
        self.pad_id = self.model.config.pad_token_id or 0
        self.store = WeightStore(cfg.root)
        self.fs, _ = filesystem(cfg.root)
        self.version = 0
        self.step = 0
        self.skipped_steps = self.nonfinite_in_row = 0  # steps skipped for non-finite values
        self.reader = self.metrics = None
        resume = self._resume_path()
        if self.rank == 0:
            if resume is None and self.store.versions():
                raise FileExistsError(f"{self.store.layout.weights_dir} already holds weight versions "
                                      "but there is no checkpoint to resume from; start with a new "
                                      "run folder")
            self.reader = ExperienceReader(cfg.root, cfg.buffer, cfg.trainer.max_staleness,
                                           vocab_size=self.model.config.vocab_size)
            self.metrics = MetricsLog(self.store.layout.metrics, cfg.trainer.total_training_steps,
                                      cfg.trainer.logger, cfg.trainer.project_name,
                                      cfg.trainer.experiment_name, to_dict(cfg),
                                      self.store.layout.tensorboard_dir)
        if resume is not None:
            self._resume(resume)
        self.server = None
        if self.rank == 0 and cfg.buffer.transport == "grpc":
            from buffer.grpc_transport import ShardServer
            self.server = ShardServer(cfg.root, cfg.buffer, consumed=lambda: self.reader.consumed)

    def _resume_path(self) -> str | None:
        mode = self.cfg.trainer.resume_mode
        if mode == "disable":
            return None
        if mode == "auto":
            return checkpoint.latest_complete(self.store.layout)
        if not os.path.isdir(mode):
            raise FileNotFoundError(f"trainer.resume_mode: {mode} is not a checkpoint folder")
        return mode

    def _resume(self, path: str) -> None:
        """Restore weights, optimizer, step and the experience ledger; continue the version count."""
        state, pool = checkpoint.load(self.model, self.optimizer, path)
        self.step = state["step"]
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
        log.info("resumed from %s at step %d; publishing the restored weights as v%d",
                 path, self.step, self.version)

    def save_checkpoint(self) -> None:
        state = pool = None
        if self.rank == 0:
            state = {"step": self.step, "version": self.version, "model_path": self.model_path,
                     "rng": {"cpu": torch.get_rng_state().tolist(),
                             "cuda": (torch.cuda.get_rng_state().tolist()
                                      if self.device.type == "cuda" else None)},
                     "consumed": self.reader.consumed.to_json(), "stats": dict(self.reader.stats)}
            pool = list(self.reader.pool)
        t0 = time.monotonic()
        path = checkpoint.save(self.model, self.optimizer, self.store.layout, self.step, state, pool,
                               self.cfg.trainer.max_ckpt_to_keep)
        log.info("checkpoint %s written in %.2f s", path, time.monotonic() - t0)
        if self.rank == 0 and self.cfg.buffer.retention != "keep":
            # Only now are the ledger's shards covered by a committed checkpoint.
            # The saved snapshot, not the live ledger (which may grow past the checkpoint).
            covered = Ledger.from_json(state["consumed"])
            pruned = retention.prune_consumed(self.cfg.root, covered, mode=self.cfg.buffer.retention)
            temps = retention.clean_stale_temps(self.cfg.root, self.cfg.buffer.tmp_timeout_s)
            log.info("retention: %s, %d stale temporaries removed", pruned, temps)

    # --- data: rank 0 reads, every rank gets whole groups ------------------------------------
    def next_share(self) -> tuple[list, dict]:
        payloads = None
        if self.rank == 0:
            payloads = self._read_and_split()
        out = [None]
        dist.scatter_object_list(out, payloads, src=0)
        share = out[0]
        if "error" in share:
            raise RuntimeError(share["error"])
        return share["samples"], share["info"]

    def _read_and_split(self) -> list[dict]:
        t0 = time.monotonic()
        try:
            groups: list[Group] = self.reader.next_batch(
                self.cfg.data.train_batch_size, self.version, self.cfg.trainer.data_timeout_s)
        except TimeoutError as e:
            return [{"error": f"rank 0: {e}"}] * self.world
        stats = self.reader.stats
        atomic_write_json(self.fs, self.store.layout.progress, {
            "samples_retired": stats["consumed_samples"] + stats["dropped_stale_samples"],
            "version": self.version, "time": time.time()})
        samples = [s for g in groups for s in g.samples]
        info = {"sample_ids": [s.sample_id for s in samples]} if self.cfg.trainer.log_sample_ids else {}
        info |= {
            "wait_s": time.monotonic() - t0,
            "seqs": len(samples),
            "tokens": sum(len(s.response_ids) for s in samples),
            "reward/mean": sum(s.reward for s in samples) / len(samples),
            "staleness/mean": sum(self.version - s.weight_version for s in samples) / len(samples),
            "staleness/max": max(self.version - s.weight_version for s in samples),
            "response_length/mean": sum(len(s.response_ids) for s in samples) / len(samples),
        }
        return [{"samples": [s for g in groups[r::self.world] for s in g.samples], "info": info}
                for r in range(self.world)]

    # --- one optimisation step, top to bottom ------------------------------------------------
    def micro_batches(self, batch) -> list:
        """Row spans per forward/backward, by sample count or token budget. Every rank runs the
        same number (FSDP's all-gathers and reduce-scatters must pair up), so shorter lists are
        padded with None: a zero-weight pass."""
        actor = self.cfg.actor_rollout_ref.actor
        spans, start = [], 0
        lengths = batch.attention_mask.sum(1).tolist()
        while start < len(batch):
            stop = start + 1
            if actor.use_dynamic_bsz:  # padded cost: rows x longest row
                while stop < len(batch) and (stop + 1 - start) * max(lengths[start:stop + 1]) \
                        <= actor.ppo_max_token_len_per_gpu:
                    stop += 1
            else:
                stop = min(len(batch), start + actor.ppo_micro_batch_size_per_gpu)
            spans.append((start, stop))
            start = stop
        count = torch.tensor([len(spans)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return spans + [None] * (int(count) - len(spans))

    def train_step(self, samples: list, info: dict) -> dict:
        actor = self.cfg.actor_rollout_ref.actor
        algorithm = self.cfg.algorithm
        batch = collate(samples, self.pad_id).to(self.device)
        spans = self.micro_batches(batch)
        # A None span re-runs row 0 with weight 0, only to keep the collectives in step.
        chunks = [(batch.rows(*sp).trimmed(), 1.0) if sp else (batch.rows(0, 1).trimmed(), 0.0)
                  for sp in spans]

        # 1. pi_old: the current weights' logprobs before the update (the PPO anchor); pi_ref.
        with torch.no_grad():
            old = [algo.response_logprobs(self.model, c)[0] for c, _ in chunks]
            ref = [algo.response_logprobs(self.ref_model, c)[0] if self.ref_model else None
                   for c, _ in chunks]

        # 2. Group-relative advantages; a group never spans ranks, so this is local.
        adv = algo.advantages(batch, algorithm.adv_estimator, algorithm.norm_adv_by_std_in_grpo)

        # 3. Clipped policy gradient, truncated-IS weighted, accumulated over micro-batches,
        #    plus the optional KL and entropy terms. agg_loss normalises by the global token
        #    count, so the accumulated gradient is that of the global mean.
        loss_cfg = algo.actor_loss_config(actor.clip_ratio, self.world, info["tokens"], info["seqs"])
        totals = torch.zeros(6, dtype=torch.float64, device=self.device)  # NCCL reduces on GPU
        for (c, weight), old_lp, ref_lp, sp in zip(chunks, old, ref, spans):
            rows = slice(*sp) if sp else slice(0, 1)
            a = adv[rows, :c.response_mask.shape[1]]
            lp, entropy = algo.response_logprobs(self.model, c, with_entropy=actor.entropy_coeff > 0)
            w = algo.truncated_is_weights(old_lp, c.behaviour_logprobs, c.response_mask,
                                          algorithm.rollout_is_threshold)
            pg, m = algo.policy_loss(old_lp, lp, a, c.response_mask, w, actor.loss_agg_mode, loss_cfg)
            kl, ent = algo.kl_and_entropy_terms(lp, ref_lp, entropy, c.response_mask,
                                                actor.kl_loss_type, actor.loss_agg_mode, loss_cfg)
            loss = pg + (actor.kl_loss_coef * kl if kl is not None else 0.0) \
                - (actor.entropy_coeff * ent if ent is not None else 0.0)
            (loss * weight).backward()
            n_tok = float(c.response_mask.sum())
            totals += weight * torch.tensor(
                [pg.item(), m["actor/ppo_kl"] * n_tok, m["actor/pg_clipfrac"] * n_tok,
                 float(w.sum()), kl.item() if kl is not None else 0.0,
                 ent.item() if ent is not None else 0.0], dtype=torch.float64, device=self.device)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), actor.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        lr = algo.lr_at(self.step, self.cfg.trainer.total_training_steps, actor.optim.lr,
                        actor.optim.lr_warmup_steps_ratio, actor.optim.warmup_style,
                        actor.optim.min_lr_ratio)
        # 4. Metrics: sum over ranks (gloo has no AVG); loss sums are already dp-scaled. Reduced
        #    before the update so every rank sees the same numbers and skips the same steps:
        #    a non-finite loss or (global) gradient norm never reaches the weights.
        dist.all_reduce(totals)
        finite = math.isfinite(grad_norm) and bool(torch.isfinite(totals).all())
        if finite:
            for group in self.optimizer.param_groups:
                group["lr"] = lr  # a function of the step: nothing to restore on resume
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = info["tokens"]
        return {"actor/pg_loss": totals[0].item() / self.world,
                "actor/ppo_kl": totals[1].item() / tokens,
                "actor/pg_clipfrac": totals[2].item() / tokens,
                "actor/is_weight_mean": totals[3].item() / tokens,
                "actor/kl_loss": totals[4].item() / self.world,
                "actor/entropy": totals[5].item() / self.world,
                "actor/lr": lr,
                "actor/grad_norm": grad_norm,
                "actor/skipped_nonfinite": int(not finite)}

    def count_nonfinite(self, step: int, metrics: dict) -> None:
        """Count a skipped step (actor/skipped_steps); stop after max_nonfinite_steps in a row.
        Every rank sees the same all-reduced metrics, so every rank stops at the same step."""
        if not metrics["actor/skipped_nonfinite"]:
            self.nonfinite_in_row = 0
        else:
            self.skipped_steps += 1
            self.nonfinite_in_row += 1
            if self.rank == 0:
                log.warning("step %d skipped: non-finite loss or gradient (loss %s, grad norm %s); "
                            "the weights were not updated (%d in a row)", step,
                            metrics["actor/pg_loss"], metrics["actor/grad_norm"], self.nonfinite_in_row)
        metrics["actor/skipped_steps"] = self.skipped_steps

    def check_nonfinite_limit(self, step: int, metrics: dict) -> None:
        limit = self.cfg.trainer.max_nonfinite_steps
        if self.nonfinite_in_row >= limit:
            raise RuntimeError(
                f"stopping at step {step}: {limit} steps in a row had a non-finite loss or gradient "
                f"(last: loss {metrics['actor/pg_loss']}, grad norm {metrics['actor/grad_norm']}, "
                f"lr {metrics['actor/lr']:g}); the published weights are finite. Lower "
                "actor_rollout_ref.actor.optim.lr or check the experience (trainer.max_nonfinite_steps)")

    def publish(self, step: int) -> dict:
        # A finite loss and gradient can still overflow the weights (an absurd lr): never
        # publish them. One pass over the local shards, one all-reduce.
        bad = torch.zeros(1, device=self.device)
        for p in self.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            bad += (~torch.isfinite(local.detach())).sum()
        dist.all_reduce(bad)
        if bad.item():
            raise RuntimeError(f"refusing to publish weight version {self.version} after step "
                               f"{step}: {int(bad.item())} weights are not finite")
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            self.cfg.trainer.publish_dtype, torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        return publish_version(self.model, self.store, self.model_path, self.version, step,
                               self.cfg.trainer.keep_versions, dtype)

    def run(self) -> None:
        tc = self.cfg.trainer
        # v0 (or, on resume, the restored weights): every sample names a published version.
        self.publish(step=self.step)
        for step in range(self.step + 1, tc.total_training_steps + 1):
            self.step = step
            t0 = time.monotonic()
            samples, info = self.next_share()
            metrics = {"step": step, "weights/version": self.version}
            metrics.update(self.train_step(samples, info))
            self.count_nonfinite(step, metrics)
            if step % tc.publish_freq == 0 or step == tc.total_training_steps:
                self.version += 1
                metrics.update(self.publish(step))
            if self.rank == 0:
                metrics.update({k: v for k, v in info.items() if k not in ("wait_s", "seqs", "tokens")})
                if "sample_ids" in metrics:
                    metrics["samples/ids"] = metrics.pop("sample_ids")
                metrics.update({"samples/consumed": self.reader.stats["consumed_samples"],
                                "samples/step": info["seqs"],
                                "tokens/step": info["tokens"], "time/wait_s": info["wait_s"],
                                "time/step_s": time.monotonic() - t0, "time/unix": time.time(),
                                "buffer/dropped_stale_samples": self.reader.stats["dropped_stale_samples"],
                                "buffer/bad_shards": self.reader.stats["bad_shards"]})
                self.metrics.write(metrics)
            self.check_nonfinite_limit(step, metrics)
            if tc.save_freq and step % tc.save_freq == 0:
                self.save_checkpoint()
        if self.rank == 0:
            atomic_write_json(self.fs, self.store.layout.done_marker,
                              {"steps": tc.total_training_steps, "version": self.version})

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.stop()
        if self.reader is not None:
            self.reader.close()
        if self.metrics is not None:
            self.metrics.close()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(TrainerConfig, argv, "python -m trainer.main",
                    "Trainer: consumes experience shards, runs GRPO/PPO steps on an FSDP2 actor, "
                    "and publishes weight versions for the rollout workers. Run under torchrun.")
    if problem := hf_folder_problem(cfg.actor_rollout_ref.model.path):  # before loading anything
        print(f"python -m trainer.main: actor_rollout_ref.model.path: {problem}", file=sys.stderr)
        return 2
    device = init_distributed(cfg.trainer.device, cfg.trainer.data_timeout_s + 600)
    logging.basicConfig(level=logging.INFO if dist.get_rank() == 0 else logging.WARNING,
                        stream=sys.stdout, format=f"%(asctime)s %(levelname)s trainer[{dist.get_rank()}] %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    trainer = Trainer(cfg, device)
    try:
        trainer.run()
    finally:
        trainer.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
