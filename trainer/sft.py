"""Supervised fine-tuning: the warm start before RL, with verl's SFT config names.

    torchrun --nproc_per_node 8 -m trainer.sft --config sft.yaml \\
        data.train_files=[sft_train.parquet] model.partial_pretrain=BASE trainer.default_local_dir=OUT

Shares the RL trainer's FSDP2 actor (bf16 compute, fp32 master weights on GPU; fp32 on CPU),
DCP checkpoints (resumable on any number of ranks), metrics log and distributed start-up.
Each step takes `data.train_batch_size` sequences in a seeded per-epoch order that does not
depend on the number of ranks, balances them over the ranks by tokens, and packs each rank's
share into micro-batches without padding. The loss is the mean negative log-likelihood over all
response tokens of the step. Output: OUT/weights/v<step>/ (an HF folder at each save and at the
end), OUT/hf (the final one), OUT/checkpoints/step_<N>/, OUT/metrics.jsonl.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from buffer.run import setup_trainer_run
from protocol.config import parse_cli, to_dict
from protocol.weights import base_checksum
from trainer import algo, checkpoint, lora
from trainer.attention import attn_implementation
from trainer.lifeline import leave, trace_native_crashes
from trainer.lora import LoraSpec
from trainer.main import init_distributed, say_restart
from trainer.metrics import MetricsLog
from trainer.model import adamw, build_actor
from trainer.publish import publish_version
from trainer.sft_config import SFTConfig
from trainer.sft_data import Packed, Sequences, SFTDataError, load_sequences, micro_batches, pack, split_by_tokens
from trainer.update import gradient_sync

log = logging.getLogger("trainer.sft")


def packed_nll(model, p: Packed) -> torch.Tensor:
    """Sum of -log p(target) over a packed micro-batch's K loss tokens, in fp32. Logits are
    computed at those K positions only (`logits_to_keep`), not at every token; no attention
    mask and no cache, so transformers masks the packed sequences apart by their positions."""
    logits = model(
        input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False, logits_to_keep=p.logit_index
    ).logits[0]  # (K, vocab)
    return F.cross_entropy(logits.float(), p.targets, reduction="sum")


def sft_line(m: dict) -> str:
    """The console line: tokens/s of the training passes; the step time includes validation."""
    val = f" | val loss {m['val/loss']:.4f}" if "val/loss" in m else ""
    return (
        f"step {m['step']}/{m['total']} | epoch {m['epoch']} | loss {m['train/loss']:.4f}{val} | "
        f"lr {m['train/lr']:.2e} | grad norm {m['train/grad_norm']:.3f} | "
        f"{m['samples/step']} seqs, {m['tokens/step']} tokens ({m['tokens/loss']} in the loss) | "
        f"{m['perf/tokens_per_s']:,.0f} tokens/s | step {m['time/step_s']:.2f} s"
    )


class SFTTrainer:
    def __init__(self, cfg: SFTConfig, device: torch.device, train: Sequences, val: Sequences | None):
        self.cfg, self.device, self.train, self.val = cfg, device, train, val
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.batch_size = cfg.data.train_batch_size
        self.steps_per_epoch = len(train) // self.batch_size  # the last partial batch is dropped
        if self.steps_per_epoch == 0:
            raise ValueError(f"data.train_batch_size={self.batch_size} exceeds the {len(train)} usable training rows")
        self.total = self.steps_per_epoch * cfg.trainer.total_epochs
        if cfg.trainer.total_training_steps is not None:
            self.total = min(self.total, cfg.trainer.total_training_steps)
        self.lengths = {"train": train.lengths, "val": val.lengths if val else []}
        self.stores = setup_trainer_run(os.path.abspath(cfg.trainer.output_dir))
        self.store = self.stores.publisher
        self.model_path = cfg.model.partial_pretrain
        # model.lora_rank > 0: adapters on the frozen base; HF folders hold the merged weights
        self.lora = LoraSpec.of(cfg.model)
        torch.manual_seed(cfg.trainer.seed)  # the adapters' random init (lora_A) is reproducible
        self.model = build_actor(
            self.model_path,
            device,
            cfg.model.enable_gradient_checkpointing,
            trust_remote_code=cfg.model.trust_remote_code,
            attn_implementation=attn_implementation(cfg.model.attn_implementation, device),
            lora=self.lora,
        )
        self.base_checksum = base_checksum(self.model_path) if self.lora else None
        self.optimizer = adamw(lora.trainable(self.model), cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas)
        first = torch.from_numpy(train.ids[0][:2])  # a zero-weight pass: two tokens, one target
        self.dummy = Packed(first.unsqueeze(0), torch.arange(2).unsqueeze(0), torch.tensor([0]), first[1:])
        self.step = 0
        self._order: tuple[int, list[int]] | None = None
        resume = self._resume_path()
        if resume is not None:
            self._resume(resume)
        elif self.store.versions():  # every rank stops (none waits in a collective)
            raise FileExistsError(
                f"{self.store.dir} already holds HF weight folders but "
                "there is no checkpoint to resume from; choose a new "
                "trainer.default_local_dir"
            )
        self.metrics = None
        if self.rank == 0:
            files = self.stores.files
            self.metrics = MetricsLog(
                files.metrics,
                self.total,
                cfg.trainer.logger,
                cfg.trainer.project_name,
                cfg.trainer.experiment_name,
                to_dict(cfg),
                files.tensorboard_dir,
                files.swanlab_dir,
                line=sft_line,
            )

    # --- resume ---------------------------------------------------------------------------
    def _resume_path(self) -> str | None:
        tc = self.cfg.trainer
        if tc.resume_mode == "resume_path":
            return checkpoint.resume_path(tc.resume_from_path, self.stores.checkpoints, "trainer.resume_from_path")
        return checkpoint.resume_path(tc.resume_mode, self.stores.checkpoints)

    def _state(self) -> dict:
        """What must match for a resumed run to continue the same sample order."""
        return {"train_samples": len(self.train), "train_batch_size": self.batch_size, "seed": self.cfg.trainer.seed}

    def _resume(self, path: str) -> None:
        state, _ = checkpoint.load(
            self.model, self.optimizer, path, lora_expected=checkpoint.lora_state(self.lora, self.base_checksum)
        )
        saved = {k: state.get(k) for k in self._state()}
        if saved != self._state():
            raise ValueError(
                f"{path}: saved with {saved}, this run has {self._state()}; the "
                "sample order would differ (trainer.resume_mode=disable starts anew)"
            )
        self.step = state["step"]
        if self.rank == 0:  # HF folders the killed run published after its last checkpoint
            for v in self.store.versions():
                if v > self.step:
                    self.store.remove(v)
        dist.barrier()
        log.info("resumed from %s at step %d", path, self.step)

    # --- data: the step's sequences, this rank's share, packed micro-batches -----------------
    def batch(self, step: int) -> list[int]:
        """Sample indices of global step `step` (1-based): a seeded permutation per epoch."""
        epoch, k = divmod(step - 1, self.steps_per_epoch)
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.cfg.trainer.seed + epoch)
            self._order = (epoch, torch.randperm(len(self.train), generator=g).tolist())
        return self._order[1][k * self.batch_size : (k + 1) * self.batch_size]

    def plan(self, indices: list[int], split: str) -> list[list[int] | None]:
        """This rank's micro-batches. Every rank runs the same number (FSDP's all-gathers and
        reduce-scatters pair up), so shorter lists are padded with None: a zero-weight pass."""
        data = self.cfg.data
        lengths = self.lengths[split]
        mine = split_by_tokens(lengths, indices, self.world)[self.rank]
        mbs = micro_batches(
            lengths, mine, data.max_token_len_per_gpu if data.use_dynamic_bsz else None, data.micro_batch_size_per_gpu
        )
        count = torch.tensor([len(mbs)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return mbs + [None] * (int(count) - len(mbs))

    def _passes(self, indices: list[int], split: str, seqs: Sequences, scale: float, backward: bool) -> float:
        """Forward (and backward) over this rank's micro-batches; the nll sum over all ranks."""
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        plan, sync = self.plan(indices, split), gradient_sync(self.model)
        for i, mb in enumerate(plan):
            nll = packed_nll(self.model, (pack(seqs, mb) if mb else self.dummy).to(self.device))
            if backward:
                sync(i == len(plan) - 1)  # one rank: reduce once, at the last pass
                (nll * (scale if mb else 0.0)).backward()
            if mb:
                total += nll.detach()
        dist.all_reduce(total)
        return total.item()

    # --- one optimizer step ---------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        indices = self.batch(step)
        loss_tokens = self.train.loss_tokens(indices)  # the same on every rank
        # FSDP averages gradients over ranks, so world / tokens makes the update that of the
        # mean over every loss token of the step, however the ranks and micro-batches split it.
        with lora.dropout_active(self.model, self.lora):
            nll = self._passes(indices, "train", self.train, self.world / loss_tokens, backward=True)
        grad_norm = torch.nn.utils.clip_grad_norm_(lora.trainable(self.model), self.cfg.optim.clip_grad)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        o = self.cfg.optim
        lr = algo.lr_at(step, self.total, o.lr, o.warmup_steps_ratio, o.lr_scheduler, o.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr  # a function of the step: nothing to restore on resume
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            log.warning("step %d: gradient norm %s; update skipped", step, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "train/loss": nll / loss_tokens,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "samples/step": len(indices),
            "tokens/loss": loss_tokens,
            "tokens/step": sum(self.lengths["train"][i] for i in indices),
        }

    @torch.no_grad()
    def validate(self) -> dict:
        if self.val is None:
            return {}
        indices = list(range(len(self.val)))
        with lora.dropout(self.model, False):
            nll = self._passes(indices, "val", self.val, 0.0, backward=False)
        return {"val/loss": nll / self.val.loss_tokens(indices)}

    # --- outputs --------------------------------------------------------------------------
    def save(self, step: int, with_checkpoint: bool) -> None:
        """The HF folder first, then the checkpoint: a checkpoint's step always has its folder."""
        t0 = time.monotonic()
        publish_version(
            self.model, self.store, self.model_path, step, step, self.cfg.trainer.max_ckpt_to_keep, torch.float32
        )
        if with_checkpoint:
            state = {
                "step": step,
                "model_path": self.model_path,
                **self._state(),
                **checkpoint.lora_state(self.lora, self.base_checksum),
            }
            checkpoint.save(
                self.model,
                self.optimizer,
                self.stores.checkpoints,
                step,
                state if self.rank == 0 else None,
                None,
                self.cfg.trainer.max_ckpt_to_keep,
            )
        log.info(
            "step %d saved (%s) in %.2f s",
            step,
            "HF folder and checkpoint" if with_checkpoint else "HF folder",
            time.monotonic() - t0,
        )

    def link_final(self) -> str:
        """OUT/hf -> weights/v<last step>, replaced atomically."""
        return self.store.link_final(self.total)

    def run(self) -> None:
        tc = self.cfg.trainer
        for step in range(self.step + 1, self.total + 1):
            self.step = step
            t0 = time.monotonic()
            metrics: dict[str, Any] = {"step": step, "epoch": (step - 1) // self.steps_per_epoch + 1}
            metrics.update(self.train_step(step))
            train_s = time.monotonic() - t0
            if (
                (tc.test_freq > 0 and step % tc.test_freq == 0)
                or step % self.steps_per_epoch == 0
                or step == self.total
            ):
                metrics.update(self.validate())
                metrics["time/val_s"] = time.monotonic() - t0 - train_s
            metrics.update(
                {
                    "time/step_s": time.monotonic() - t0,
                    "time/unix": time.time(),
                    "perf/tokens_per_s": metrics["tokens/step"] / train_s,
                }
            )
            if self.rank == 0:
                self.metrics.write(metrics)
            periodic = tc.save_freq > 0 and step % tc.save_freq == 0
            if periodic or step == self.total:
                self.save(step, with_checkpoint=tc.save_freq > 0)
        if self.rank == 0:
            log.info(
                "SFT done after %d steps; final HF folder %s (give it as actor_rollout_ref.model.path)",
                self.total,
                self.link_final(),
            )
        dist.barrier()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def load_data(cfg: SFTConfig) -> tuple[Sequences, Sequences | None]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.partial_pretrain, trust_remote_code=cfg.model.trust_remote_code)
    train = load_sequences(cfg.data.train_files, tokenizer, cfg.data, "data.train_files")
    val = load_sequences(cfg.data.val_files, tokenizer, cfg.data, "data.val_files") if cfg.data.val_files else None
    return train, val


def main(argv: list[str] | None = None) -> int:
    trace_native_crashes()
    cfg = parse_cli(
        SFTConfig,
        argv,
        "torchrun -m trainer.sft",
        "Supervised fine-tuning (loss on response tokens) of an HF causal LM with "
        "FSDP2; writes HF folders for trainer.main's actor_rollout_ref.model.path.",
    )
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        stream=sys.stdout,
        format=f"%(asctime)s %(levelname)s sft[{rank}] %(message)s",
    )
    try:  # before any collective: every rank finds the same bad row and stops
        train, val = load_data(cfg)
    except SFTDataError as e:
        if rank == 0:
            print(f"trainer.sft: {e}", file=sys.stderr)
        return 2
    log.info(
        "data: %d training sequences (%d tokens), %d validation", len(train), sum(train.lengths), len(val) if val else 0
    )
    device = init_distributed(cfg.trainer.device, cfg.trainer.timeout_s)
    if rank == 0:
        say_restart("trainer.sft")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    trainer = SFTTrainer(cfg, device, train, val)
    try:
        trainer.run()
    finally:
        trainer.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())
