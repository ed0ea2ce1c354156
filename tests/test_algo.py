"""The step's maths against hand-computed values, and trainer/engine logprob agreement."""

import math
import statistics

import numpy as np
import pytest
import torch

from protocol.experience import Sample
from rollout import builtin_task
from rollout.engine import HFEngine, SamplingSettings
from trainer import algo
from trainer.batch import collate
from trainer.config import ActorConfig, AlgorithmConfig, KLControlConfig


def _sample(gid, k, prompt, response, reward, lps=None, temperature=1.0):
    return Sample(
        sample_id=f"{gid}/{k}",
        group_id=gid,
        prompt_id="p",
        worker_id="w",
        weight_version=0,
        prompt_ids=prompt,
        response_ids=response,
        behaviour_logprobs=lps or [-1.0] * len(response),
        reward=reward,
        finish_reason="stop",
        temperature=temperature,
        data_source="tandem/reverse",
        created_at=0.0,
        finished_at=0.0,
    )


def test_collate_aligns_response_positions():
    b = collate([_sample("g", 0, [5, 6, 7], [8, 9], 1.0), _sample("g", 1, [5], [4, 3, 2], 0.0)])
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 3, 2, 0]]
    assert b.logit_index.tolist() == [[2, 3, 0], [0, 1, 2]]
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert b.token_level_rewards.tolist() == [[0, 1.0, 0], [0, 0, 0.0]]


def _advantages(batch, estimator, norm_by_std=True, values=None):
    index = np.array([int(g != batch.group_ids[0]) for g in batch.group_ids])
    cfg = AlgorithmConfig(adv_estimator=estimator, norm_adv_by_std_in_grpo=norm_by_std)
    return algo.compute_advantage(cfg, batch.token_level_rewards, batch.response_mask, index, values)[0]


def test_grpo_advantage_by_hand():
    rewards = {"a": [1.0, 0.0, 0.0], "b": [0.5, 0.5, 0.5]}
    samples = [_sample(g, k, [3], [4, 5], r) for g, rs in rewards.items() for k, r in enumerate(rs)]
    adv = _advantages(collate(samples), "grpo", norm_by_std=True)
    mean, std = statistics.mean(rewards["a"]), statistics.stdev(rewards["a"])
    expected_a = [(r - mean) / (std + 1e-6) for r in rewards["a"]]
    for k in range(3):
        assert adv[k].tolist() == pytest.approx([expected_a[k]] * 2, abs=1e-5)
        assert adv[3 + k].abs().max().item() == pytest.approx(0.0, abs=1e-6)  # equal rewards
    drgrpo = _advantages(collate(samples), "grpo", norm_by_std=False)
    assert drgrpo[0, 0].item() == pytest.approx(1.0 - mean, abs=1e-5)


def test_truncated_is_and_clipped_loss_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    mu = torch.tensor([[-1.5, -0.5, -0.5]])  # pi_old/mu = e^0.5, e^-1.5, 1
    new = torch.tensor([[-0.8, -2.5, -0.5]])  # ratio = e^0.2 (clipped at 1.2 for A>0), e^-0.5, 1
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.tensor([[2.0, -1.0, 5.0]])
    w = algo.truncated_is_weights(old, mu, mask, cap=1.5)
    assert w.tolist()[0] == pytest.approx([1.5, math.exp(-1.5), 0.0], rel=1e-6)
    cfg = algo.actor_loss_config(ActorConfig(clip_ratio=0.2), dp_size=1, batch_num_tokens=2, global_batch_size=1)
    loss, metrics = algo.policy_loss(old, new, adv, mask, w, cfg)
    # token 0: A=2>0, r=e^0.2=1.221 -> max(-2r, -2*1.2) = -2.4; token 1: A=-1, r=e^-0.5=0.607
    # -> max(0.607, 0.8) = 0.8, dual clip min(0.8, 3) = 0.8; token 2 masked.
    expected = (1.5 * -2.4 + math.exp(-1.5) * 0.8) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1.0)  # both live tokens clipped

    def loss_with(**clip):
        c = algo.actor_loss_config(ActorConfig(**clip), dp_size=1, batch_num_tokens=2, global_batch_size=1)
        return algo.policy_loss(old, new, adv, mask, w, c)[0].item()

    # clip_ratio reaches both sides of verl's vanilla loss (it reads clip_ratio_low/high):
    # token 0 is clipped at 1 + eps, token 1 at 1 - eps.
    assert loss_with(clip_ratio=0.1) == pytest.approx((1.5 * -2.2 + math.exp(-1.5) * 0.9) / 2, rel=1e-5)
    assert loss_with(clip_ratio=0.5) == pytest.approx(
        (1.5 * -2 * math.exp(0.2) + math.exp(-1.5) * math.exp(-0.5)) / 2, rel=1e-5
    )  # unclipped
    assert loss_with(clip_ratio=0.1, clip_ratio_high=0.5) == pytest.approx(
        (1.5 * -2 * math.exp(0.2) + math.exp(-1.5) * 0.9) / 2, rel=1e-5
    )
    # Dual clip: for A < 0 the loss is capped at clip_ratio_c * |A| (ratio e^1 > 2 here).
    c = algo.actor_loss_config(ActorConfig(clip_ratio_c=2.0), 1, 1, 1)
    capped, m = algo.policy_loss(
        torch.tensor([[-1.0]]),
        torch.tensor([[0.0]]),
        torch.tensor([[-1.0]]),
        torch.tensor([[1.0]]),
        torch.tensor([[1.0]]),
        c,
    )
    assert capped.item() == pytest.approx(2.0) and m["actor/pg_clipfrac_lower"] == 1.0


def test_gae_and_value_loss_by_hand():
    # One row, 3 response tokens, reward 1 on the last; gamma = lam = 1: the return of every
    # token is 1, the advantage 1 - V before whitening.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    values = torch.tensor([[0.2, 0.4, 0.6], [0.1, 0.3, 0.0]])
    cfg = AlgorithmConfig(adv_estimator="gae")
    adv, returns = algo.compute_advantage(cfg, rewards, mask, np.zeros(2), values)
    assert returns[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert returns[1, :2].tolist() == pytest.approx([0.5, 0.5])
    raw = torch.tensor([0.8, 0.6, 0.4, 0.4, 0.2])
    assert adv[mask.bool()].tolist() == pytest.approx(((raw - raw.mean()) / raw.std()).tolist(), abs=1e-4)
    # Value loss: V moves from old 0.2 to 0.9 against return 1 with clip 0.5: the clipped 0.7
    # is further from the return, so 0.5 * max(0.1^2, 0.3^2) counts.
    loss, clipfrac = algo.value_loss(
        torch.tensor([[0.9]]),
        torch.tensor([[1.0]]),
        torch.tensor([[0.2]]),
        torch.tensor([[1.0]]),
        0.5,
        "token-mean",
        1,
        1,
        1,
    )
    assert loss.item() == pytest.approx(0.5 * 0.09) and clipfrac.item() == 1.0


def test_kl_in_reward_fixed_and_adaptive():
    from verl.trainer.ppo.core_algos import get_kl_controller

    scores = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0], [-1.0, 0.0]])  # kl = old - ref: 0.5, 0; -1 (last masked)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    fixed = get_kl_controller(KLControlConfig(kl_coef=0.1))
    rewards, m = algo.kl_in_reward(scores, old, ref, mask, "kl", fixed)
    assert rewards.flatten().tolist() == pytest.approx([-0.05, 1.0, 0.1, 0.0])
    assert m["actor/reward_kl_penalty"] == pytest.approx((0.25 + -1.0) / 2)
    adaptive = get_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.1, horizon=10))
    algo.kl_in_reward(scores, old, ref, torch.ones_like(mask), "abs", adaptive)
    # current KL (0.25 + 0.5) / 2 = 0.375 is above target: error clipped at +0.2, x 2 samples / 10
    assert adaptive.value == pytest.approx(0.1 * (1 + 0.2 * 2 / 10))


def test_trainer_logprobs_match_engine_behaviour_logprobs(tmp_path):
    builtin_task.write_model(tmp_path / "m")
    engine = HFEngine(str(tmp_path / "m"))
    prompts = [[4, 5, 6, 13], [7, 13]]
    groups = engine.generate(prompts, SamplingSettings(n=3, temperature=0.7, top_p=1.0, max_tokens=5, seed=3))
    samples = [
        _sample(f"g{i}", k, prompts[i], c.token_ids, 0.0, c.logprobs, temperature=0.7)
        for i, g in enumerate(groups)
        for k, c in enumerate(g)
    ]
    batch = collate(samples)
    with torch.no_grad():
        lp, _ = algo.response_logprobs(engine.model, batch)
    # The same fp32 weights, cached decoding vs one full forward: they differ by the rounding of
    # |logprob| <= ~3 (measured 4.8e-7, two ulps); 1e-4 leaves 200x for other CPUs' kernels.
    assert torch.allclose(lp * batch.response_mask, batch.behaviour_logprobs, atol=1e-4)
