"""Every wait is interruptible: a worker or validator waiting for its first weights stops on SIGTERM at
once, and launch.local's cleanup survives a second signal (it kills instead of giving up)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import launch_local, subprocess_env

from rollout import builtin_task


def _read_until(stream, words: str, timeout_s: float) -> str:
    """Lines of `stream` up to the first holding `words` (the process must be alive)."""
    seen = []
    deadline = time.monotonic() + timeout_s
    for line in stream:  # ends at EOF: the process died first
        seen.append(line)
        if words in line:
            return "".join(seen)
        assert time.monotonic() < deadline, f"no {words!r} in {timeout_s} s:\n{''.join(seen)[-3000:]}"
    raise AssertionError(f"stream ended before {words!r}:\n{''.join(seen)[-3000:]}")


def _processes_under(root: Path) -> list[int]:
    """Live processes whose command line names the run folder (ours: the run is unique)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(root) in cmd and state != "Z":
                pids.append(int(d.name))
    return pids


@pytest.mark.parametrize("role", ["worker", "validator"])
def test_waiting_for_first_weights_stops_on_sigterm(tmp_path, role):
    data = tmp_path / "t.parquet"
    builtin_task.write_parquet(data, builtin_task.make_rows(10, 3))
    args, beat = {
        "worker": (
            ["rollout.worker", f"data.train_files=[{data}]", "worker.id=w0", "worker.weights_timeout_s=300"],
            Path("workers", "w0.json"),
        ),
        "validator": (
            ["rollout.validate", f"data.val_files=[{data}]", "validator.weights_timeout_s=300"],
            Path("validation", "validator.json"),
        ),
    }[role]
    proc = subprocess.Popen(
        [sys.executable, "-m", *args, f"root={tmp_path / 'run'}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    )
    try:
        _read_until(proc.stdout, "waiting for the first weight version", 120)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, out[-3000:]
    assert took < 30, took  # polls every 0.5 s; 30 s leaves room for a loaded machine's exit
    assert "stopped before the first weight version" in out
    state = json.loads((tmp_path / "run" / beat).read_text())
    assert state["state"] == "stopped" and state.get("samples_written", 0) == 0


def test_launch_local_cleanup_survives_a_second_signal(tmp_path):
    root = tmp_path / "run"
    proc = subprocess.Popen(
        launch_local("--root", str(root), "--steps", "500", "--timeout", "400"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        deadline = time.monotonic() + 300
        while (
            len(
                [
                    b
                    for b in (root / "workers").glob("*.json")
                    if json.loads(b.read_text() or "{}").get("state") == "running"
                ]
            )
            < 2
        ):
            assert proc.poll() is None and time.monotonic() < deadline, "workers never ran"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _read_until(proc.stderr, "stopping all processes", 60)  # cleanup has begun
        proc.send_signal(signal.SIGTERM)
        err = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        left = _processes_under(root)
        for pid in left:  # started by this test; leave nothing behind whatever happened
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert not left, f"processes of the run left alive: {left}"


# Runs a role's main() in a child whose last act is a SIGTERM sent from a finalizer of __main__'s
# globals: that runs after the interpreter has put Python-installed handlers back to SIG_DFL, the
# window in which a pool's drain signal or SLURM's time-limit signal used to kill a finished role.
_SIGTERM_WHILE_EXITING = """
import os, signal, sys, importlib
class _SigtermAtTeardown:
    def __del__(self, kill=os.kill, pid=os.getpid(), sig=signal.SIGTERM):
        kill(pid, sig)
_bomb = _SigtermAtTeardown()
sys.exit(importlib.import_module(sys.argv[1]).main(sys.argv[2:]))
"""


@pytest.mark.parametrize("role", ["worker", "validator"])
def test_sigterm_after_run_finished_exits_zero(tmp_path, role):
    """A role whose run() has finished ignores SIGTERM: its exit code stays 0 (a SLURM job of an
    elastic pool drained twice ended FAILED with -15 though every shard was flushed)."""
    from buffer.run import setup_trainer_run

    data = tmp_path / "t.parquet"
    builtin_task.write_parquet(data, builtin_task.make_rows(10, 3))
    builtin_task.write_model(tmp_path / "m0")
    root = tmp_path / "run"
    run = setup_trainer_run(str(root))
    run.publisher.publish_hf_folder(tmp_path / "m0", 0, 0, keep=2)
    run.state.mark_done({"steps": 0})  # run() ends at once: nothing to generate or answer
    module, args = {
        "worker": ("rollout.worker", [f"data.train_files=[{data}]", "worker.id=w0"]),
        "validator": ("rollout.validate", [f"data.val_files=[{data}]"]),
    }[role]
    proc = subprocess.run(
        [sys.executable, "-c", _SIGTERM_WHILE_EXITING, module, *args, f"root={root}", "data.max_response_length=3"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode} (-15: killed by the SIGTERM while exiting):\n{out[-3000:]}"
    assert "stopped" in out
