"""A rollout worker as a SLURM node runs it: `python -m rollout.worker` in a process of its own,
vLLM in its default (multiprocess) engine mode with nothing in the environment to change it,
scoring the GSM8K-format task with verl's own gsm8k rule (`data_source=openai/gsm8k`).

That worker imports verl before its engine starts (reward.check_data_sources), and `import
verl` touches the CUDA driver (`torch.cuda.is_available()` in verl/utils/device.py). Before the
fix in rollout/vllm_engine.py the engine process was forked from it and died at start: "Cannot
re-initialize CUDA in forked subprocess".

Run on the device machine: python -m pytest -m gpu tests/gpu -rA
"""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
from vllm_helpers import needs_gpus

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A fresh machine compiles kernels at the first engine start (~100 s seen, shared/device notes);
# 300 s leaves room for that and the first batch, and still ends a hung start inside pytest.
FIRST_SHARD_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 120.0  # SIGTERM: finish the batch, flush, shut the engine processes down


def _log_tail(path, lines=40):
    """The log's error lines (a dead engine process's cause is far above the worker's own
    traceback) and its last `lines` lines."""
    with open(path, errors="replace") as f:
        text = f.readlines()
    errors = [t for t in text if "Error" in t or "re-initialize" in t][:12]
    return "".join(["error lines:\n", *errors, f"last {lines} lines:\n", *text[-lines:]])


def test_worker_scoring_with_verl_starts_vllm_in_default_mode(tmp_path):
    from buffer.weights.fs import WeightStore
    from protocol.experience import load_shard
    from rollout.tasks import arith

    data = tmp_path / "data"
    arith.write_task(
        {(k, s): str(data / f"{k}_{s}.parquet") for k in ("sft", "rl") for s in ("train", "val")},
        num=200,
        val_fraction=0.1,
    )
    arith.write_model(tmp_path / "model", "gpu")  # head_dim 64: every vLLM attention backend
    run = tmp_path / "run"
    WeightStore(str(run)).publish_hf_folder(tmp_path / "model", 0, 0, keep=2)

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ENABLE_V1_MULTIPROCESSING")
    }
    env |= {"PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "worker.log"
    cmd = [
        sys.executable,
        "-m",
        "rollout.worker",
        f"root={run}",
        f"data.train_files=[{data / 'rl_train.parquet'}]",
        "worker.id=w0",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=bfloat16",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.prompts_per_batch=16",
        f"data.max_response_length={arith.MAX_RESPONSE_LENGTH}",
        "buffer.flush_samples=64",
        "buffer.flush_interval=2",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + FIRST_SHARD_TIMEOUT_S
        shards = []
        while not shards:
            assert proc.poll() is None, f"worker exited {proc.returncode}:\n{_log_tail(log)}"
            assert time.monotonic() < deadline, f"no shard within {FIRST_SHARD_TIMEOUT_S:.0f} s:\n{_log_tail(log)}"
            time.sleep(1.0)  # polling a folder; the bound is the deadline above
            shards = glob.glob(str(run / "experience" / "w0" / "*.arrow"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0, _log_tail(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    assert "Cannot re-initialize CUDA" not in text
    with open(shards[0], "rb") as f:
        table = load_shard(f.read())
    assert table.num_rows >= 64
    assert set(table.column("data_source").to_pylist()) == {arith.DATA_SOURCE}  # verl's rule scored
    rewards = table.column("reward").to_pylist()
    assert set(rewards) <= {0.0, 1.0}, rewards  # verl's gsm8k: 1 for the right answer, else 0
    print(
        f"worker: {table.num_rows} samples in its first shard, mean reward "
        f"{sum(rewards) / len(rewards):.3f}; engine start log:\n{_log_tail(log, 5)}"
    )
