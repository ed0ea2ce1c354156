"""Non-finite values never reach a published weight version or a shard: the trainer skips
steps with a non-finite loss or gradient (and stops after trainer.max_nonfinite_steps in a row),
the worker drops samples whose reward is not a finite float32 (and goes on)."""

import json
import math

import pytest
import torch
from conftest import run_folder, trainer_proc

from buffer.weights.fs import WeightStore
from protocol.config import ConfigError, build
from trainer.config import TrainerConfig


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_non_finite_learning_rate_is_refused_at_config_time(value):
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.optim\.lr"):
        build(
            TrainerConfig, {"root": "r", "actor_rollout_ref.model.path": "m", "actor_rollout_ref.actor.optim.lr": value}
        )


def test_non_finite_steps_are_skipped_and_never_published(experience):
    """lr=1e30 is finite, so it passes the config; one step makes the weights ~1e30 and from
    the next step the logits overflow: loss and gradient are NaN. Those steps are skipped
    (counted, logged), the weights stay finite, and after 2 in a row the trainer stops with the
    reason."""
    root = run_folder(experience, "nonfinite")
    p = trainer_proc(
        root, experience / "model", 2, "actor_rollout_ref.actor.optim.lr=1e30", "trainer.max_nonfinite_steps=2", steps=8
    )
    out, _ = p.communicate(timeout=300)
    assert p.returncode != 0, out[-3000:]
    assert "2 steps in a row had a non-finite loss or gradient" in out, out[-3000:]
    assert "skipped: non-finite" in out
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in rows if r["actor/skipped_nonfinite"]]
    assert len(skipped) == 2 and rows[-1]["actor/skipped_steps"] == 2
    store = WeightStore(str(root))
    assert store.versions(), "nothing was published"
    for v in store.versions():
        for name, t in store.tensors(v):
            assert torch.isfinite(t).all(), f"v{v} {name} is not finite"
    for r in skipped:  # a skipped step leaves the weights as they were
        assert (
            math.isnan(r["actor/grad_norm"])
            or math.isinf(r["actor/grad_norm"])
            or not math.isfinite(r["actor/pg_loss"])
        )


def test_non_finite_critic_steps_are_counted_during_critic_warmup(experience):
    """GAE with critic.optim.lr=1e30 and the actor still in trainer.critic_warmup: the critic's
    steps go non-finite from step 2 (its weights ~1e30 after step 1); they are counted although
    the step has no actor metrics, and the trainer stops after 2 in a row."""
    root = run_folder(experience, "nonfinite_critic")
    p = trainer_proc(
        root,
        experience / "model",
        1,
        "algorithm.adv_estimator=gae",
        "critic.optim.lr=1e30",
        "trainer.critic_warmup=8",
        "trainer.max_nonfinite_steps=2",
        steps=8,
    )
    out, _ = p.communicate(timeout=300)
    assert p.returncode != 0, out[-3000:]
    assert "2 steps in a row had a non-finite loss or gradient" in out, out[-3000:]
    assert "critic.optim.lr" in out
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert all("actor/pg_loss" not in r for r in rows)  # warmup: only the critic trained
    assert [r["critic/skipped_nonfinite"] > 0 for r in rows] == [False, True, True]
    assert rows[-1]["actor/skipped_steps"] == 2


BAD_REWARDS = """
import itertools
_calls = itertools.count()

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    k = next(_calls)
    if k % 7 == 3:
        return float("nan")
    if k % 11 == 5:
        return 1e39  # a finite Python float that float32 cannot hold
    if k % 13 == 8:
        return {"score": float("-inf")}
    return 1.0
"""


def test_bad_rewards_drop_their_samples_and_the_worker_goes_on(tmp_path, caplog):
    from protocol.experience import from_table, load_shard
    from rollout import builtin_task
    from rollout.config import WorkerConfig
    from rollout.worker import RolloutWorker

    builtin_task.write_model(tmp_path / "m0")
    builtin_task.write_parquet(tmp_path / "t.parquet", builtin_task.make_rows(50, 3))
    (tmp_path / "bad_reward.py").write_text(BAD_REWARDS)
    root = tmp_path / "run"
    WeightStore(str(root)).publish_hf_folder(tmp_path / "m0", 0, 0, keep=2)
    cfg = build(
        WorkerConfig,
        {
            "root": str(root),
            "train_files": f"[{tmp_path / 't.parquet'}]",
            "worker.id": "w0",
            "max_response_length": "3",
            "actor_rollout_ref.rollout.n": "4",
            "prompts_per_batch": "10",
            "worker.max_batches": "3",
            "custom_reward_function.path": str(tmp_path / "bad_reward.py"),
        },
    )
    caplog.set_level("WARNING", logger="rollout.worker")
    worker = RolloutWorker(cfg)
    worker.run()
    total = 3 * 10 * 4
    # calls k in [0, 120): k%7==3 -> 17, k%11==5 (not already) -> 9, k%13==8 (neither) -> 8
    bad = [k for k in range(total) if k % 7 == 3 or k % 11 == 5 or k % 13 == 8]
    beat = json.loads((root / "workers" / "w0.json").read_text())
    assert beat["rewards_dropped"] == len(bad)
    assert beat["samples_written"] == total - len(bad)
    lines = [r.getMessage() for r in caplog.records if "dropped a sample" in r.getMessage()]
    assert len(lines) == len(bad) and all("prompt " in ln for ln in lines)
    assert any("nan" in ln for ln in lines) and any("1e+39" in ln for ln in lines)
    rewards = []
    for shard in sorted((root / "experience" / "w0").glob("*.arrow")):
        rewards += [s.reward for s in from_table(load_shard(shard.read_bytes()))]
    assert len(rewards) == total - len(bad) and all(r == 1.0 for r in rewards)
    assert not (root / "quarantine").exists()


def test_bad_rewards_in_validation_drop_their_samples_and_are_counted(tmp_path, caplog):
    """The validator scores with the same reward function: a bad value drops that sample from
    the metrics (val-aux/rewards_dropped counts them), and the version is still answered."""
    from rollout import builtin_task
    from rollout.config import ValidatorConfig
    from rollout.validate import Validator
    from trainer.metrics import MetricsLog
    from trainer.validation import ValidationLog

    builtin_task.write_model(tmp_path / "m0")
    builtin_task.write_parquet(tmp_path / "v.parquet", builtin_task.make_rows(20, 3))
    (tmp_path / "bad_reward.py").write_text(BAD_REWARDS)
    root = tmp_path / "run"
    store = WeightStore(str(root))
    store.publish_hf_folder(tmp_path / "m0", 0, 0, keep=2)
    ValidationLog(store.validation, MetricsLog(str(root / "metrics.jsonl"), 20)).request(0, step=0)
    caplog.set_level("WARNING", logger="rollout.validate")
    validator = Validator(
        build(
            ValidatorConfig,
            {
                "root": str(root),
                "data.val_files": f"[{tmp_path / 'v.parquet'}]",
                "data.max_response_length": "3",
                "custom_reward_function.path": str(tmp_path / "bad_reward.py"),
            },
        )
    )
    assert validator.start() and validator.answer_next()
    bad = [k for k in range(20) if k % 7 == 3 or k % 11 == 5 or k % 13 == 8]  # n=1: one call a prompt
    result = store.validation.result(0)
    assert not result.skipped and result.samples == 20 - len(bad)
    assert result.metrics["val-aux/rewards_dropped"] == len(bad)
    assert result.metrics["val-core/tandem/copy/reward/mean@1"] == 1.0  # only the good 1.0s left
    lines = [r.getMessage() for r in caplog.records if "dropped a sample" in r.getMessage()]
    assert len(lines) == len(bad) and all("prompt " in ln for ln in lines)
    validator.engine.close()
