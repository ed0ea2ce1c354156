"""Trainer options on real processes: token-budget micro-batches, uneven shares, KL/entropy, lr."""
import json

import pytest
from safetensors.torch import load_file

from conftest import final_weights, run_folder, trainer_proc


def _run(experience, name, nproc, *extra, steps=2, groups=4):
    root = run_folder(experience, name)
    p = trainer_proc(root, experience / "model", nproc, *extra, steps=steps, groups=groups)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    return root


def test_token_budget_micro_batches_give_the_same_update(experience):
    fixed = _run(experience, "fixed", 2, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64")
    dynamic = _run(experience, "dynamic", 2, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=12")  # about 2 rows each
    a, b = final_weights(fixed), final_weights(dynamic)
    init = load_file(str(experience / "model" / "model.safetensors"))
    # Norms over all weights: Adam turns float-order noise in near-zero gradients into single
    # elements that move by up to lr, so an element-wise max would test the noise, not the maths.
    moved = sum(((a[k] - init[k]) ** 2).sum().item() for k in a) ** 0.5
    differ = sum(((a[k] - b[k]) ** 2).sum().item() for k in a) ** 0.5
    assert moved > 1e-2 and differ < 0.01 * moved, (moved, differ)


def test_uneven_shares_kl_entropy_and_cosine_warmup(experience):
    # 3 groups over 2 ranks: one rank has twice the micro-batches of the other.
    root = _run(experience, "options", 2, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01",
                "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5",
                "actor_rollout_ref.actor.optim.warmup_style=cosine",
                "actor_rollout_ref.model.enable_gradient_checkpointing=true", steps=4, groups=3)
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["actor/lr"] for r in rows] == pytest.approx([5e-3, 1e-2, 5e-3, 0.0], abs=1e-9)
    assert all(r["samples/step"] == 12 for r in rows)
    assert rows[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # the actor starts at the ref
    assert rows[-1]["actor/kl_loss"] > 1e-6
    assert all(r["actor/entropy"] > 0.1 for r in rows)


def test_tensorboard_logger_through_verl_tracking(experience):
    root = _run(experience, "tb", 1, "trainer.logger=[console,tensorboard]", steps=2)
    events = list((root / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(root / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]
