"""Packed micro-batches (use_remove_padding) against padded ones: the same loss and gradients for
the policy, the reference and the critic passes, with the real tiny Qwen2 (sdpa, whose packed
mask transformers builds from the restarting position ids).

Tolerance: all in fp32. Packing changes only the order of floating-point sums (other matmul
shapes, so other BLAS blockings; masked attention scores contribute exact zeros either way), so
the two paths differ by reassociation: a few ulps of values of order 1-10 per op, measured at
most ~2e-6 on logprobs and ~1e-6 relative on gradients here; atol 1e-5 on logprobs/values and
rtol 1e-4 (atol 1e-6) on gradients leave room for other CPUs' kernels yet catch any token seeing
a neighbour's row (measured 1e-1-sized differences with a leaking mask).
"""

from __future__ import annotations

import torch

from protocol.experience import Sample
from rollout import builtin_task
from trainer import algo
from trainer.batch import collate
from trainer.update import micro

LP_ATOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-4, 1e-6


def _samples() -> list[Sample]:
    # Ragged prompts and responses, temperatures per row: padding differs per row.
    shapes = [(3, 5, 1.0), (7, 2, 0.7), (1, 9, 1.3), (5, 1, 1.0), (2, 6, 0.9)]
    out = []
    for i, (p, r, t) in enumerate(shapes):
        out.append(
            Sample(
                f"s{i}",
                f"g{i // 2}",
                "p",
                "w",
                0,
                [3 + (i * 5 + j) % 9 for j in range(p)],
                [4 + (i * 3 + j) % 8 for j in range(r)],
                [-1.0] * r,
                0.5 * i,
                "stop",
                t,
                "tandem/copy",
                0.0,
                0.0,
            )
        )
    return out


def _model(value_head: bool = False):
    tok = builtin_task.build_tokenizer()
    m = builtin_task.build_model(len(tok), seed=1, hidden=32, layers=2, pad_id=tok.pad_token_id)
    if value_head:  # the critic's shape: the backbone with a one-output head, as trainer/model.py builds it
        from transformers import Qwen2ForTokenClassification

        m.config.num_labels, m.config.classifier_dropout = 1, 0.0  # as build_actor: no dropout
        critic = Qwen2ForTokenClassification(m.config)
        critic.model.load_state_dict(m.model.state_dict())
        m = critic
    m.config._attn_implementation = "sdpa"
    return m.float()


def _grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=GRAD_RTOL, atol=GRAD_ATOL), (
            name,
            float((a[name] - b[name]).abs().max()),
        )


def test_packed_and_padded_policy_and_reference_passes_agree():
    model = _model()
    batch = collate(_samples())
    rows = torch.arange(len(batch))
    padded, packed = micro(batch, rows, packed=False), micro(batch, rows, packed=True)
    assert packed.input_ids.shape == (1, int(batch.attention_mask.sum()))  # no padding token
    adv = torch.linspace(-1, 1, padded.response_mask.numel()).view_as(padded.response_mask)

    def loss(c, chunk):  # the policy's terms: a logprob-weighted advantage and the entropy bonus
        lp, ent = algo.response_logprobs(model, c, with_entropy=True, chunk=chunk)
        return -(lp * adv).sum() / c.response_mask.sum() - 0.01 * ent.sum() / c.response_mask.sum(), lp, ent

    ref_loss, ref_lp, ref_ent = loss(padded, None)  # today's path: padded, full logits
    ref_grads = _grads(model, ref_loss)
    for chunk in (None, 4, 2048):  # packed with full logits; chunked across and within one block
        for c in (packed, padded):
            got, lp, ent = loss(c, chunk)
            assert torch.allclose(lp, ref_lp, atol=LP_ATOL), (chunk, c.is_packed)
            assert torch.allclose(ent, ref_ent, atol=LP_ATOL), (chunk, c.is_packed)
            assert abs(float((got - ref_loss).detach())) < LP_ATOL
            _assert_same_grads(_grads(model, got), ref_grads)
    # The reference pass: no gradient, the same logprobs.
    with torch.no_grad():
        lp_ref, _ = algo.response_logprobs(model, packed)
    assert torch.allclose(lp_ref, ref_lp.detach(), atol=LP_ATOL)
    assert float(lp_ref.abs().sum()) > 1.0  # real values, zeros only past each response


def test_packed_and_padded_critic_passes_agree():
    critic = _model(value_head=True)
    batch = collate(_samples())
    rows = torch.arange(len(batch))
    returns = torch.linspace(-2, 2, batch.response_mask.numel()).view_as(batch.response_mask)
    out = {}
    for packed in (False, True):
        c = micro(batch, rows, packed)
        v = algo.response_values(critic, c)
        loss = ((v - returns[:, : v.shape[1]]) ** 2 * c.response_mask).sum() / c.response_mask.sum()
        out[packed] = (v.detach(), float(loss), _grads(critic, loss))
    assert torch.allclose(out[True][0], out[False][0], atol=LP_ATOL)
    assert abs(out[True][1] - out[False][1]) < LP_ATOL
    _assert_same_grads(out[True][2], out[False][2])


def test_packed_token_budget_counts_real_tokens():
    from trainer.config import ActorConfig
    from trainer.update import micro_batches

    cfg = ActorConfig(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=12)
    lengths = [8, 3, 11, 4, 1, 12]
    got = micro_batches(torch.arange(6), lengths, cfg, packed=True)
    assert all(sum(lengths[i] for i in b.tolist()) <= 12 for b in got)
    assert sorted(i for b in got for i in b.tolist()) == list(range(6))
    assert sorted(sum(lengths[i] for i in b.tolist()) for b in got) == [8, 8, 11, 12]  # [12], [11], [8], [4, 3, 1]
    assert len(micro_batches(torch.arange(6), lengths, cfg, packed=False)) == 5  # padded: rows x longest, in order


def test_packed_micro_batches_are_balanced_not_a_full_run_and_a_remainder():
    """verl's dynamic batching: ceil(total / budget) micro-batches of about equal tokens. First
    fit gave [30, 30, 10] here (and a 1,590-token micro-batch beside four of ~16,300 on H200)."""
    from trainer.update import balanced

    assert sorted(sum([10] * len(b)) for b in balanced([10] * 7, 30)) == [20, 20, 30]
    # at_least: the busiest rank's count, so this rank splits finer instead of a padding pass
    assert sorted(len(b) for b in balanced([10] * 7, 30, at_least=5)) == [1, 1, 1, 2, 2]
    assert balanced([40, 5], 30) == [[0], [1]]  # a row over the budget goes alone
    assert balanced([5, 5], 30, at_least=4) == [[0], [1]]  # never an empty micro-batch


def test_balanced_micro_batches_keep_every_row_once_within_budget_and_no_more_than_first_fit():
    """3,000 random cases (seeded): every row once, no micro-batch over the budget unless one
    row alone, never more micro-batches than first fit (or `at_least`), the heaviest no heavier
    than first fit's (LPT only moves tokens from full bins to light ones)."""
    import random

    from trainer.sft_data import micro_batches as first_fit
    from trainer.update import balanced

    rng = random.Random(7)
    for _ in range(3000):
        n, budget, at_least = rng.randint(0, 40), rng.randint(1, 70), rng.randint(1, 12)
        lengths = [rng.randint(1, 60) for _ in range(n)]
        got = balanced(lengths, budget, at_least)
        fit = first_fit(lengths, list(range(n)), budget, None)
        assert sorted(i for b in got for i in b) == list(range(n))
        assert all(b and (len(b) == 1 or sum(lengths[i] for i in b) <= budget) for b in got)
        assert len(got) <= max(len(fit), min(at_least, n))
        if at_least == 1 and n:
            assert max(sum(lengths[i] for i in b) for b in got) <= max(sum(lengths[i] for i in b) for b in fit)


def test_varlen_attention_takes_half_precision_and_refuses_float32_outside_autocast():
    """FlashAttention (torch's varlen kernel, the trainer's packed path on GPU) runs in fp16/bf16
    only: half inputs pass through `_half` unchanged; float32 ones outside autocast are refused
    with the setting to change, not run at a silently lower precision. (Under CUDA autocast they
    are cast to its dtype: tests/gpu/test_packed_grads_cuda.py, which failed on the kernel's own
    "only support fp16 and bf16" before this.)"""
    import pytest

    from trainer import attention

    q = torch.zeros(1, 2, 5, 4, dtype=torch.bfloat16)
    dtype, *qkv = attention._half(q, q, q)
    assert dtype == torch.bfloat16 and all(t is q for t in qkv)
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    with pytest.raises(ValueError, match="float32 inputs outside autocast.*attn_implementation=sdpa"):
        attention.varlen_attention(None, q.float(), q.float(), q.float(), None, position_ids=pos)
