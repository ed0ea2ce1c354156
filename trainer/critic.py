"""The critic for GAE: a value model V(s) trained beside the actor in the same job.

Built as verl builds it: the backbone of `critic.model.path` with a one-output linear head
(AutoModelForTokenClassification, num_labels=1), sharded with FSDP2 like the actor, with its own
AdamW and lr schedule (`critic.optim.*`). Each step it first gives V_old for every response
token (before any update; GAE needs them), then regresses V on the GAE returns with verl's
clipped value loss over its own mini-batches and epochs (`critic.ppo_*`). It is saved in the
trainer's checkpoints; only the actor is ever published.
"""

from __future__ import annotations

import math

import torch

from trainer import algo, lora, update
from trainer.batch import Batch
from trainer.lora import LoraSpec
from trainer.model import adamw, build_actor, packed_attention


class Critic:
    def __init__(self, cfg, device: torch.device, compile_layers: bool = False, checkpoint_every: int = 1):
        """cfg: trainer.config.CriticConfig (None fields already taken from the actor);
        `compile_layers`: trainer.compile_layers; `checkpoint_every`: trainer.checkpoint_every."""
        self.cfg = cfg
        self.packed = bool(cfg.model.use_remove_padding)
        # critic.model.lora_rank > 0: adapters on the frozen backbone; the value head trains in full
        self.lora = LoraSpec.of(cfg.model)
        self.model = build_actor(
            cfg.model.path,
            device,
            cfg.model.enable_gradient_checkpointing,
            value_head=True,
            attn_implementation=packed_attention(device) if self.packed else None,
            lora=self.lora,
            compile_layers=compile_layers,
            checkpoint_every=checkpoint_every,
        )
        self.optimizer = adamw(lora.trainable(self.model), cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas)

    def values(self, batch: Batch) -> torch.Tensor:
        """V_old, (B, R), at the weights before this step's update. Collective."""
        passes = update.plan([torch.arange(len(batch))], batch, self.cfg, self.packed)[0].passes
        with lora.dropout(self.model, False):
            return update.infer(lambda c: algo.response_values(self.model, c), batch, passes, self.packed)

    def update(
        self,
        batch: Batch,
        group_index: torch.Tensor,
        num_groups: int,
        values,
        returns,
        step: int,
        total_steps: int,
        seed: list[int],
    ) -> dict:
        """Mini-batch updates on (values, returns), both (B, R); returns verl's critic metrics."""
        cfg = self.cfg
        world = torch.distributed.get_world_size()
        rows = update.epochs(group_index, cfg.ppo_mini_batch_size, num_groups, cfg.ppo_epochs, cfg.shuffle, seed)
        minibatches = update.plan(rows, batch, cfg, self.packed)

        def loss_fn(idx, mb):
            c = update.micro(batch, idx, self.packed)
            r = c.response_mask.shape[1]
            vpreds = algo.response_values(self.model, c)
            loss, clipfrac = algo.value_loss(
                vpreds,
                returns[idx, :r],
                values[idx, :r],
                c.response_mask,
                cfg.cliprange_value,
                cfg.loss_agg_mode,
                world,
                mb.tokens,
                mb.seqs,
            )
            n = c.response_mask.sum()
            return loss, [loss.detach(), clipfrac * n, (vpreds.detach() * c.response_mask).sum(), n]

        lr = algo.lr_at(
            step,
            total_steps,
            cfg.optim.lr,
            cfg.optim.lr_warmup_steps_ratio,
            cfg.optim.warmup_style,
            cfg.optim.min_lr_ratio,
        )
        with lora.dropout_active(self.model, self.lora):
            totals, norms = update.optimize(self.model, self.optimizer, minibatches, lr, cfg.grad_clip, loss_fn)
        loss, clipfrac, vpred, tokens = update.all_sum(totals, batch.input_ids.device).tolist()
        # Each pass's loss is scaled by world / (mini-batch tokens): the sum over ranks of a
        # mini-batch's passes is world x its global loss.
        return {
            "critic/vf_loss": loss / (world * len(minibatches)),
            "critic/vf_clipfrac": clipfrac / tokens,
            "critic/vpred_mean": vpred / tokens,
            "critic/grad_norm": sum(norms) / len(norms),
            "critic/lr": lr,
            "critic/skipped_nonfinite": sum(not math.isfinite(n) for n in norms),
        }
