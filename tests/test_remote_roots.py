"""No shared filesystem (`buffer.transport=grpc`): the trainer and each worker have their own
root folders, and everything but a worker's own cache, claim and log goes through the trainer's
run service and the experience stream. Real processes, the real tiny model, CPU."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import free_port, kill_tree, launch_local

from buffer.run import setup_trainer_run
from launch.local import BUILTIN_TRAINER, BUILTIN_WORKER, rl_metrics
from rollout import builtin_task

pytestmark = pytest.mark.slow
TOKEN = "remote-roots-token"
CORE = "val-core/tandem/copy/reward/mean@1"


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_remote_workers_learn_the_builtin_task_like_a_shared_folder(tmp_path):
    """launch.local --remote-workers: 2 workers and the validator each in a folder of their
    own; the trainer's folder gets heartbeats, shards and validation results only through the
    service. The thresholds are those the shared-folder run meets at the same length
    (tests/test_validation.py: 60 steps, held-out accuracy 0.1 above the best fixed answer;
    README command 1 was at 0.64 at step 60, the best fixed answer scores 0.34)."""
    root = tmp_path / "run"
    steps, freq = 60, 20
    env = dict(os.environ, TANDEM_GRPC_TOKEN=TOKEN)
    proc = subprocess.run(
        launch_local(
            "--root", str(root), "--steps", str(steps), "--test-freq", str(freq), "--timeout", "900", "--remote-workers"
        ),
        capture_output=True,
        text=True,
        timeout=1000,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = setup_trainer_run(str(root))
    rows, vals = rl_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    # 0.09 -> ~0.6 at step 60 in shared-folder runs; 3x is the GAE test's bar at 100 steps
    assert last >= 3 * first, (first, last)
    held_out = pq.read_table(run.files.prepared_parquet("rl", "val")).to_pylist()
    truths = [r["reward_model"]["ground_truth"] for r in held_out]
    best_fixed = max(
        sum(builtin_task.compute_score("tandem/copy", "".join(c), t) for t in truths) / len(truths)
        for c in itertools.product("0123456789", repeat=3)
    )
    ((_, points),) = vals.items()
    assert [p[0] for p in points] == list(range(0, steps + 1, freq))
    assert points[0][2] < best_fixed + 0.1 < points[-1][2], points
    # Nothing shared: the trainer's folder holds what the service and the spool wrote ...
    trainer = _files(root) - {f for f in _files(root) if f.startswith("remote/")}
    assert {"workers/w0.json", "workers/w1.json", "validation/validator.json"} <= trainer
    assert not [f for f in trainer if f.endswith(".claim")]  # claims stay with their worker
    for w in ("w0", "w1"):
        beat = json.loads((root / "workers" / f"{w}.json").read_text())
        assert beat["state"] == "stopped" and len(set(beat["versions_loaded"])) >= 2
        assert beat["samples_written"] > 0
        # ... and each worker's folder its weight cache, claim, log and data, no heartbeat
        own = _files(root / "remote" / w)
        assert f"workers/{w}.claim" in own and f"logs/{w}.log" in own
        assert any(f.startswith("weights/v") and f.endswith(".safetensors") for f in own)
        assert not any(f.startswith(("experience/", "validation/")) or f.endswith(f"{w}.json") for f in own), own
        # The cache bound (buffer.grpc_cache_versions=2) counts complete versions. A fetch in
        # flight when the run ended was cancelled by the worker's clean stop, its partial folder
        # kept (resumable; NetWeightSource.close): at most one, of a version newer than those
        # kept, and without its lock file (only a killed fetch leaves one).
        cached = {f.split("/")[1] for f in own if f.startswith("weights/v")}
        complete = {v for v in cached if "." not in v}
        assert 1 <= len(complete) <= 2, cached
        partial = cached - complete
        assert len(partial) <= 1 and all(p == f"{p[:7]}.partial" > max(complete) for p in partial), cached
    own = _files(root / "remote" / "validator")
    assert any(f.startswith("weights/v") for f in own) and "logs/validator.log" in own


# --- single roles started by hand -------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The built-in model (the trainer's) and the task's train split (each worker copies it)."""
    base = tmp_path_factory.mktemp("inputs")
    builtin_task.write_model(base / "model")
    paths = {(k, s): str(base / f"{k}_{s}.parquet") for k in ("sft", "rl") for s in ("train", "val")}
    builtin_task.write_sft_and_rl(paths, digits=3)
    return base


def _env():
    return dict(os.environ, TANDEM_GRPC_TOKEN=TOKEN, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _trainer(root: Path, inputs: Path, port: int, steps: int, *extra) -> subprocess.Popen:
    """One trainer rank (no torchrun), serving on loopback; its output in root/trainer.out."""
    root.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer.main",
            f"root={root}",
            f"actor_rollout_ref.model.path={inputs / 'model'}",
            f"trainer.total_training_steps={steps}",
            "trainer.test_freq=-1",
            "buffer.transport=grpc",
            f"buffer.grpc_bind=127.0.0.1:{port}",
            "buffer.grpc_linger_s=120",
            "trainer.data_timeout_s=300",
            *BUILTIN_TRAINER,
            *extra,
        ],
        stdout=open(root / "trainer.out", "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=_env(),
    )


def _worker(root: Path, inputs: Path, port: int, worker_id: str) -> subprocess.Popen:
    """A worker whose root is its own folder: the train split copied there, grpc to `port`."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    data = root / "data" / "train.parquet"
    data.write_bytes((inputs / "rl_train.parquet").read_bytes())
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout.worker",
            f"root={root}",
            f"worker.id={worker_id}",
            f"data.train_files=[{data}]",
            "buffer.transport=grpc",
            f"buffer.grpc_address=127.0.0.1:{port}",
            "buffer.grpc_trainer_wait_s=300",
            "buffer.grpc_call_timeout_s=20",
            "data.max_response_length=3",
            *BUILTIN_WORKER,
        ],
        stdout=open(root / "worker.out", "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=_env(),
    )


def _wait_for(what: str, check, procs, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        for p in procs:
            assert p.poll() is None, f"{p.args[2]} exited with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.2)


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _steps(root: Path) -> int:
    return _text(root / "metrics.jsonl").count("\n")


def _end(procs, timeout_s: float = 300) -> list[int]:
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=timeout_s))
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait(timeout=30)
    return codes


def test_a_worker_started_before_the_trainer_waits_then_works(tmp_path, inputs):
    port = free_port()
    trainer_root, worker_root = tmp_path / "trainer", tmp_path / "worker"
    worker = _worker(worker_root, inputs, port, "w0")
    procs = [worker]
    try:
        _wait_for(
            "'waiting for the trainer' line",
            lambda: "waiting for the trainer's run service" in _text(worker_root / "worker.out"),
            procs,
            timeout_s=120,
        )
        trainer = _trainer(trainer_root, inputs, port, 3)
        procs.insert(0, trainer)
        codes = _end(procs, timeout_s=400)
    finally:
        _end(procs, timeout_s=1)
    logs = _text(trainer_root / "trainer.out")[-2000:] + _text(worker_root / "worker.out")[-2000:]
    assert codes == [0, 0], logs
    assert _steps(trainer_root) == 3
    assert "answers again" in _text(worker_root / "worker.out")
    beat = json.loads((trainer_root / "workers" / "w0.json").read_text())
    assert beat["state"] == "stopped" and beat["samples_written"] > 0
    own = worker_root / "workers"
    assert (own / "w0.claim").exists() and not (own / "w0.json").exists()  # the heartbeat: the trainer's


def test_a_trainer_killed_and_resumed_mid_run_does_not_crash_the_worker(tmp_path, inputs):
    port = free_port()
    trainer_root, worker_root = tmp_path / "trainer", tmp_path / "worker"
    steps = 8
    worker = _worker(worker_root, inputs, port, "w0")
    trainer = _trainer(trainer_root, inputs, port, steps, "trainer.save_freq=2")
    procs = [trainer, worker]
    try:
        _wait_for("step 3 (a checkpoint at step 2)", lambda: _steps(trainer_root) >= 3, procs)
        kill_tree(trainer.pid)  # a node failure: no checkpoint on the way out, no DONE
        trainer.wait(timeout=60)
        procs = [worker]
        _wait_for(
            "the worker noticing",
            lambda: "waiting for the trainer's run service" in _text(worker_root / "worker.out"),
            procs,
            timeout_s=120,
        )
        trainer = _trainer(trainer_root, inputs, port, steps)
        procs = [trainer, worker]
        codes = _end(procs, timeout_s=600)
    finally:
        _end(procs, timeout_s=1)
    out = _text(trainer_root / "trainer.out")
    assert codes == [0, 0], out[-2000:] + _text(worker_root / "worker.out")[-2000:]
    assert "resumed from" in out
    final = {json.loads(line)["step"] for line in _text(trainer_root / "metrics.jsonl").splitlines()}
    assert final == set(range(1, steps + 1))
    assert "answers again" in _text(worker_root / "worker.out")
    assert json.loads((trainer_root / "workers" / "w0.json").read_text())["state"] == "stopped"


def test_a_worker_with_a_wrong_token_is_refused_and_says_so(tmp_path, inputs):
    port = free_port()
    trainer = _trainer(tmp_path / "trainer", inputs, port, 1)
    worker_root = tmp_path / "worker"
    try:
        _wait_for(
            "the server",
            lambda: "run service and weight service on port" in _text(tmp_path / "trainer" / "trainer.out"),
            [trainer],
            timeout_s=300,
        )
        (worker_root / "data").mkdir(parents=True)
        (worker_root / "data" / "train.parquet").write_bytes((inputs / "rl_train.parquet").read_bytes())
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "rollout.worker",
                f"root={worker_root}",
                "worker.id=w0",
                f"data.train_files=[{worker_root / 'data' / 'train.parquet'}]",
                "buffer.transport=grpc",
                f"buffer.grpc_address=127.0.0.1:{port}",
                "data.max_response_length=3",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(_env(), TANDEM_GRPC_TOKEN="not-the-token"),
        )
    finally:
        trainer.send_signal(signal.SIGTERM)
        _end([trainer], timeout_s=60)
    assert p.returncode != 0
    assert "UNAUTHENTICATED" in p.stdout + p.stderr
    assert not (tmp_path / "trainer" / "workers").exists()  # nothing was written for it


def test_a_pool_supervisor_without_the_run_folder_takes_commands_through_the_service(tmp_path, inputs):
    """launch.pool with buffer.transport=grpc: commands and its state go through the run
    service; the end of the run stops it."""
    from buffer.config import BufferConfig

    port = free_port()
    trainer = setup_trainer_run(str(tmp_path / "trainer"))
    token = tmp_path / "token"
    token.write_text(TOKEN)
    server = trainer.serve(
        BufferConfig(transport="grpc", grpc_bind=f"127.0.0.1:{port}", grpc_token_file=str(token), grpc_linger_s=0)
    )
    own = tmp_path / "pool"
    pool = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.pool",
            f"root={own}",
            "pool.id=node1",
            "pool.initial_workers=0",
            "pool.poll_interval=0.2",
            f"data.train_files=[{inputs / 'rl_train.parquet'}]",
            "buffer.transport=grpc",
            f"buffer.grpc_address=127.0.0.1:{port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=_env(),
    )
    try:
        cmd, _ = trainer.control.submit("remove", 1)  # applied (target stays 0), recorded once
        _wait_for(
            "the pool's state on the trainer naming the command",
            lambda: cmd.id in ((trainer.control.pool_state("node1") or {}).get("applied") or []),
            [pool],
            timeout_s=120,
        )
        trainer.state.mark_done({"steps": 0})
        assert pool.wait(timeout=60) == 0
    finally:
        _end([pool], timeout_s=1)
        server.stop(grace_s=1)
    assert not (own / "pool").exists()  # its state lives with the run, not in its own folder
