"""The two roles as SLURM jobs on a real one-node SLURM (scripts/slurm/start.sh), with the
elastic pool's SLURM backend growing and draining the rollout side during the run.

The cluster is started by a session fixture (installs Debian's slurm packages when missing; needs
root and apt) and stopped afterwards, unless it was already running before the tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buffer.layout import RunLayout
from launch.local import BUILTIN_TRAINER, BUILTIN_WORKER
from launch.status import split_metrics
from rollout import builtin_task

REPO = Path(__file__).resolve().parents[1]
BASE = os.environ.get("TANDEM_SLURM_BASE", "/tmp/tandem-slurm")
STEPS = 50


def _lock_pid(layout: RunLayout) -> int | None:
    """The pid rank 0 of the trainer holding the run wrote to trainer.lock (None: not yet)."""
    try:
        return int(json.loads(Path(layout.root, "trainer.lock").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def text_count(path: Path, needle: str) -> int:
    return path.read_text().count(needle) if path.exists() else 0


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", SLURM_CONF=f"{BASE}/etc/slurm.conf", SLURM_BASE=BASE, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _slurm_up() -> bool:
    if shutil.which("scontrol") is None:
        return False
    try:
        return subprocess.run(
            ["scontrol", "ping"], env=_env(), capture_output=True, text=True, timeout=20
        ).stdout.count("UP") > 0 and subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=_env(), capture_output=True, text=True, timeout=20
        ).stdout.strip() in ("idle", "mixed", "allocated")
    except (subprocess.TimeoutExpired, OSError):
        return False


@pytest.fixture(scope="session")
def slurm():
    """A running one-node SLURM with partitions rollout and trainer; SLURM_CONF set for clients."""
    if os.geteuid() != 0:
        pytest.skip("SLURM test cluster: scripts/slurm/start.sh needs root (daemons, /etc/munge)")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("SLURM test cluster: slurm is not installed and apt-get is not available")
    was_up = _slurm_up()
    out = subprocess.run(
        ["bash", str(REPO / "scripts/slurm/start.sh")], env=_env(), capture_output=True, text=True, timeout=600
    )
    if out.returncode != 0:
        tail = (out.stdout + out.stderr)[-3000:]
        if "apt-get" in tail and ("Could not resolve" in tail or "Unable to locate" in tail):
            pytest.skip(f"SLURM test cluster: packages cannot be installed here:\n{tail}")
        pytest.fail(f"scripts/slurm/start.sh failed (exit {out.returncode}):\n{tail}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = f"{BASE}/etc/slurm.conf"
    yield BASE
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    if not was_up:  # stop only what this session started
        subprocess.run(
            ["bash", str(REPO / "scripts/slurm/stop.sh")], env=_env(), capture_output=True, text=True, timeout=180
        )


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=kw.pop("timeout", 120), **kw)


def _submit(role: str, *args: str) -> str:
    out = _run([sys.executable, "-m", "launch.submit", role, *args])
    assert out.returncode == 0, f"launch.submit {role} failed: {out.stderr}"
    job_id = out.stdout.strip()
    assert job_id.isdigit(), out.stdout
    return job_id


def _squeue(job_id: str) -> tuple[str, str] | None:
    """(state, partition) of a job squeue still lists, else None."""
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T %P"])
    line = out.stdout.strip()
    return tuple(line.split()[:2]) if line else None


def _jobs(job_id: str) -> list[dict]:
    """scontrol's records of a job: one, or one per task of an array."""
    out = _run(["scontrol", "show", "job", "-o", job_id])
    return [dict(t.split("=", 1) for t in line.split() if "=" in t) for line in out.stdout.splitlines()]


def _job(job_id: str) -> dict:
    return _jobs(job_id)[0]


def _wait(cond, timeout: float, what: str, interval: float = 0.5, dump=None):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what}" + (f"\n{dump()}" if dump else "")
            )
        time.sleep(interval)


def _metrics(layout: RunLayout) -> list[dict]:
    try:
        with open(layout.metrics) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _logs(layout: RunLayout) -> str:
    parts = []
    for p in sorted(Path(layout.root, "logs").glob("*")):
        lines = p.read_text(errors="replace").splitlines()
        parts.append(f"== {p.name}\n" + "\n".join(lines[-15:]))
    return "\n".join(parts)


def test_submit_errors_are_clear(slurm, tmp_path):
    # a partition that does not exist: sbatch's own message comes through, exit 1
    out = _run(
        [
            sys.executable,
            "-m",
            "launch.submit",
            "rollout",
            "--root",
            str(tmp_path / "r"),
            "--partition",
            "nosuchpartition",
            "data.train_files=[x.parquet]",
        ]
    )
    assert out.returncode == 1
    assert "sbatch failed" in out.stderr and "partition" in out.stderr.lower(), out.stderr
    # no sbatch on PATH
    env = _env(PATH=os.path.dirname(sys.executable))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.submit",
            "trainer",
            "--root",
            str(tmp_path / "r"),
            "actor_rollout_ref.model.path=m",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "sbatch not found" in out.stderr, out.stderr
    # a bad role key is named before anything is submitted
    out = _run(
        [
            sys.executable,
            "-m",
            "launch.submit",
            "trainer",
            "--root",
            str(tmp_path / "r"),
            "actor_rollout_ref.model.path=m",
            "trainer.no_such_key=1",
        ]
    )
    assert out.returncode == 2 and "no_such_key" in out.stderr


def test_dry_run_renders_every_role(tmp_path):
    root = str(tmp_path / "r")
    out = _run(
        [
            sys.executable,
            "-m",
            "launch.submit",
            "trainer",
            "--root",
            root,
            "--partition",
            "big",
            "--nodes",
            "4",
            "--gpus-per-node",
            "8",
            "--port",
            "29555",
            "--dry-run",
            "actor_rollout_ref.model.path=m",
            "trainer.total_training_steps=7",
        ]
    )
    assert out.returncode == 0, out.stderr
    s = out.stdout
    for want in (
        "#SBATCH --partition=big",
        "#SBATCH --nodes=4",
        "#SBATCH --gpus-per-node=8",
        "--nproc_per_node=8",
        "--max-restarts=2",  # the default: a rank that dies restarts the group from its checkpoint
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=${head_addr}:${rdzv_port}",
        "rdzv_port=29555",
        "--nnodes=${SLURM_NNODES}",
        "srun",
        f"root={root}",
        "trainer.total_training_steps=7",
        "#SBATCH --signal=B:USR1@600",
        "#SBATCH --requeue",
        "trap stop_requested USR1",
        f"{root}/trainer.stop",
    ):
        assert want in s, f"{want!r} not in trainer script:\n{s}"
    out = _run(
        [
            sys.executable,
            "-m",
            "launch.submit",
            "rollout",
            "--root",
            root,
            "--partition",
            "cheap",
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--array",
            "0-3%2",
            "--time",
            "2:00:00",
            "--flush-interval",
            "30",
            "--dry-run",
            "data.train_files=[t.parquet]",
        ]
    )
    assert out.returncode == 0, out.stderr
    s = out.stdout
    for want in (
        "#SBATCH --partition=cheap",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --array=0-3%2",
        "#SBATCH --time=2:00:00",
        "slurm-rollout-%A_%a.out",
        "TANDEM_BIND_GPU=1",
        "-m rollout.worker",
        "buffer.flush_interval=30",
        "'data.train_files=[t.parquet]'",
    ):
        assert want in s, f"{want!r} not in rollout script:\n{s}"
    out = _run(
        [
            sys.executable,
            "-m",
            "launch.submit",
            "validate",
            "--root",
            root,
            "--partition",
            "cheap",
            "--gpus-per-node",
            "1",
            "--dry-run",
            "data.val_files=[v.parquet]",
            "actor_rollout_ref.rollout.val_kwargs.n=4",
        ]
    )
    assert out.returncode == 0, out.stderr
    s = out.stdout
    for want in (
        "#SBATCH --partition=cheap",
        "#SBATCH --nodes=1",
        "#SBATCH --gpus-per-node=1",
        "#SBATCH --signal=TERM@120",
        "slurm-validate-%j.out",
        "-m rollout.validate",
        f"root={root}",
        "'data.val_files=[v.parquet]'",
        "actor_rollout_ref.rollout.val_kwargs.n=4",
    ):
        assert want in s, f"{want!r} not in validate script:\n{s}"
    # the validator's own settings are checked before anything is submitted
    out = _run([sys.executable, "-m", "launch.submit", "validate", "--root", root, "--dry-run"])
    assert out.returncode == 2 and "data.val_files" in out.stderr, out.stderr
    out = _run(
        [
            sys.executable,
            "-m",
            "launch.submit",
            "validate",
            "--root",
            root,
            "--nodes",
            "2",
            "--dry-run",
            "data.val_files=[v.parquet]",
        ]
    )
    assert out.returncode == 2 and "one validator per run" in out.stderr, out.stderr


def test_dry_run_renders_the_sft_role(tmp_path):
    out_dir = str(tmp_path / "sft")
    config = tmp_path / "sft.yaml"
    config.write_text("data:\n  train_files: [t.parquet]\nmodel:\n  partial_pretrain: m\n")
    base = [sys.executable, "-m", "launch.submit", "sft", "--root", out_dir, "--dry-run", "--config", str(config)]
    out = _run([*base, "--partition", "big", "--nodes", "2", "--gpus-per-node", "8", "optim.lr=2e-5"])
    assert out.returncode == 0, out.stderr
    s = out.stdout
    for want in (
        "#SBATCH --partition=big",
        "#SBATCH --nodes=2",
        "#SBATCH --job-name=tandem-sft",
        "#SBATCH --gpus-per-node=8",
        "--nproc_per_node=8",
        "--nnodes=${SLURM_NNODES}",
        "--rdzv_backend=c10d",
        "-m trainer.sft",
        f"trainer.default_local_dir={out_dir}",
        f"--config {config}",
        "optim.lr=2e-5",
        f"{out_dir}/logs/slurm-sft-%j.out",
    ):
        assert want in s, f"{want!r} not in sft script:\n{s}"
    assert "trainer.main" not in s and " root=" not in s
    # refused before anything is submitted, with the setting named
    out = _run([*base, "trainer.default_local_dir=/elsewhere"])
    assert out.returncode == 2 and "give the output folder with --root" in out.stderr, out.stderr
    out = _run([*base, "model.lora_adapter_path=/a"])
    assert out.returncode == 2
    assert "model.lora_adapter_path='/a' (command line): not supported: starting from a saved" in out.stderr


@pytest.mark.slow
def test_sft_as_a_slurm_job(slurm, tmp_path):
    """trainer.sft on 2 ranks as a job in partition trainer: torchrun's c10d rendezvous inside
    the allocation, the HF folder at the end."""
    paths = {(k, s): str(tmp_path / f"{k}_{s}.parquet") for k in ("sft", "rl") for s in ("train", "val")}
    builtin_task.write_sft_and_rl(paths, num=240)
    builtin_task.write_model(tmp_path / "model")
    out = RunLayout(str(tmp_path / "sft"))
    job = _submit(
        "sft",
        "--root",
        out.root,
        "--partition",
        "trainer",
        "--nproc-per-node",
        "2",
        "--time",
        "20:00",
        f"data.train_files=[{paths[('sft', 'train')]}]",
        f"data.val_files=[{paths[('sft', 'val')]}]",
        f"model.partial_pretrain={tmp_path / 'model'}",
        "data.train_batch_size=16",
        "trainer.total_training_steps=6",
        "data.max_length=16",
        "data.max_token_len_per_gpu=64",
        "model.enable_gradient_checkpointing=false",
    )
    output = Path(out.root, "logs", f"slurm-sft-{job}.out")
    try:
        _wait(
            lambda: _squeue(job) is None,
            300,
            f"sft job {job} to finish",
            interval=1.0,
            dump=lambda: output.read_text()[-3000:] if output.exists() else "(no output yet)",
        )
    finally:
        if _squeue(job) is not None:
            _run(["scancel", job])
    info = _job(job)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (info, output.read_text()[-3000:])
    assert f"tandem sft job {job}: 1 node(s) x 2 ranks" in output.read_text()
    assert len(_metrics(out)) == 6 and Path(out.hf_model, "config.json").exists()


@pytest.mark.slow
def test_roles_as_slurm_jobs_with_elastic_rollouts(slurm, tmp_path):
    layout = RunLayout(str(tmp_path / "run"))
    builtin_task.write_model(layout.init_model)
    builtin_task.write_parquet(layout.train_parquet, builtin_task.make_rows(2000, 3))
    worker_keys = [f"data.train_files=[{layout.train_parquet}]", "data.max_response_length=3", *BUILTIN_WORKER]
    jobs: list[str] = []
    pool = None
    t0 = time.monotonic()
    try:
        trainer = _submit(
            "trainer",
            "--root",
            layout.root,
            "--partition",
            "trainer",
            "--nodes",
            "1",
            "--nproc-per-node",
            "2",
            "--time",
            "20:00",
            f"actor_rollout_ref.model.path={layout.init_model}",
            f"trainer.total_training_steps={STEPS}",
            *BUILTIN_TRAINER,
            # a worker that joins mid-run loads LATEST; keep every version so the
            # trainer's pruning cannot delete it under a slow-starting worker
            f"trainer.keep_versions={STEPS + 1}",
        )
        jobs.append(trainer)
        # the rollout side as a job array of two one-worker tasks
        rollout = _submit(
            "rollout",
            "--root",
            layout.root,
            "--partition",
            "rollout",
            "--nodes",
            "1",
            "--array",
            "0-1",
            "--time",
            "20:00",
            "--flush-interval",
            "5",
            *worker_keys,
        )
        jobs.append(rollout)
        assert _squeue(trainer)[1] == "trainer" and _squeue(rollout)[1] == "rollout"

        # the elastic side: a SLURM-backed pool, empty until told otherwise
        pool_log = open(tmp_path / "pool.log", "wb")
        pool = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "launch.pool",
                f"root={layout.root}",
                "pool.id=el",
                "pool.backend=slurm",
                "pool.slurm.partition=rollout",
                "pool.slurm.time=20:00",
                "pool.initial_workers=0",
                "pool.poll_interval=0.5",
                "pool.drain_timeout_s=120",
                *worker_keys,
            ],
            env=_env(),
            stdout=pool_log,
            stderr=subprocess.STDOUT,
        )

        def dump() -> str:
            return _logs(layout) + "\n== pool.log\n" + (tmp_path / "pool.log").read_text()[-3000:]

        _wait(lambda: len(_metrics(layout)) >= 3, 240, "the first trainer steps", dump=dump)
        state_path = Path(layout.pool_state("el"))

        # add 1 -> one more rollout job, running in partition rollout
        _run([sys.executable, "-m", "launch.control", "--root", layout.root, "add", "1"], check=True)
        new = _wait(
            lambda: (json.loads(state_path.read_text()).get("jobs") or [None])[0] if state_path.exists() else None,
            60,
            "the pool to submit a job",
            dump=dump,
        )
        job_id, worker_id = new["job_id"], new["worker_id"]
        jobs.append(job_id)
        assert _wait(
            lambda: _squeue(job_id) == ("RUNNING", "rollout"), 60, f"job {job_id} running in squeue", dump=dump
        )
        running = _run(["squeue", "-h", "-o", "%i", "-p", "rollout", "-t", "RUNNING"]).stdout.split()
        assert {job_id, f"{rollout}_0", f"{rollout}_1"} <= set(running), running
        added_at = len(_metrics(layout))
        # its worker is really up (engine loaded, first heartbeat) before we take it away
        beat = Path(layout.heartbeat(worker_id))
        _wait(lambda: beat.exists(), 120, f"worker {worker_id} to start", dump=dump)

        # remove 1 -> that job drains: SIGTERM, flush, exit 0; COMPLETED in SLURM's record
        _run([sys.executable, "-m", "launch.control", "--root", layout.root, "remove", "1"], check=True)
        _wait(lambda: _squeue(job_id) is None, 120, f"job {job_id} to drain and end", dump=dump)
        info = _job(job_id)
        assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", info
        final = json.loads(beat.read_text())
        assert final["state"] == "stopped", final
        out_file = Path(layout.root, "logs", f"slurm-rollout-{job_id}.out").read_text()
        assert "SIGTERM received" in out_file, out_file[-2000:]
        finished = _wait(
            lambda: json.loads(state_path.read_text()).get("finished"), 30, "the pool to record the ended job"
        )
        assert (
            finished[0]["job_id"] == job_id
            and finished[0]["exit_code"] == "0:0"
            and finished[0]["state"] == "COMPLETED"
            and finished[0]["drained"]
        ), finished
        assert _squeue(rollout) is not None  # the other rollout job is untouched

        # the run completes: trainer done, the remaining rollout job stops on DONE with exit 0
        _wait(
            lambda: _squeue(trainer) is None and _squeue(rollout) is None,
            420,
            "the trainer and rollout jobs to finish",
            interval=1.0,
            dump=dump,
        )
        records = _jobs(trainer) + _jobs(rollout)
        assert len(records) == 3, records  # the trainer and both array tasks
        for info in records:
            assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (info, dump())
        for task in (0, 1):  # each array task ran its own worker until the trainer was done
            beat = json.loads(Path(layout.heartbeat(f"w-j{rollout}-a{task}")).read_text())
            assert beat["state"] == "stopped" and beat["samples_written"] > 0, beat
        assert pool.wait(timeout=60) == 0
    finally:
        if pool is not None and pool.poll() is None:
            pool.terminate()
            try:
                pool.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pool.kill()
                pool.wait(timeout=30)
        for j in jobs:
            if _squeue(j) is not None:
                _run(["scancel", j])

    rows, _ = split_metrics(_metrics(layout))  # the trainer's rows, not a validator's
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    versions = [r["weights/version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] > versions[0] + STEPS // 2
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    assert last > first, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    assert added_at < STEPS  # the add/remove happened while the run went on
    print(f"SLURM run: {STEPS} steps in {time.monotonic() - t0:.0f} s; reward {first:.3f} -> {last:.3f}")


def test_pool_adopts_its_jobs_after_a_restart_and_cancels_pending_ones(slurm, tmp_path):
    """Job ids live in the pool state file: a supervisor killed with SIGKILL and started again
    takes over its jobs; removing a job that is still pending cancels it (nothing to drain)."""
    root = str(tmp_path / "run")
    state_path = Path(RunLayout(root).pool_state("p"))
    cmd = [
        sys.executable,
        "-m",
        "launch.pool",
        f"root={root}",
        "pool.id=p",
        "pool.backend=slurm",
        "pool.slurm.partition=rollout",
        "pool.initial_workers=1",
        "pool.poll_interval=0.3",
        "pool.slurm.sbatch_args=[--begin=now+1hour]",  # stays PENDING: no worker ever runs
        "data.train_files=[unused.parquet]",
    ]
    procs, job_id = [], None
    try:
        with open(tmp_path / "pool1.log", "wb") as log1:
            procs.append(subprocess.Popen(cmd, env=_env(), stdout=log1, stderr=subprocess.STDOUT))
        job_id = _wait(
            lambda: state_path.exists() and (json.loads(state_path.read_text()).get("jobs") or [{}])[0].get("job_id"),
            60,
            "a submitted job",
        )
        assert _squeue(job_id) == ("PENDING", "rollout")
        procs[0].kill()  # no chance to clean up
        procs[0].wait(timeout=30)
        assert _squeue(job_id) is not None  # the job outlives its supervisor
        with open(tmp_path / "pool2.log", "wb") as log2:
            procs.append(subprocess.Popen(cmd, env=_env(), stdout=log2, stderr=subprocess.STDOUT))
        _wait(
            lambda: "adopting jobs ['" + job_id + "']" in (tmp_path / "pool2.log").read_text(),
            60,
            "the restarted pool to adopt the job",
        )
        time.sleep(1.0)
        state = json.loads(state_path.read_text())
        assert [j["job_id"] for j in state["jobs"]] == [job_id] and state["next_index"] == 1, state
        _run([sys.executable, "-m", "launch.control", "--root", root, "remove", "1"], check=True)
        _wait(lambda: _squeue(job_id) is None, 60, f"pending job {job_id} to be cancelled")
        assert _job(job_id).get("JobState") == "CANCELLED"
        finished = _wait(lambda: json.loads(state_path.read_text()).get("finished"), 30, "the record")
        assert finished == [dict(finished[0], job_id=job_id, state="CANCELLED", drained=True)]
        assert "crashed" not in (tmp_path / "pool2.log").read_text()
        procs[1].terminate()
        assert procs[1].wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        if job_id and _squeue(job_id) is not None:
            _run(["scancel", job_id])


def test_a_pool_of_reward_servers_as_slurm_jobs_grows_and_drains(slurm, tmp_path):
    """pool.role=reward with the SLURM backend: one single-server reward job per server, named
    <pool.id>-r<k>; `launch.control --role reward add 1` submits one more, `remove 1` drains the
    newest (its endpoint withdrawn, the job COMPLETED 0:0), SIGTERM drains the rest."""
    from buffer.run import setup_trainer_run
    from rollout.reward_model import build_tiny_reward_model

    root = str(tmp_path / "run")
    os.makedirs(root)
    rm = build_tiny_reward_model(tmp_path / "rm", seed=3)
    state_path = Path(RunLayout(root).pool_state("rm"))
    endpoints = setup_trainer_run(root).reward
    cmd = [sys.executable, "-m", "launch.pool", f"root={root}", "pool.id=rm", "pool.role=reward"]
    cmd += ["pool.backend=slurm", "pool.slurm.partition=rollout", "pool.initial_workers=1", "pool.poll_interval=0.3"]
    cmd += [f"reward_model.model.path={rm}", "server.device=cpu", "server.host=127.0.0.1", "server.beat_s=0.5"]
    env = _env(TANDEM_GRPC_TOKEN="slurm-reward-token", OMP_NUM_THREADS="1")

    def live() -> set[str]:
        return {e.server_id for e in endpoints.live()}

    def job_of(server_id: str) -> str:
        state = json.loads(state_path.read_text())
        return next(j["job_id"] for j in state["jobs"] + state["finished"] if j["worker_id"] == server_id)

    log_path = tmp_path / "pool.log"
    with open(log_path, "wb") as log:
        pool = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: live() == {"rm-r0"}, 180, "the first reward job's endpoint", dump=log_path.read_text)
        _run([sys.executable, "-m", "launch.control", "--root", root, "--role", "reward", "add", "1"], check=True)
        _wait(lambda: live() == {"rm-r0", "rm-r1"}, 180, "a second reward job", dump=log_path.read_text)
        _run([sys.executable, "-m", "launch.control", "--root", root, "--role", "reward", "remove", "1"], check=True)
        _wait(lambda: live() == {"rm-r0"}, 90, "the newest server withdrawn")
        drained = job_of("rm-r1")
        _wait(lambda: _squeue(drained) is None, 90, f"the drained job {drained} to end")
        assert (_job(drained)["JobState"], _job(drained)["ExitCode"]) == ("COMPLETED", "0:0")
        pool.send_signal(signal.SIGTERM)
        assert pool.wait(timeout=180) == 0
    finally:
        if pool.poll() is None:
            pool.kill()
            pool.wait(timeout=30)
        for job in json.loads(state_path.read_text())["jobs"] if state_path.exists() else []:
            if _squeue(job["job_id"]) is not None:
                _run(["scancel", job["job_id"]])
    finished = json.loads(state_path.read_text())["finished"]
    assert sorted((f["worker_id"], f["state"], f["drained"]) for f in finished) == [
        ("rm-r0", "COMPLETED", True),
        ("rm-r1", "COMPLETED", True),
    ], finished
    assert live() == set() and "crashed" not in log_path.read_text()


@pytest.mark.slow
def test_trainer_job_checkpoints_on_the_time_limit_signal_and_is_requeued(slurm, experience):
    """SLURM sends the trainer job's batch script USR1 before the time limit (#SBATCH
    --signal=B:USR1@...; sent here at once with scancel --batch --signal=USR1): the trainer
    checkpoints and exits, the job is requeued, and the requeued job resumes; a rank of it killed
    with -9 is restarted by torchrun, resumes again, and the job finishes."""
    from conftest import STEPS, run_folder

    root = run_folder(experience, "requeued")
    layout = RunLayout(str(root))
    # Experience for 3 of the STEPS steps (one shard a step): the trainer cannot finish before
    # the signal (it did, on an idle box, and the job was never requeued); it waits for the
    # rest, which is published once the job has been requeued.
    held = root.parent / "requeued-held"
    held.mkdir()
    later = sorted((root / "experience" / "w0").glob("*.arrow"))[3:]
    assert len(later) == STEPS - 3
    for shard in later:
        shutil.move(shard, held / shard.name)
    job = _submit(
        "trainer",
        "--root",
        layout.root,
        "--partition",
        "trainer",
        "--nproc-per-node",
        "1",
        "--time",
        "20:00",
        f"actor_rollout_ref.model.path={experience / 'model'}",
        f"trainer.total_training_steps={STEPS}",
        "data.train_batch_size=4",
        "trainer.max_staleness=1000",
        "trainer.log_sample_ids=true",
        "trainer.save_freq=100",
        "buffer.poll_interval=0.1",
    )
    out = Path(layout.root, "logs", f"slurm-trainer-{job}.out")
    dump = lambda: out.read_text()[-3000:] if out.exists() else "(no job output yet)"  # noqa: E731
    try:
        _wait(lambda: len(_metrics(layout)) >= 2, 300, "two trainer steps", dump=dump)
        first = _lock_pid(layout)
        _run(["scancel", "--batch", "--signal=USR1", job], check=True)
        _wait(lambda: int(_job(job).get("Restarts", "0")) >= 1, 300, "the job to be requeued", dump=dump)
        # A rank of the requeued job dies as a native crash would (SIGKILL, by the pid its rank 0
        # wrote to trainer.lock): torchrun restarts it (--max-restarts), and it resumes again.
        _wait(
            lambda: text_count(out, "resumed from") >= 1 and _lock_pid(layout) not in (None, first),
            300,
            "the requeued trainer to resume",
            dump=dump,
        )
        crashed = _lock_pid(layout)
        os.kill(crashed, signal.SIGKILL)
        restarted = lambda: text_count(out, "resumed from") >= 2 and _lock_pid(layout) not in (None, crashed)  # noqa: E731
        _wait(lambda: restarted() or _squeue(job) is None, 300, "torchrun to restart the killed rank", dump=dump)
        assert restarted(), f"the job ended instead of restarting the killed rank:\n{dump()}"
        for shard in sorted(held.iterdir()):  # published as a worker does: whole, by rename
            tmp = root / "experience" / "w0" / f".{shard.name}.tmp-test"
            shutil.copy(shard, tmp)
            os.replace(tmp, root / "experience" / "w0" / shard.name)
        _wait(lambda: _squeue(job) is None, 600, "the requeued job to finish", interval=1.0, dump=dump)
        info = _job(job)
        assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (info, dump())
    finally:
        if _squeue(job) is not None:
            _run(["scancel", job])
    text = out.read_text()
    assert "asking the trainer to checkpoint and exit" in text and "requeueing job" in text, text[-3000:]
    assert "resumed from" in text and "torchrun restart 1 of 2" in text, text[-3000:]
    final = {r["step"]: r["samples/ids"] for r in _metrics(layout)}  # later lines win
    assert sorted(final) == list(range(1, STEPS + 1))
    trained = [i for ids in final.values() for i in ids]
    assert len(trained) == len(set(trained))  # nothing trained twice across the requeue
    assert Path(layout.done_marker).exists()
