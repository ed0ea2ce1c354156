"""The RL maths of one step, delegated to verl's implementations where verl has them.

Three policies meet here (see NOTES: decoupled PPO, truncated IS):
  mu       the behaviour policy: the engine weights that sampled, logprobs stored per token;
  pi_old   the trainer's weights before this step (recomputed here, no gradient);
  pi_theta the weights being optimised.
The PPO ratio is pi_theta/pi_old (verl's clipped loss); stale or engine-mismatched samples are
reweighted per token by w = min(pi_old/mu, C), no gradient through w (Yao et al., truncated IS).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from trainer.batch import Batch


def response_logprobs(model, batch: Batch, with_entropy: bool = False):
    """log pi(response token) at the sampling temperature, shape (B, R); with the entropy of
    each position's distribution as well when asked (else None)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   use_cache=False).logits
    rows = torch.arange(logits.shape[0], device=logits.device).unsqueeze(1)
    # Only response positions, upcast once; log pi = logit - logsumexp, without materialising a
    # full (B, R, vocab) log-softmax (the largest tensor of the step for a 150k vocabulary).
    picked = logits[rows, batch.logit_index].float() / batch.temperature.view(-1, 1, 1)
    target = picked.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    logprobs = target - torch.logsumexp(picked, dim=-1)
    entropy = None
    if with_entropy:
        from verl.utils.torch_functional import entropy_from_logits
        entropy = entropy_from_logits(picked) * batch.response_mask
    return logprobs * batch.response_mask, entropy


def kl_and_entropy_terms(logprobs, ref_logprobs, entropy, mask, kl_type: str, loss_agg_mode: str,
                         loss_cfg) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """verl's KL penalty against the reference policy and the entropy, aggregated like the loss."""
    from verl.trainer.ppo import core_algos
    kl = ent = None
    if ref_logprobs is not None:
        kl = core_algos.agg_loss(core_algos.kl_penalty(logprobs, ref_logprobs, kl_penalty=kl_type),
                                 mask, loss_agg_mode, **loss_cfg.global_batch_info)
    if entropy is not None:
        ent = core_algos.agg_loss(entropy, mask, loss_agg_mode, **loss_cfg.global_batch_info)
    return kl, ent


def lr_at(step: int, total: int, base_lr: float, warmup_ratio: float, style: str,
          min_lr_ratio: float) -> float:
    """Linear warmup over warmup_ratio*total steps, then constant or cosine down to min_lr_ratio."""
    warmup = int(warmup_ratio * total)
    if warmup and step <= warmup:
        return base_lr * step / warmup
    if style == "constant":
        return base_lr
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def advantages(batch: Batch, estimator: str, norm_by_std: bool) -> torch.Tensor:
    from verl.trainer.ppo import core_algos
    index = np.array(batch.group_ids, dtype=object)
    if estimator == "grpo":
        adv, _ = core_algos.compute_grpo_outcome_advantage(
            batch.token_level_rewards, batch.response_mask, index, norm_adv_by_std_in_grpo=norm_by_std)
    else:
        adv, _ = core_algos.get_adv_estimator_fn(estimator)(
            token_level_rewards=batch.token_level_rewards, response_mask=batch.response_mask,
            index=index)
    return adv


def truncated_is_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                         mask: torch.Tensor, cap: float) -> torch.Tensor:
    """w = min(pi_old/mu, C) per token; computed in log space, clamped against overflow."""
    log_ratio = (old_logprobs - behaviour_logprobs).clamp(max=20.0)
    return torch.exp(log_ratio).clamp(max=cap).detach() * mask


def actor_loss_config(clip_ratio: float, dp_size: int, batch_num_tokens: int, global_batch_size: int):
    """verl's ActorConfig carries clip settings and the global sizes agg_loss normalises by."""
    from verl.workers.config.actor import ActorConfig
    return ActorConfig(strategy="fsdp", clip_ratio=clip_ratio, ppo_mini_batch_size=1,
                       ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                       global_batch_info={"dp_size": dp_size, "batch_num_tokens": batch_num_tokens,
                                          "global_batch_size": global_batch_size})


def policy_loss(old_logprobs, logprobs, adv, mask, is_weights, loss_agg_mode: str, loss_cfg):
    from verl.trainer.ppo import core_algos
    return core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=old_logprobs, log_prob=logprobs, advantages=adv, response_mask=mask,
        loss_agg_mode=loss_agg_mode, config=loss_cfg, rollout_is_weights=is_weights)
