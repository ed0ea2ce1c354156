"""Validation: launch.local's held-out questions, rollout.validate answering the trainer's requests (a pruned
version is skipped with a message, nothing waits on it), verl's metric names, and the whole
pipeline logging held-out accuracy every test_freq steps while it rises."""

import itertools
import json
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from conftest import run_folder, subprocess_env, trainer_proc

from buffer.layout import RunLayout
from buffer.run import setup_trainer_run
from buffer.weights.fs import WeightStore
from launch import status
from launch.local import parse_args, prepare
from protocol.config import build
from rollout import builtin_task
from rollout.config import ValidatorConfig
from rollout.validate import Validator, val_metrics
from trainer.metrics import MetricsLog
from trainer.validation import ValidationLog

CORE = "val-core/tandem/copy/reward/mean@1"


def _metrics(root) -> tuple[list[dict], list[dict]]:
    """(trainer rows, validation rows) of a run's metrics.jsonl."""
    return status.split_metrics(status.read_metrics(setup_trainer_run(str(root))))


def _questions(path) -> list[str]:
    return [r["prompt"][0]["content"] for r in pq.read_table(path).to_pylist()]


def test_launch_local_holds_out_questions_for_validation(tmp_path):
    layout = RunLayout(str(tmp_path / "run"))
    model, data, val = prepare(setup_trainer_run(layout.root), parse_args(["--root", layout.root]), {})
    assert (data, val) == (layout.prepared_parquet("rl", "train"), [layout.prepared_parquet("rl", "val")])
    train, held = set(_questions(data)), set(_questions(val[0]))
    assert len(held) == 25 and not train & held  # a fifth of the 125 strings, never trained on
    assert (
        prepare(
            setup_trainer_run(str(tmp_path / "b")),
            parse_args(["--root", str(tmp_path / "b"), "--model", model, "--test-freq", "0"]),
            {},
        )[2]
        is None
    )
    assert (
        prepare(
            setup_trainer_run(str(tmp_path / "c")),
            parse_args(["--root", str(tmp_path / "c"), "--model", model, "--data", data]),
            {},
        )[2]
        is None
    )


def test_launch_local_validates_as_a_verl_config_says(tmp_path):
    from launch import local

    model = tmp_path / "m"
    builtin_task.write_model(model)
    file = tmp_path / "grpo.yaml"
    file.write_text(
        "data:\n  train_files: [/d/train.parquet]\n  val_files: [/d/test.parquet]\ntrainer:\n  test_freq: 5\n"
    )

    def plan(root, *flags):
        run = setup_trainer_run(str(tmp_path / root))
        args = parse_args(["--root", run.root, "--config", str(file), "--model", str(model), *flags])
        config = local.from_config(args, run)
        _, data, val = prepare(run, args, config)
        return val, local.role_args(run, args, str(model), data, config, val)

    val, (trainer, _, validator) = plan("a")
    assert val == ["/d/test.parquet"] and "trainer.test_freq=5" in trainer
    assert validator[:2] == ["--config", str(file)] and "data.val_files=[/d/test.parquet]" in validator
    val, (trainer, _, validator) = plan("b", "--test-freq", "0")  # off: the trainer asks for none
    assert val is None and validator is None and "trainer.test_freq=-1" in trainer


def test_val_metrics_use_verls_names_and_core_variable():
    # two responses per prompt; a reward function reporting acc makes acc the core variable
    m = val_metrics(
        ["a", "a", "b", "b"], ["0", "0", "1", "1"], {"reward": [1.0, 0.0, 0.5, 0.5], "acc": [1.0, 0.0, 1.0, 1.0]}
    )
    assert m["val-core/a/acc/mean@2"] == 0.5 and m["val-core/b/acc/mean@2"] == 1.0
    assert m["val-aux/a/reward/mean@2"] == 0.5 and "val-aux/a/acc/std@2" in m
    assert "val-core/a/acc/best@2/mean" in m
    assert val_metrics(["c"], ["0"], {"reward": [0.25]}) == {"val-core/c/reward/mean@1": 0.25}


def _publish(store, model_dir, version, step):
    store.publish_hf_folder(model_dir, version, step, keep=1)


def test_pruned_version_is_skipped_with_a_message_and_nothing_waits(tmp_path, caplog, capsys):
    model = tmp_path / "m"
    builtin_task.write_model(model)
    val = tmp_path / "val.parquet"
    builtin_task.write_parquet(val, builtin_task.make_rows(20, 3))
    root = tmp_path / "run"
    store = WeightStore(str(root))
    metrics = MetricsLog(str(root / "metrics.jsonl"), 20)
    trainer_side = ValidationLog(store.validation, metrics)
    # The trainer's order: publish, then request. keep_versions=1 also bounds the held ones to
    # one: the validator has not started, so v5 (step 5) is pruned when v15 is published.
    for version in (0, 5, 10, 15):
        _publish(store, model, version, version)
        if version in (5, 10):
            trainer_side.request(version, step=version)
    assert store.versions() == [10, 15]  # v10 held for validation beyond the newest one
    assert "pruning weight version 5 before its validation" in caplog.text

    validator = Validator(
        build(ValidatorConfig, {"root": str(root), "data.val_files": f"[{val}]", "data.max_response_length": "3"})
    )
    validator.start()
    assert validator.answer_next() and validator.answer_next()
    assert not validator.answer_next()  # nothing open: False at once, it never waits for a version
    skipped, done = store.validation.result(5), store.validation.result(10)
    assert "no longer on disk" in skipped.skipped and not skipped.metrics
    assert not done.skipped and done.prompts == done.samples == 20 and 0 <= done.metrics[CORE] <= 1
    assert store.validation.held() == []
    _publish(store, model, 20, 20)
    assert store.versions() == [20]  # answered: v10 is released and pruned

    trainer_side.collect(step_now=20)
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["val/weights_version"]) for r in rows] == [(5, 5), (10, 10)]
    assert "no longer on disk" in rows[0]["val/skipped"] and CORE not in rows[0]
    assert rows[1][CORE] == done.metrics[CORE] and rows[1]["val/logged_at_step"] == 20
    out = capsys.readouterr().out
    assert "validation of step 5 (weights v5): skipped: weight version 5 is no longer on disk" in out
    assert f"validation of step 10 (weights v10): {CORE}" in out

    # The end of a run never hangs on a result that will not come: a stopped validator ends the
    # wait at once; without a heartbeat the timeout does (0 s here).
    trainer_side.request(20, step=20)
    validator.heartbeat("stopped")
    t0 = time.monotonic()
    trainer_side.finish(timeout_s=600, step_now=20)
    # 60 s: far below the 600 s a wait would last, far above one look at two small files
    assert time.monotonic() - t0 < 60 and "the validator has stopped" in caplog.text
    (root / "validation" / "validator.json").unlink()
    trainer_side.finish(timeout_s=0, step_now=20)
    assert "trainer.val_timeout_s=0 s passed" in caplog.text
    # The validator answers what is open even after DONE, then exits by itself.
    (root / "DONE").write_text("{}")
    Validator(validator.cfg).run()
    assert store.validation.result(20).metrics[CORE] >= 0
    assert json.loads((root / "validation" / "validator.json").read_text())["state"] == "stopped"


def test_trainer_logs_results_to_every_logger_with_their_step(experience, tmp_path):
    """The trainer and a validator as processes, on the shared fixed experience."""
    root = run_folder(experience, "validated")
    val = tmp_path / "val.parquet"
    builtin_task.write_parquet(val, builtin_task.make_rows(20, 3))
    validator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout.validate",
            f"root={root}",
            f"data.val_files=[{val}]",
            "data.max_response_length=3",
            "validator.poll_interval_s=0.2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    )
    trainer = None
    try:
        trainer = trainer_proc(
            root,
            experience / "model",
            1,
            "trainer.test_freq=2",
            "trainer.logger=[console,tensorboard]",
            "trainer.val_timeout_s=240",
            steps=5,
        )
        out, _ = trainer.communicate(timeout=400)
        assert trainer.returncode == 0, out[-3000:]
        vout, _ = validator.communicate(timeout=120)  # exits by itself once DONE is written
        assert validator.returncode == 0, vout[-3000:]
    finally:
        for p in (validator, trainer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    rows, vals = _metrics(root)
    assert len(rows) == 5
    # v0, every 2 steps, and the last step (5: not a multiple of test_freq, published anyway)
    assert [(v["step"], v["val/weights_version"]) for v in vals] == [(0, 0), (2, 2), (4, 4), (5, 5)]
    assert "validation of step 5 (weights v5)" in out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(root / "tensorboard"))
    acc.Reload()
    # Trackers get each result at the step it arrived (wandb drops earlier steps); val/step says
    # which step's weights it measured.
    assert [e.step for e in acc.Scalars(CORE)] == [v["val/logged_at_step"] for v in vals]
    assert [e.value for e in acc.Scalars(CORE)] == pytest.approx([v[CORE] for v in vals])
    assert [e.value for e in acc.Scalars("val/step")] == [0, 2, 4, 5]


def _best_constant_answer(rows) -> float:
    """The held-out score of the best fixed 3-digit answer: what a model that ignores the
    prompt can reach at most."""
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    return max(
        sum(builtin_task.compute_score("tandem/copy", "".join(c), t) for t in truths) / len(truths)
        for c in itertools.product("0123456789", repeat=3)
    )


def test_pipeline_logs_held_out_accuracy_every_test_freq_steps_and_it_rises(status_run):
    """On the run tests/test_status_report.py observes (launch.local, 60 steps, --test-freq 20;
    exited 0, checked there): a worker and the trainer paused a while, one bad shard quarantined."""
    from test_status_report import FREQ as freq
    from test_status_report import STEPS as steps

    root, live = status_run
    rows, vals = _metrics(root)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # v0 (val_before_train), then every test_freq steps; publish_freq=1, so version = step
    assert [(v["step"], v["val/weights_version"]) for v in vals] == [(s, s) for s in range(0, steps + 1, freq)]
    held_out = pq.read_table(RunLayout(str(root)).prepared_parquet("rl", "val")).to_pylist()
    assert all(v["val/prompts"] == len(held_out) and v["val/logged_at_step"] >= v["step"] for v in vals)
    # Greedy answers of the random-init model hold no digit (0.0). The best fixed answer scores
    # 0.34 on these prompts, never in training; the first thing the model learns, repeating the
    # prompt's first digit, scores 0.49, and README command 1's run was at 0.64 at step 60.
    # Requiring 0.1 above the best fixed answer (a tenth more of all answer positions right)
    # asks for learning that carries over to unseen prompts.
    floor = _best_constant_answer(held_out) + 0.1
    assert vals[0][CORE] < floor and vals[-1][CORE] > floor, [v[CORE] for v in vals]
    assert f"validation (held-out prompts) {CORE}: step 0" in live["local_out"]
