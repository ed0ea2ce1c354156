"""Synchronous rollouts (trainer.max_staleness=0), the engine/trainer mismatch metrics and the
timing a run reports: the claims alone, the metrics on the real tiny model, and the whole
pipeline through launch.local with 1 and 2 workers over both transports."""

import collections
import json
import math
import os
import subprocess

import pytest
import torch
from conftest import free_port, launch_local

from buffer.layout import RunLayout
from buffer.run import setup_trainer_run
from launch.local import rl_metrics
from protocol.config import build
from protocol.experience import decode, from_table
from trainer import algo
from trainer.config import TrainerConfig
from trainer.main import sync_groups

# fp32 CPU, the engine and the trainer holding the same weights: the only difference is the
# order of fp32 operations (KV-cached decoding of a left-padded batch vs one right-padded full
# forward), a few ulps of O(1) logits, so each log-ratio l is below ~1e-6 and k3 ~ l^2/2 below
# ~1e-12 (measured ~1e-14). 1e-9 leaves three orders of margin; samples one version stale (every
# weight moved by 1e-3, as one Adam step at lr 1e-3 moves it) give ~2e-4, asserted beside it.
FP32_MISMATCH_BOUND = 1e-9


def test_claims_hand_out_each_slot_once_and_stop_at_a_retired_version(tmp_path):
    layout, claims = RunLayout(str(tmp_path)), setup_trainer_run(str(tmp_path)).sync
    claims.open_version(3)
    got = [claims.claim(3, groups=5, want=2, worker_id=w) for w in ("a", "b", "a", "b")]
    assert got == [2, 2, 1, 0]
    assert sorted(claims.claims(3).items()) == [(0, "a"), (1, "a"), (2, "b"), (3, "b"), (4, "a")]
    claims.open_version(4)
    assert claims.retire_before(4) == 1 and sorted(os.listdir(layout.sync_dir)) == ["v000004"]
    assert claims.claim(3, groups=5, want=5, worker_id="late") == 0  # gone: nothing claimed
    assert not os.path.exists(layout.sync_version_dir(3))


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ({}, [16, 16, 16, 0]),  # one batch per step, nothing for the final version
        ({"trainer.publish_freq": 2}, [32, 16, 0]),  # published after steps 2, 3 (the last), ...
        ({"trainer.publish_freq": 2, "trainer.test_freq": 1}, [16, 16, 16, 0]),  # validation publishes
    ],
)
def test_sync_groups_cover_every_step_until_the_next_publish(overrides, expected):
    cfg = build(
        TrainerConfig,
        {"root": "/r", "actor_rollout_ref.model.path": "/m", "trainer.total_training_steps": 3, **overrides},
    )
    publish_steps = [0] + [
        s
        for s in range(1, 4)
        if s % cfg.trainer.publish_freq == 0 or s == 3 or (cfg.trainer.test_freq > 0 and s % cfg.trainer.test_freq == 0)
    ]
    assert [sync_groups(cfg.trainer, 16, s) for s in publish_steps] == expected
    assert sum(expected) == 16 * 3  # every step's batch is announced exactly once


def _samples(engine, prompts, seed):
    from protocol.experience import Sample
    from rollout.engine import SamplingSettings

    groups = engine.generate(prompts, SamplingSettings(n=4, temperature=1.0, top_p=1.0, max_tokens=6, seed=seed))
    return [
        Sample("", "", str(i), "w0", 0, p, c.token_ids, c.logprobs, 0.0, c.finish_reason, 1.0, "tandem/copy", 0.0, 0.0)
        for i, (p, g) in enumerate(zip(prompts, groups))
        for c in g
    ]


def test_mismatch_kl_is_tiny_at_staleness_0_and_excludes_stale_samples(tmp_path):
    """The real tiny model: samples of the trainer's own weights (fresh) and of other weights,
    as one update earlier (stale), recomputed by the trainer's logprob function."""
    from transformers import AutoModelForCausalLM

    from rollout import builtin_task
    from rollout.engine import HFEngine
    from trainer.batch import collate

    builtin_task.write_model(tmp_path / "m")
    torch.manual_seed(0)
    trainer_model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    prompts = [[3 + (i * 3 + j) % 5 for j in range(3)] + [13] for i in range(6)]
    fresh_engine = HFEngine(str(tmp_path / "m"), "float32", "cpu")
    stale_engine = HFEngine(str(tmp_path / "m"), "float32", "cpu")
    with torch.no_grad():  # the version before: every weight moved by ~lr (Adam, lr 1e-3)
        for p in stale_engine.model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    samples = _samples(fresh_engine, prompts, seed=1) + _samples(stale_engine, prompts, seed=2)
    fresh = torch.tensor([True] * (len(samples) // 2) + [False] * (len(samples) // 2))
    batch = collate(samples)
    with torch.no_grad():
        old = algo.response_logprobs(trainer_model, batch)[0]

    def metrics(rows, cap=2.0):
        return algo.mismatch_metrics(
            algo.mismatch_sums(old, batch.behaviour_logprobs, batch.response_mask, rows, cap).tolist()
        )

    m = metrics(fresh)
    fresh_tokens = int(batch.response_mask[fresh].sum())
    assert m["rollout/mismatch_tokens"] == fresh_tokens > 0
    assert 0 <= m["rollout/mismatch_kl"] < FP32_MISMATCH_BOUND, m
    stale = metrics(~fresh)["rollout/mismatch_kl"]
    assert stale > 1e4 * FP32_MISMATCH_BOUND  # what the bound would catch, had they counted
    # No staleness-0 sample: the metric is absent, not NaN.
    assert "rollout/mismatch_kl" not in metrics(torch.zeros_like(fresh))
    # The truncated fraction counts exactly the tokens whose weight the loss caps at C.
    cap = 1.01
    raw = torch.exp(old - batch.behaviour_logprobs) * batch.response_mask
    capped = algo.truncated_is_weights(old, batch.behaviour_logprobs, batch.response_mask, cap)
    truncated = int(((capped < raw) & batch.response_mask.bool()).sum())
    assert truncated > 0  # the stale half has ratios above 1.01
    assert (
        metrics(fresh, cap)["rollout_corr/rollout_is_ratio_fraction_high"]
        == truncated / batch.response_mask.sum().item()
    )


STEPS, GROUPS, N = 4, 4, 4


@pytest.mark.parametrize("workers,transport", [(1, "fs"), (2, "grpc")])
def test_synchronous_pipeline_trains_every_sample_at_staleness_0(tmp_path, workers, transport):
    root = tmp_path / "run"
    port = free_port()
    grpc = {
        "fs": [],
        "grpc": [
            "--trainer",
            "buffer.transport=grpc",
            "--trainer",
            f"buffer.grpc_bind=127.0.0.1:{port}",
            "--worker",
            "buffer.transport=grpc",
            "--worker",
            f"buffer.grpc_address=127.0.0.1:{port}",
        ],
    }[transport]
    proc = subprocess.run(
        launch_local(
            "--root",
            str(root),
            "--steps",
            str(STEPS),
            "--nproc",
            "1",
            "--workers",
            str(workers),
            "--test-freq",
            "0",
            "--timeout",
            "400",
            "--trainer",
            "trainer.max_staleness=0",
            "--trainer",
            f"data.train_batch_size={GROUPS}",
            "--worker",
            f"actor_rollout_ref.rollout.n={N}",
            # two claims per version for one worker; for two, one each when balanced
            "--worker",
            "actor_rollout_ref.rollout.prompts_per_batch=2",
            *grpc,
        ),
        capture_output=True,
        text=True,
        timeout=500,
        env=dict(os.environ, TANDEM_GRPC_TOKEN="sync-test-token"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows, _ = rl_metrics(setup_trainer_run(str(root)))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["staleness/max"] == 0 and r["buffer/dropped_stale_samples"] == 0, r
        assert r["buffer/bad_shards"] == 0
        # every sample fresh: the KL covers all of the step's tokens
        assert r["rollout/mismatch_tokens"] == r["tokens/step"]
        assert 0 <= r["rollout/mismatch_kl"] < FP32_MISMATCH_BOUND, r
        assert 0 <= r["rollout_corr/rollout_is_ratio_fraction_high"] <= 1
        assert math.isclose(r["time/wait_fraction"], r["time/wait_s"] / r["time/step_s"])
    assert rows[-1]["samples/consumed"] == STEPS * GROUPS * N
    # Nothing left over: what the workers wrote is what the trainer consumed, one batch per
    # version 0..STEPS-1 and nothing for the final version.
    beats = [json.loads(p.read_text()) for p in (root / "workers").glob("*.json")]
    # Over gRPC a heartbeat reaches the trainer's folder only through its run service: a worker
    # that started so late on a loaded box that the trainer had finished and stopped serving
    # leaves none (seen in CI: w0 took every group; w1 had nothing to do)
    assert len(beats) == workers if transport == "fs" else 1 <= len(beats) <= workers, beats
    assert sum(b["samples_written"] for b in beats) == STEPS * GROUPS * N
    per_version = collections.Counter()
    for shard in (root / "experience").rglob("*.arrow"):
        per_version.update(s.weight_version for s in from_table(decode(shard.read_bytes())))
    assert per_version == {v: GROUPS * N for v in range(STEPS)}
    assert os.listdir(root / "sync") == [f"v{STEPS:06d}"]  # older claim folders retired
    for b in beats:
        assert b["state"] == "stopped" and b["synchronous"] is True, b
        # reloads happen between batches: generating time excludes them
        assert b["reloads"] >= 1 and b["reload_s"] > 0 and b["wait_s"] > 0, b
        # a worker that started late on a loaded box may find every group already claimed
        assert (b["generate_s"] > 0) == (b["samples_written"] > 0), b
        if b["generate_s"] > 0:
            assert math.isclose(b["reload_fraction"], b["reload_s"] / b["generate_s"])


def test_trainer_without_workers_names_the_claims_when_it_gives_up(tmp_path):
    from conftest import trainer_proc

    from rollout import builtin_task

    builtin_task.write_model(tmp_path / "m")
    p = trainer_proc(
        tmp_path / "run",
        tmp_path / "m",
        1,
        "trainer.max_staleness=0",
        "trainer.data_timeout_s=3",
        steps=2,
        groups=GROUPS,
    )
    out, _ = p.communicate(timeout=300)
    assert p.returncode != 0
    assert "Synchronous mode: 0 of the groups of v0 were claimed, by no worker" in out, out[-3000:]
    latest = json.loads((tmp_path / "run" / "weights" / "LATEST").read_text())
    assert latest == {"version": 0, "step": 0, "sync_groups": GROUPS}


DROP_FIRST_TWO_GROUPS = """
from rollout import reward
from rollout.builtin_task import compute_score

CALLS = [0]


def score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS[0] += 1
    if CALLS[0] <= 2 * {n}:  # every sample of the first two groups scored
        raise reward.RewardError("test: this group's rewards are dropped")
    return compute_score(data_source, solution_str, ground_truth, extra_info)
"""


def test_a_synchronous_group_whose_rewards_are_all_dropped_is_drawn_again(tmp_path):
    """Issue 30: the trainer waits for every group a worker claimed; a group of which every
    reward was dropped is written by no one unless the worker draws it again (it would wait
    until trainer.data_timeout_s)."""
    n, groups = 2, 4
    fn = tmp_path / "reward_fn.py"
    fn.write_text(DROP_FIRST_TWO_GROUPS.format(n=n))
    root = tmp_path / "run"
    args = ["--steps", "1", "--nproc", "1", "--workers", "1", "--test-freq", "0", "--timeout", "300"]
    for role, opt in [
        ("trainer", "trainer.max_staleness=0"),
        ("trainer", f"data.train_batch_size={groups}"),
        ("trainer", "trainer.data_timeout_s=30"),
        ("worker", f"actor_rollout_ref.rollout.n={n}"),
        ("worker", "actor_rollout_ref.rollout.prompts_per_batch=2"),
        ("worker", f"custom_reward_function.path={fn}"),
        ("worker", "custom_reward_function.name=score"),
    ]:
        args += [f"--{role}", opt]
    proc = subprocess.run(
        launch_local("--root", str(root), *args),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows, _ = rl_metrics(setup_trainer_run(str(root)))
    assert [r["step"] for r in rows] == [1] and rows[-1]["samples/consumed"] == groups * n
    [beat] = [json.loads(p.read_text()) for p in (root / "workers").glob("*.json")]
    assert beat["rewards_dropped"] == 2 * n and beat["samples_written"] == groups * n, beat
