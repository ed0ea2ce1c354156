"""The elastic pool and worker draining, with real worker processes on the tiny model."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buffer.weights.fs import WeightStore
from protocol.experience import decode, from_table
from rollout import builtin_task

WORKER_KEYS = [
    "data.max_response_length=3",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.prompts_per_batch=2",
    "buffer.flush_samples=8",
    "buffer.max_backlog_samples=64",
    "buffer.flush_interval=1",
]


@pytest.fixture
def run(tmp_path):
    """A run folder with a published v0 and the built-in task, as a trainer would leave it."""
    root = tmp_path / "run"
    builtin_task.write_model(tmp_path / "init")
    builtin_task.write_parquet(tmp_path / "train.parquet", builtin_task.make_rows(50, 3))
    WeightStore(str(root)).publish_hf_folder(tmp_path / "init", 0, 0, keep=2)
    return root, tmp_path / "train.parquet"


def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.3)


def _beats(root: Path) -> dict:
    out = {}
    for p in (root / "workers").glob("*.json"):
        try:
            out[p.stem] = json.loads(p.read_text())
        except (OSError, ValueError):
            pass
    return out


def _pool_state(root: Path, pid="p") -> dict:
    p = root / "pool" / f"{pid}.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _pool_rounds(root: Path, saves: int = 3) -> None:
    """Wait until whatever was written before this call has been read by the supervisor. A round
    (read the control file, apply, reconcile) saves the state once, or twice when it applies a
    command, so of three saves after this call the last is in a round that began after it."""
    for _ in range(saves):
        last = _pool_state(root).get("updated")
        _wait(lambda last=last: _pool_state(root).get("updated") != last, 60, "a supervisor round")


def _running(root: Path) -> set:
    """Workers the pool runs whose heartbeat says they are generating (or held back by
    backpressure: 'waiting', which a worker says only once it has started)."""
    beats = _beats(root)
    return {
        w["worker_id"]
        for w in _pool_state(root).get("workers", [])
        if w["state"] == "running" and beats.get(w["worker_id"], {}).get("state") in ("running", "waiting")
    }


def _control(root: Path, *args):
    subprocess.run(
        [sys.executable, "-m", "launch.control", "--root", str(root), *args],
        check=True,
        timeout=60,
        capture_output=True,
    )


def _start_pool(root, data, log):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.pool",
            f"root={root}",
            "pool.id=p",
            "pool.initial_workers=1",
            "pool.poll_interval=0.2",
            f"data.train_files=[{data}]",
            *WORKER_KEYS,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def _stop(proc, timeout=120):
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout)


def test_control_file_grows_and_shrinks_the_pool_exactly_once(run, tmp_path):
    """add/remove commands apply exactly once (a rewritten command file, a garbage file, a
    seed-style command written twice, a restarted supervisor change nothing), and a removed
    worker is drained (exits with state 'stopped'). Two workers at most: every check is on
    counts moving by one, which a third process (CPU on a 2-core box) would not make stronger."""
    root, data = run
    log = open(tmp_path / "pool.log", "w")
    pool = _start_pool(root, data, log)
    try:
        _wait(lambda: len(_running(root)) == 1, 120, "the initial worker")
        _control(root, "add", "1")
        _wait(lambda: len(_running(root)) == 2, 180, "2 workers after 'add 1'")
        _control(root, "remove", "1")
        _wait(lambda: len(_pool_state(root)["workers"]) == 1, 120, "1 worker after 'remove 1'")
        drained = set(_beats(root)) - {w["worker_id"] for w in _pool_state(root)["workers"]}
        assert len(drained) == 1
        assert _beats(root)[drained.pop()]["state"] == "stopped"  # drained, not killed

        # A command file rewritten, and a garbage file: nothing changes, the pool keeps running.
        first = sorted((root / "control.d").glob("*.json"))[0]
        first.write_text(first.read_text())
        _pool_rounds(root)  # the pool has read the rewritten file
        (root / "control.json").write_text("{not json")
        _wait(lambda: "not JSON" in _pool_state(root).get("last_error", ""), 60, "the garbage read")
        _pool_rounds(root)
        assert pool.poll() is None
        assert _pool_state(root)["target"] == 1 and len(_pool_state(root)["workers"]) == 1
        # A seed-style command written twice with the same content is one command.
        (root / "control.json").write_text(json.dumps({"action": "add", "count": 1}))
        _wait(lambda: _pool_state(root)["target"] == 2, 60, "the seed-style 'add 1' applied")
        (root / "control.json").write_text(json.dumps({"action": "add", "count": 1}))
        _pool_rounds(root)
        _wait(lambda: len(_running(root)) == 2, 180, "2 workers after the seed-style 'add 1'")
        assert _pool_state(root)["target"] == 2

        assert _stop(pool) == 0
        assert all(b["state"] == "stopped" for b in _beats(root).values())
        # A restarted supervisor does not apply old commands again.
        pool = _start_pool(root, data, log)
        _wait(lambda: len(_running(root)) == 2, 180, "2 workers after the supervisor restart")
        _pool_rounds(root)
        assert _pool_state(root)["target"] == 2
        assert len(_pool_state(root)["workers"]) == 2
    finally:
        if pool.poll() is None:
            assert _stop(pool) == 0
        log.close()
    assert "ignoring the control file" in (tmp_path / "pool.log").read_text()


def test_sigterm_drains_a_worker_with_no_partial_shard(run, tmp_path):
    root, data = run
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout.worker",
            f"root={root}",
            "worker.id=solo",
            f"data.train_files=[{data}]",
            *WORKER_KEYS,
            "buffer.flush_samples=1000",
            "buffer.flush_interval=1000",
            "buffer.max_backlog_samples=100000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait(lambda: _beats(root).get("solo", {}).get("batches", 0) >= 3, 120, "3 batches")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, out[-2000:]
    beat = _beats(root)["solo"]
    assert beat["state"] == "stopped"
    shards = sorted((root / "experience" / "solo").iterdir())
    assert shards and not [s for s in shards if ".tmp-" in s.name]
    # Everything generated was flushed on SIGTERM (flush thresholds were never reached).
    assert sum(len(from_table(decode(s.read_bytes()))) for s in shards) == beat["samples_written"] > 0


def test_a_command_names_the_pool_it_is_for():
    """A command's role picks the pool (launch.pool pool.role): 'rollout' by default, with the
    content id it had before roles existed (a supervisor that applied a hand-written command
    does not apply it again after an upgrade); 'reward' commands have ids of their own; any
    other role is refused, naming it."""
    from protocol import control

    (old,) = control.parse('{"action": "add", "count": 2}')
    assert old.role == "rollout" and old.id == "content-bc36efc368a9e180"
    (rm,) = control.parse('{"action": "add", "count": 2, "role": "reward"}')
    assert rm.role == "reward" and rm.id != old.id
    with pytest.raises(control.ControlError, match="role must be one of .*'critic'"):
        control.parse('{"action": "add", "role": "critic"}')
    text, cmd = control.new_command("c000007", "remove", 1, "reward")
    assert control.parse_command_file(text, "c000007", "c000007.json") == cmd
