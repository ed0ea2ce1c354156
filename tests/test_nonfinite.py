"""Non-finite values never reach a published weight version or a shard: the trainer skips
steps with a non-finite loss or gradient (and stops after trainer.max_nonfinite_steps in a row),
the worker drops samples whose reward is not a finite float32 (and goes on)."""
import json
import math

import pytest
import torch

from buffer.weights import WeightStore
from conftest import run_folder, trainer_proc
from protocol.config import ConfigError, build
from trainer.config import TrainerConfig


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_non_finite_learning_rate_is_refused_at_config_time(value):
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.optim\.lr"):
        build(TrainerConfig, {"root": "r", "actor_rollout_ref.model.path": "m",
                              "actor_rollout_ref.actor.optim.lr": value})


def test_non_finite_steps_are_skipped_and_never_published(experience):
    """lr=1e30 is finite, so it passes the config; one step makes the weights ~1e30 and from
    the next step the logits overflow: loss and gradient are NaN. Those steps are skipped
    (counted, logged), the weights stay finite, and after 2 in a row the trainer stops with the
    reason."""
    root = run_folder(experience, "nonfinite")
    p = trainer_proc(root, experience / "model", 2, "actor_rollout_ref.actor.optim.lr=1e30",
                     "trainer.max_nonfinite_steps=2", steps=8)
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
        assert math.isnan(r["actor/grad_norm"]) or math.isinf(r["actor/grad_norm"]) \
            or not math.isfinite(r["actor/pg_loss"])
