"""The RL maths of one step, delegated to verl's implementations where verl has them.

Three policies meet here (see NOTES: decoupled PPO, truncated IS):
  mu       the behaviour policy: the engine weights that sampled, logprobs stored per token;
  pi_old   the trainer's weights at the start of this step (computed once, before any of the
           step's optimizer steps, no gradient);
  pi_theta the weights being optimised, which move with every mini-batch.
The PPO ratio is pi_theta/pi_old (verl's clipped loss, which acts from the second mini-batch or
epoch on); stale or engine-mismatched samples are reweighted per token by w = min(pi_old/mu, C),
no gradient through w (Yao et al., truncated IS).

Shapes: B rows (sequences), R response positions; (B, R) tensors are response-aligned, zero past
a row's response (see trainer/batch.py).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from trainer.batch import Batch

LOGPROB_CHUNK_TOKENS = 2048  # verl's entropy_from_logits_chunk_size: a (2048, vocab) fp32 block at a time


def response_logprobs(
    model,
    batch: Batch,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk: int | None = LOGPROB_CHUNK_TOKENS,
    compiled: bool = False,
):
    """log pi(response token) at the sampling temperature, shape (B, R); with the entropy of
    each position's distribution as well when asked (else None), differentiable or, for a
    metric only, not (`entropy_grad`: no graph kept for it). Padded or packed batches alike.

    `chunk` tokens at a time: the lm_head runs on the response positions' hidden states only,
    block by block through `LinearLogSoftmax`, each block's logits recomputed in backward instead
    of kept, so no (tokens x vocab) tensor is ever whole and autograd records no per-element op
    over one. None: the full logits (the path before chunking). `compiled`: each block's
    element-wise work through torch.compile (trainer.compile_layers; LinearLogSoftmax)."""
    if chunk is None:
        return _full_logits_logprobs(model, batch, with_entropy, entropy_grad)
    head = model.get_output_embeddings()
    mask = batch.response_mask.bool()
    rows, cols = batch.logit_rows()[mask], batch.logit_index[mask]
    targets = batch.response_ids[mask]
    temps = batch.temperature.view(-1, 1).expand_as(batch.response_mask)[mask].float()
    out: dict[str, torch.Tensor] = {}

    def chunked_head(hidden: torch.Tensor) -> torch.Tensor:
        # Runs inside the model's forward, where FSDP holds the head's weight unsharded.
        h = hidden[rows, cols]  # (K, H): response positions only
        parts = [
            LinearLogSoftmax.apply(
                h[a : a + chunk],
                head.weight,
                targets[a : a + chunk],
                temps[a : a + chunk],
                with_entropy,
                entropy_grad,
                compiled,
            )
            for a in range(0, len(h), chunk)
        ]
        out["lp_ent"] = torch.cat(parts) if parts else h.new_zeros((0, 2), dtype=torch.float32)
        return hidden[:, :1, :1]  # what the model returns as "logits": unused

    kwargs = _model_inputs(batch)
    head.forward = chunked_head  # an instance attribute: parameter names and FSDP units unchanged
    try:
        model(**kwargs, use_cache=False)
    finally:
        del head.forward  # the class's forward again
    lp_ent = out["lp_ent"]
    logprobs = batch.response_mask.new_zeros(batch.response_mask.shape).masked_scatter(mask, lp_ent[:, 0])
    entropy = None
    if with_entropy:
        # detached for a metric: its column has no gradient (the backward ignores it), so no
        # caller can mistake a silent zero for one
        ent = lp_ent[:, 1] if entropy_grad else lp_ent[:, 1].detach()
        entropy = batch.response_mask.new_zeros(batch.response_mask.shape).masked_scatter(mask, ent)
    return logprobs, entropy


class LinearLogSoftmax(torch.autograd.Function):
    """One block of the lm_head fused with the log-softmax: (k, 2) fp32 [log pi(target), entropy]
    of k positions at their temperatures, as verl's entropy_from_logits (logsumexp - sum p * z).

    forward(h (k, H), weight (V, H), targets (k,) int, temps (k,), with_entropy, entropy_grad,
    compiled);
    z = (h @ weight.T) in fp32 / temps. No (k, V) tensor outlives a call: forward keeps h, weight,
    targets, temps, lse (k,) and, for a differentiable entropy, E_p[z] (k,); backward recomputes
    z (one matmul) and builds the logits' gradient in place. Without `with_entropy` the entropy
    column is zeros, not computed; without `entropy_grad` its gradient is never formed (the
    caller detaches it), so backward runs no entropy work at all.

    Gradients, with p = softmax(z), lse = logsumexp(z), H = lse - E_p[z]:
      d lse/dz = p, so d log pi(t)/dz = onehot(t) - p;
      dH/dz_j = p_j - (p_j + p_j z_j - p_j E_p[z]) = p_j (E_p[z] - z_j);
    then d/dlogits = d/dz / temps, d/dh = grad_logits @ weight, d/dweight = grad_logits.T @ h,
    the matmuls in the forward's matmul dtype (bf16 under FSDP's policy or autocast)."""

    @staticmethod
    def forward(ctx, h, weight, targets, temps, with_entropy: bool, entropy_grad: bool, compiled: bool = False):
        entropy_grad = entropy_grad and with_entropy
        mm = h @ weight.t()  # the dtype autocast or the parameters give: kept for the recompute
        # compiled: the element-wise work over mm (k, V) as one or two fused kernels that read
        # mm (bf16 on GPU) and write only (k,) vectors, not ~8 passes over an fp32 (k, V) copy.
        # k = 1 stays eager: dynamic shapes specialise sizes 0 and 1, a recompile mid-run.
        fused = compiled and len(h) > 1
        out, lse, mean_z = _kernel(_block_stats, fused)(mm, temps, targets, with_entropy)
        # autograd saves nothing when no input requires grad or under no_grad (ctx is dropped)
        ctx.save_for_backward(h, weight, targets, temps, lse, *([mean_z] if entropy_grad else []))
        ctx.mm_dtype, ctx.entropy_grad, ctx.fused = mm.dtype, entropy_grad, fused
        return out

    @staticmethod
    def backward(ctx, g):
        h, weight, targets, temps, lse, *mean_z = ctx.saved_tensors
        dt = ctx.mm_dtype
        mm = h.to(dt) @ weight.to(dt).t()
        grad = _kernel(_block_grad, ctx.fused)(mm, temps, targets, lse, mean_z[0] if mean_z else None, g, dt)
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = (grad @ weight.to(dt)).to(h.dtype) if need_h else None
        grad_w = (grad.t() @ h.to(dt)).to(weight.dtype) if need_w else None
        return grad_h, grad_w, None, None, None, None, None


def _block_stats(
    mm: torch.Tensor, temps: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One block's lm_head output mm (k, V) at the rows' temperatures temps (k,) -> (k, 2) fp32
    [log pi(target), entropy (zeros without `with_entropy`)], lse (k,) and E_p[z] (k,) (None
    without `with_entropy`)."""
    z = _scaled(mm, temps)
    target = z.gather(1, targets.unsqueeze(1)).squeeze(1)
    lse, entropy = _lse_entropy(z, with_entropy)  # consumes z
    if entropy is None:
        return torch.stack([target - lse, torch.zeros_like(lse)], dim=1), lse, None
    return torch.stack([target - lse, entropy], dim=1), lse, lse - entropy


def _block_grad(
    mm: torch.Tensor,
    temps: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    mean_z: torch.Tensor | None,
    g: torch.Tensor,
    dt: torch.dtype,
) -> torch.Tensor:
    """d loss / d mm (k, V) in dt from the recomputed mm, the forward's lse (k,), E_p[z] (k,)
    when the entropy is in the loss (else None) and g (k, 2) = d loss / d [log pi, entropy]
    (LinearLogSoftmax's docstring), in place over one fp32 copy of mm when eager."""
    z = _scaled(mm, temps)
    g_lp, g_ent = g[:, :1], g[:, 1:]  # (k, 1) each
    p = (z - lse.unsqueeze(1)).exp_()
    if mean_z is not None:  # p * (g_ent (E_p[z] - z) - g_lp), z's buffer reused for the factor
        grad = p.mul_(z.neg_().add_(mean_z.unsqueeze(1)).mul_(g_ent).sub_(g_lp))
    else:
        grad = p.mul_(-g_lp)
    grad.scatter_add_(1, targets.unsqueeze(1), g_lp)  # + g_lp onehot(target)
    return grad.div_(temps.unsqueeze(1)).to(dt)


# torch.compile's default; the CPU tests trace with "aot_eager" (dynamo and functionalisation
# without inductor's C++ build, ~35 s on a 2-core box), tests/gpu with this one on CUDA.
COMPILE_BACKEND = "inductor"


@functools.cache
def _compiled(fn, backend: str):
    return torch.compile(fn, dynamic=True, backend=backend)  # block lengths differ (each micro-batch's last)


def _kernel(fn, compiled: bool):
    """fn itself, or its torch.compile'd form (built once per process, at its first call)."""
    return _compiled(fn, COMPILE_BACKEND) if compiled else fn


def _scaled(mm: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """(k, V) logits z in at least fp32 (float64 stays: gradcheck) over the temperatures; in
    place when mm is already fp32, as nothing reads mm after."""
    return mm.to(torch.promote_types(mm.dtype, torch.float32)).div_(temps.unsqueeze(1))


def _lse_entropy(z: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logsumexp (k,) of z (k, V) and, when asked, the entropy (k,) (else None), from one exp of
    z shifted by its row maximum in place (z is overwritten): no overflow, and the entropy
    log s - E_p[z - max] without the cancellation of two large terms lse and E_p[z]."""
    top = z.amax(1, keepdim=True)
    z.sub_(top)
    if not with_entropy:
        return top.squeeze(1) + z.exp_().sum(1).log(), None
    e = z.exp()
    s = e.sum(1)
    log_s = s.log()
    return top.squeeze(1) + log_s, log_s - e.mul_(z).sum(1) / s


def _model_inputs(batch: Batch) -> dict:
    """Packed: position ids and no attention mask (transformers masks the rows apart by their
    positions, as trainer/sft.py relies on), and the rows' boundaries under transformers'
    flash-attention keyword names, which reach every layer's attention (varlen kernels use
    them; sdpa, eager and flex ignore them); padded: the attention mask."""
    if batch.is_packed:
        inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
        if batch.cu_seqlens is not None:
            cu, longest = batch.cu_seqlens, batch.max_seqlen
            inputs |= {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
        return inputs
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}


def _full_logits_logprobs(model, batch: Batch, with_entropy: bool, entropy_grad: bool):
    logits = model(**_model_inputs(batch), use_cache=False).logits
    # Only response positions, upcast once; log pi = logit - logsumexp, without materialising a
    # full (B, R, vocab) log-softmax (the largest tensor of the step for a 150k vocabulary).
    picked = logits[batch.logit_rows(), batch.logit_index].float() / batch.temperature.view(-1, 1, 1)
    target = picked.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    logprobs = target - torch.logsumexp(picked, dim=-1)
    entropy = None
    if with_entropy:
        from verl.utils.torch_functional import entropy_from_logits

        entropy = entropy_from_logits(picked if entropy_grad else picked.detach()) * batch.response_mask
    return logprobs * batch.response_mask, entropy


def response_values(critic, batch: Batch) -> torch.Tensor:
    """V(s_j) for each response position j, shape (B, R): the value head's output at the
    position that predicts token j (the state before it), as verl's critic reads values[:, -R-1:-1]."""
    out = critic(**_model_inputs(batch), use_cache=False).logits.squeeze(-1)  # (B, T), or (1, N) packed
    return out[batch.logit_rows(), batch.logit_index].float() * batch.response_mask


def kl_and_entropy_terms(
    logprobs, ref_logprobs, entropy, mask, kl_type: str, loss_agg_mode: str, loss_cfg
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """verl's KL penalty against the reference policy and the entropy, aggregated like the loss."""
    from verl.trainer.ppo import core_algos

    kl = ent = None
    if ref_logprobs is not None:
        kl = core_algos.agg_loss(
            core_algos.kl_penalty(logprobs, ref_logprobs, kl_penalty=kl_type),
            mask,
            loss_agg_mode,
            **loss_cfg.global_batch_info,
        )
    if entropy is not None:
        ent = core_algos.agg_loss(entropy, mask, loss_agg_mode, **loss_cfg.global_batch_info)
    return kl, ent


def lr_at(step: int, total: int, base_lr: float, warmup_ratio: float, style: str, min_lr_ratio: float) -> float:
    """Linear warmup over warmup_ratio*total steps, then constant or cosine down to min_lr_ratio."""
    warmup = int(warmup_ratio * total)
    if warmup and step <= warmup:
        return base_lr * step / warmup
    if style == "constant":
        return base_lr
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def kl_in_reward(scores, old_logprobs, ref_logprobs, mask, kl_penalty: str, kl_ctrl) -> tuple[torch.Tensor, dict]:
    """verl's apply_kl_penalty: token rewards = scores - beta * KL(pi_old || ref) per token,
    then the controller sees the batch's KL (mean over sequences of the per-token mean).
    All (B, R) over the whole batch (all ranks); kl_ctrl: verl's Fixed/AdaptiveKLController."""
    from verl.trainer.ppo import core_algos
    from verl.utils.torch_functional import masked_mean

    kld = core_algos.kl_penalty(old_logprobs, ref_logprobs, kl_penalty=kl_penalty) * mask
    beta = kl_ctrl.value
    rewards = scores - beta * kld
    current_kl = masked_mean(kld, mask=mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def compute_advantage(algorithm, rewards, mask, index: np.ndarray, values=None):
    """Advantages and returns, (B, R) each, by verl's registered estimator (as verl's
    ray_trainer.compute_advantage calls it). Over the whole batch (all ranks): gae and the
    reinforce_plus_plus pair whiten over the batch, the others over each group (`index`)."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos

    fn = core_algos.get_adv_estimator_fn(algorithm.adv_estimator)
    if algorithm.adv_estimator == "gae":
        return fn(
            token_level_rewards=rewards, values=values, response_mask=mask, gamma=algorithm.gamma, lam=algorithm.lam
        )
    config = AlgoConfig(
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        adv_estimator=algorithm.adv_estimator,
        norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
    )
    return fn(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        config=config,
        norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
    )


def data_metrics(scores, rewards, adv, returns, values, mask) -> dict:
    """verl's compute_data_metrics names over the whole batch; `values` None without a critic."""
    valid = mask.bool()
    out: dict[str, float] = {}
    for name, seq in (("score", scores.sum(-1)), ("rewards", rewards.sum(-1))):
        out |= {
            f"critic/{name}/mean": seq.mean().item(),
            f"critic/{name}/max": seq.max().item(),
            f"critic/{name}/min": seq.min().item(),
        }
    tensors = {"advantages": adv, "returns": returns, **({"values": values} if values is not None else {})}
    for name, t in tensors.items():
        v = torch.masked_select(t, valid)
        out |= {
            f"critic/{name}/mean": v.mean().item(),
            f"critic/{name}/max": v.max().item(),
            f"critic/{name}/min": v.min().item(),
        }
    if values is not None:
        ret, val = torch.masked_select(returns, valid), torch.masked_select(values, valid)
        out["critic/vf_explained_var"] = (1.0 - (ret - val).var() / (ret.var() + 1e-5)).item()
    return out


def truncated_is_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """w = min(pi_old/mu, C) per token; computed in log space, clamped against overflow."""
    log_ratio = (old_logprobs - behaviour_logprobs).clamp(max=20.0)
    return torch.exp(log_ratio).clamp(max=cap).detach() * mask


def mismatch_sums(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, fresh: torch.Tensor, cap: float
) -> torch.Tensor:
    """Sums over this rank's tokens for the rollout metrics, summed over ranks by the caller:
    [k3 over staleness-0 tokens, staleness-0 tokens, tokens whose IS weight was truncated,
    tokens], float64.

    k3 (Schulman's low-variance estimator, as verl's rollout_corr/k3_kl): with the log-ratio
    l = log pi_old - log mu of a token sampled from mu, E_mu[exp(l) - 1 - l] = KL(mu || pi_old),
    the KL from the engine's behaviour policy to the trainer's recomputation; each term is >= 0.
    Only rows with `fresh` (B,) true count: generated by the very weights pi_old holds, so the
    KL is the engine/trainer numerical mismatch alone, not staleness. A token is truncated where
    pi_old/mu > cap (verl's rollout_is_ratio_fraction_high for token-level TIS).
    Shapes: (B, R) each, except `fresh` (B,) bool."""
    log_ratio = (old_logprobs - behaviour_logprobs).double() * mask
    k3 = torch.expm1(log_ratio) - log_ratio  # expm1: no cancellation for |l| ~ 1e-7
    rows = mask * fresh.to(mask.dtype).unsqueeze(1)
    return torch.stack(
        [
            (k3 * rows).sum(),
            rows.sum().double(),
            ((log_ratio > math.log(cap)) * mask).sum().double(),
            mask.sum().double(),
        ]
    )


def mismatch_metrics(sums: list[float]) -> dict:
    """`mismatch_sums` over all ranks -> metrics; rollout/mismatch_kl is absent (not NaN) when the
    step had no staleness-0 token (or the trainer's weights were not a published version)."""
    k3, fresh, truncated, tokens = sums
    out = {"rollout_corr/rollout_is_ratio_fraction_high": truncated / tokens, "rollout/mismatch_tokens": int(fresh)}
    if fresh:
        out["rollout/mismatch_kl"] = k3 / fresh
    return out


def actor_loss_config(actor, dp_size: int, batch_num_tokens: int, global_batch_size: int):
    """verl's ActorConfig carries the clip settings (clip_ratio_low/high None: clip_ratio, as
    verl's vanilla loss reads them) and the mini-batch's global sizes agg_loss normalises by.
    `actor`: our actor section (trainer.config.ActorConfig)."""
    from verl.workers.config.actor import ActorConfig

    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    return ActorConfig(
        strategy="fsdp",
        clip_ratio=actor.clip_ratio,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=actor.clip_ratio_c,
        loss_agg_mode=actor.loss_agg_mode,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        global_batch_info={
            "dp_size": dp_size,
            "batch_num_tokens": batch_num_tokens,
            "global_batch_size": global_batch_size,
        },
    )


def policy_loss(old_logprobs, logprobs, adv, mask, is_weights, loss_cfg):
    """verl's vanilla (dual-)clipped PPO loss; metrics actor/pg_clipfrac, ppo_kl, pg_clipfrac_lower."""
    from verl.trainer.ppo import core_algos

    return core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=old_logprobs,
        log_prob=logprobs,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=loss_cfg.loss_agg_mode,
        config=loss_cfg,
        rollout_is_weights=is_weights,
    )


def value_loss(
    vpreds,
    returns,
    old_values,
    mask,
    cliprange_value: float,
    loss_agg_mode: str,
    dp_size: int,
    batch_num_tokens: int,
    global_batch_size: int,
):
    """verl's clipped value loss 0.5 * max((V - G)^2, (clip(V, V_old +- c) - G)^2), aggregated
    like the actor's loss; returns (loss, clip fraction)."""
    from verl.trainer.ppo import core_algos

    return core_algos.compute_value_loss(
        vpreds=vpreds,
        returns=returns,
        values=old_values,
        response_mask=mask,
        cliprange_value=cliprange_value,
        loss_agg_mode=loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
    )
