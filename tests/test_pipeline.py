"""The whole loop as real processes: launch.local with a 2-rank trainer, 2 workers and the
validator."""

import json
import os
import signal
import subprocess
import time

from conftest import launch_local

from buffer.run import setup_trainer_run
from launch.local import rl_metrics
from protocol.experience import decode, from_table

REQUIRED = {"step", "weights/version", "reward/mean", "staleness/mean", "samples/consumed", "time/step_s"}


def test_local_pipeline_runs_steps_and_reloads_weights(tmp_path):
    root = tmp_path / "run"
    steps = 6
    proc = subprocess.run(
        launch_local("--root", str(root), "--steps", str(steps), "--timeout", "400", "--nproc", "2"),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows, vals = rl_metrics(setup_trainer_run(str(root)))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # the validator (on by default) measured v0 and the last step (test_freq 10 > steps)
    assert [[p[0] for p in points] for points in vals.values()] == [[0, steps]]
    for r in rows:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert r["staleness/mean"] <= 4  # trainer.max_staleness of the built-in recipe
    assert [r["weights/version"] for r in rows] == list(range(steps))  # publish_freq=1
    assert rows[-1]["samples/consumed"] == sum(r["samples/step"] for r in rows)
    assert (root / "DONE").exists()
    # Each worker stopped cleanly and loaded later versions in place.
    for w in ("w0", "w1"):
        beat = json.loads((root / "workers" / f"{w}.json").read_text())
        assert beat["state"] == "stopped"
        assert len(set(beat["versions_loaded"])) >= 2, beat
    # Every published shard is complete and every sample names a version that was published.
    versions = set()
    for shard in (root / "experience").rglob("*.arrow"):
        versions |= {s.weight_version for s in from_table(decode(shard.read_bytes()))}
    assert versions and versions <= set(range(steps + 1))
    assert not list((root / "experience").rglob(".*tmp-*"))
    assert "reward/mean: first" in proc.stdout and "validation (held-out prompts" in proc.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_stops_every_process(tmp_path):
    root = tmp_path / "run"
    # A shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT: a
    # suite run as `... &` would then send a Ctrl-C the launcher never sees. A terminal's Ctrl-C
    # reaches a process whose SIGINT is at its default, so start it that way.
    proc = subprocess.Popen(
        launch_local("--root", str(root), "--steps", "500", "--timeout", "300", "--nproc", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 240

        def _beats() -> list:
            found = [*(root / "workers").glob("*.json"), root / "validation" / "validator.json"]
            return [p for p in found if p.exists()]

        # One worker can fill the trainer's first step before the other (or the validator) has
        # written its first heartbeat, so wait for a step and for all three beats.
        metrics = root / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text()) or len(_beats()) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"in 240 s: metrics.jsonl={metrics.exists()}, heartbeats={_beats()}"
            )
            time.sleep(0.5)
        beats = _beats()
        pids = [json.loads(p.read_text())["pid"] for p in beats]
        assert len(pids) == 3
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err
    assert not any(_pid_alive(p) for p in pids)
    for beat in beats:
        assert json.loads(beat.read_text())["state"] == "stopped"  # drained, not killed


def test_a_failing_worker_stops_the_run_and_is_named(tmp_path):
    proc = subprocess.run(
        launch_local(
            "--root",
            str(tmp_path / "run"),
            "--steps",
            "50",
            "--timeout",
            "300",
            "--worker",
            "custom_reward_function.path=/nonexistent/reward.py",
        ),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 1
    assert "worker w" in proc.stderr and "exited with code" in proc.stderr
    assert "/nonexistent/reward.py" in proc.stderr  # the log tail names the bad setting
