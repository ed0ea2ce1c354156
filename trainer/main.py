"""Trainer: consume experience, take GRPO/PPO steps on an FSDP2 actor, publish weight versions.

    torchrun --nproc_per_node 2 -m trainer.main root=RUN actor_rollout_ref.model.path=MODEL

Rank 0 owns the experience reader (exactly-once consumption, staleness filter) and scatters
whole groups to the ranks; every rank trains on its share; weight versions are gathered and
written by rank 0. One console line and one JSON line per step.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from buffer.reader import ExperienceReader, Group
from buffer.storage import atomic_write_json, filesystem
from buffer.weights import WeightStore
from protocol.config import parse_cli
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
        self.model = build_actor(self.model_path, device)
        optim = cfg.actor_rollout_ref.actor.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr,
                                           weight_decay=optim.weight_decay, betas=tuple(optim.betas))
        self.pad_id = self.model.config.pad_token_id or 0
        self.store = WeightStore(cfg.root)
        self.fs, _ = filesystem(cfg.root)
        self.version = 0
        self.step = 0
        self.reader = self.metrics = None
        resume = self._resume_path()
        if self.rank == 0:
            if resume is None and self.store.versions():
                raise FileExistsError(f"{self.store.layout.weights_dir} already holds weight versions "
                                      "but there is no checkpoint to resume from; start with a new "
                                      "run folder")
            self.reader = ExperienceReader(cfg.root, cfg.buffer, cfg.trainer.max_staleness)
            self.metrics = MetricsLog(self.store.layout.metrics, cfg.trainer.total_training_steps)
        if resume is not None:
            self._resume(resume)

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
        # Versions published after the checkpoint by the crashed run keep their numbers; the
        # restored weights are published next under a fresh one (`run` does it first).
        versions = self.store.versions()
        self.version = max([state["version"], *versions]) + (1 if versions else 0)
        if self.rank == 0:
            self.reader.consumed = set(state["consumed"])
            self.reader.stats.update(state["stats"])
            self.reader.pool.extend(pool)
        log.info("resumed from %s at step %d; publishing the restored weights as v%d",
                 path, self.step, self.version)

    def save_checkpoint(self) -> None:
        state = pool = None
        if self.rank == 0:
            state = {"step": self.step, "version": self.version, "model_path": self.model_path,
                     "consumed": sorted(self.reader.consumed), "stats": dict(self.reader.stats)}
            pool = list(self.reader.pool)
        t0 = time.monotonic()
        path = checkpoint.save(self.model, self.optimizer, self.store.layout, self.step, state, pool,
                               self.cfg.trainer.max_ckpt_to_keep)
        log.info("checkpoint %s written in %.2f s", path, time.monotonic() - t0)

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
        info = {
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
    def train_step(self, samples: list, info: dict) -> dict:
        actor = self.cfg.actor_rollout_ref.actor
        algorithm = self.cfg.algorithm
        batch = collate(samples, self.pad_id).to(self.device)
        micro = actor.ppo_micro_batch_size_per_gpu
        chunks = [batch.rows(i, i + micro) for i in range(0, len(batch), micro)]

        # 1. pi_old: the current weights' logprobs before the update (the PPO anchor).
        with torch.no_grad():
            old = [algo.response_logprobs(self.model, c) for c in chunks]

        # 2. Group-relative advantages; a group never spans ranks, so this is local.
        adv = algo.advantages(batch, algorithm.adv_estimator, algorithm.norm_adv_by_std_in_grpo)

        # 3. Clipped policy gradient, truncated-IS weighted, accumulated over micro-batches.
        #    agg_loss normalises by the global token count, so the sum is the global mean.
        loss_cfg = algo.actor_loss_config(actor.clip_ratio, self.world, info["tokens"], info["seqs"])
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)  # NCCL reduces on GPU
        for c, old_lp, a in zip(chunks, old, adv.split(micro)):
            lp = algo.response_logprobs(self.model, c)
            w = algo.truncated_is_weights(old_lp, c.behaviour_logprobs, c.response_mask,
                                          algorithm.rollout_is_threshold)
            loss, m = algo.policy_loss(old_lp, lp, a, c.response_mask, w, actor.loss_agg_mode, loss_cfg)
            loss.backward()
            n_tok = float(c.response_mask.sum())
            totals += torch.tensor([loss.item(), m["actor/ppo_kl"] * n_tok,
                                    m["actor/pg_clipfrac"] * n_tok, float(w.sum())],
                                   dtype=torch.float64, device=self.device)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), actor.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

        # 4. Metrics: sum over ranks (gloo has no AVG); loss sums are already dp-scaled.
        dist.all_reduce(totals)
        tokens = info["tokens"]
        return {"actor/pg_loss": totals[0].item() / self.world,
                "actor/ppo_kl": totals[1].item() / tokens,
                "actor/pg_clipfrac": totals[2].item() / tokens,
                "actor/is_weight_mean": totals[3].item() / tokens,
                "actor/grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                                         else grad_norm)}

    def publish(self, step: int) -> dict:
        return publish_version(self.model, self.store, self.model_path, self.version, step,
                               self.cfg.trainer.keep_versions)

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
            if step % tc.publish_freq == 0 or step == tc.total_training_steps:
                self.version += 1
                metrics.update(self.publish(step))
            if self.rank == 0:
                metrics.update({k: v for k, v in info.items() if k not in ("wait_s", "seqs", "tokens")})
                metrics.update({"samples/consumed": self.reader.stats["consumed_samples"],
                                "samples/step": info["seqs"],
                                "tokens/step": info["tokens"], "time/wait_s": info["wait_s"],
                                "time/step_s": time.monotonic() - t0, "time/unix": time.time(),
                                "buffer/dropped_stale_samples": self.reader.stats["dropped_stale_samples"],
                                "buffer/bad_shards": self.reader.stats["bad_shards"]})
                self.metrics.write(metrics)
            if tc.save_freq and step % tc.save_freq == 0:
                self.save_checkpoint()
        if self.rank == 0:
            atomic_write_json(self.fs, self.store.layout.done_marker,
                              {"steps": tc.total_training_steps, "version": self.version})

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.metrics is not None:
            self.metrics.close()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(TrainerConfig, argv, "python -m trainer.main",
                    "Trainer: consumes experience shards, runs GRPO/PPO steps on an FSDP2 actor, "
                    "and publishes weight versions for the rollout workers. Run under torchrun.")
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
