"""The roles as Ray jobs on a real single-node Ray head (`ray start --head`, CPU resources only),
started by a session fixture and stopped afterwards; the rendered submissions of a 4-node trainer
and an 8-GPU rollout role as docs/ray.md describes them."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_slurm import _metrics, _wait  # the same waits and metrics reads as the SLURM tests

from buffer.layout import RunLayout
from launch import ray_driver, ray_jobs, submit
from launch.local import BUILTIN_TRAINER, BUILTIN_WORKER
from launch.status import split_metrics
from rollout import builtin_task

REPO = Path(__file__).resolve().parents[1]
STEPS = 30
RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` command, whatever PATH says


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _processes_with(text: str) -> list[str]:
    """Live processes whose command line holds `text` (ours: the run folder is unique)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append(f"{d.name}: {cmd[:300]}")
    return found


@pytest.fixture(scope="module")  # not session: its ~20 idle processes take ~8% of a core
def ray_head(tmp_path_factory):
    """A one-node Ray cluster with 8 logical CPUs (several small jobs share the 2 real cores) and
    no GPUs; its dashboard (the Jobs API) on a free port. Yields the dashboard's address."""
    pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")
    # Ray's session folder (sockets, logs) under a short path of its own: its sockets live there,
    # and an AF_UNIX path may not exceed 107 bytes, which pytest's tmp folders pass under xdist
    # (`.../pytest-0/popen-gw1/ray0/session_<date>_<pid>/sockets/dash_MetricsHead`)
    temp = Path(tempfile.mkdtemp(prefix="tandem-ray-", dir="/tmp"))
    names = [
        "--dashboard-port",
        "--port",
        "--dashboard-agent-listen-port",
        "--ray-client-server-port",
        "--node-manager-port",
        "--object-manager-port",
        "--metrics-export-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
    ]  # none of Ray's defaults:
    socks = [socket.socket() for _ in names]  # another Ray on this machine keeps its own
    for sock in socks:  # all bound at once: nine different ports
        sock.bind(("127.0.0.1", 0))
    ports = {name: sock.getsockname()[1] for name, sock in zip(names, socks)}
    for sock in socks:
        sock.close()
    dashboard = ports["--dashboard-port"]
    env = _env()
    env.pop("PYTHONPATH")  # the jobs get the code from their working_dir, as on a cluster
    log = open(temp / "ray-start.log", "wb")
    # --block: this process owns the head's processes and stops all of them on SIGTERM; `ray
    # stop` would stop every Ray on this machine, not only this one
    head = subprocess.Popen(
        [
            *RAY_CLI,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=8",
            "--num-gpus=0",
            "--object-store-memory=100000000",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
            *(f"{k}={v}" for k, v in ports.items()),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    address = f"http://127.0.0.1:{dashboard}"

    def up():
        assert head.poll() is None, (temp / "ray-start.log").read_text()[-3000:]
        try:
            return ray_jobs.client(address).list_jobs() is not None
        except ray_jobs.RayJobError:
            return False

    try:
        _wait(
            up,
            180,
            f"the Ray head's Jobs API at {address}",
            interval=1.0,
            dump=lambda: (temp / "ray-start.log").read_text()[-3000:],
        )
        yield address
    finally:
        head.terminate()
        try:
            head.wait(timeout=120)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=30)
        log.close()
        # its daemons name the session folder in their command lines; none may outlive the fixture
        _wait(
            lambda: not _processes_with(str(temp)),
            60,
            "the Ray head's processes to exit",
            dump=lambda: "\n".join(_processes_with(str(temp))),
        )
        shutil.move(temp, tmp_path_factory.mktemp("ray"))  # its logs kept with pytest's tmp folders


def _submit(address: str, role: str, *args: str) -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.submit",
            role,
            "--backend",
            "ray",
            "--address",
            address,
            "--working-dir",
            str(REPO),
            *args,
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, f"launch.submit {role} failed: {out.stderr}"
    return out.stdout.strip()


def _status(address: str, job_id: str) -> str:
    return ray_jobs.info(address, job_id)["status"]


def _job_logs(address: str, job_ids) -> str:
    c = ray_jobs.client(address)
    return "\n".join(f"== ray job {j}\n" + "\n".join(c.get_job_logs(j).splitlines()[-25:]) for j in job_ids)


def _alive_actors(address: str, class_name: str) -> list:
    from ray.util.state import list_actors

    return list_actors(address=address, filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])


def _running_rollout_jobs(address: str) -> int:
    return sum(
        j.status == "RUNNING" and (j.metadata or {}).get("tandem_role") == "rollout"
        for j in ray_jobs.client(address).list_jobs()
    )


def _pool_jobs(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text()).get("jobs") or []
    except (OSError, ValueError):
        return []


@pytest.mark.slow
def test_roles_as_ray_jobs_elastic_pool_stop_and_resume(ray_head, tmp_path):
    """The trainer (two torchrun agents, one per placement-group bundle, rendezvous on bundle
    0's node) and two one-worker rollout jobs train the built-in task; `ray job stop` on the
    trainer leaves none of its processes; a Ray-backed pool grows by one worker job and shrinks
    again; the trainer resubmitted on one node resumes: every step once, every sample trained
    once, the reward rising."""
    address = ray_head
    layout = RunLayout(str(tmp_path / "run"))
    builtin_task.write_model(layout.init_model)
    builtin_task.write_parquet(layout.train_parquet, builtin_task.make_rows(2000, 3))
    worker_keys = [f"data.train_files=[{layout.train_parquet}]", "data.max_response_length=3", *BUILTIN_WORKER]
    two_nodes = ["--nodes", "2", "--nproc-per-node", "1", "--placement-strategy", "PACK"]
    trainer_args = [
        f"actor_rollout_ref.model.path={layout.init_model}",
        f"trainer.total_training_steps={STEPS}",
        *BUILTIN_TRAINER,
        "trainer.save_freq=5",
        "trainer.log_sample_ids=true",
        f"trainer.keep_versions={STEPS + 1}",
    ]  # a late worker may load any version
    jobs, pool = [], None

    def dump() -> str:
        pool_log = tmp_path / "pool.log"
        return (
            _job_logs(address, jobs) + "\n== pool.log\n" + (pool_log.read_text()[-3000:] if pool_log.exists() else "")
        )

    try:
        trainer = _submit(address, "trainer", "--root", layout.root, *two_nodes, *trainer_args)
        jobs.append(trainer)
        rollouts = [
            _submit(address, "rollout", "--root", layout.root, "--worker-prefix", f"r{i}", *worker_keys)
            for i in range(2)
        ]
        jobs += rollouts
        with open(tmp_path / "pool.log", "wb") as pool_log:
            pool = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "launch.pool",
                    f"root={layout.root}",
                    "pool.id=el",
                    "pool.backend=ray",
                    f"pool.ray.address={address}",
                    f"pool.ray.working_dir={REPO}",
                    "pool.initial_workers=0",
                    "pool.poll_interval=0.5",
                    "pool.drain_timeout_s=120",
                    *worker_keys,
                ],
                env=_env(),
                stdout=pool_log,
                stderr=subprocess.STDOUT,
            )

        def started():
            assert "FAILED" not in [_status(address, j) for j in jobs], dump()
            return len(_metrics(layout)) >= 3

        _wait(started, 300, "the first trainer steps", dump=dump)

        # ray job stop on the trainer after its first checkpoint: none of its processes is left
        _wait(
            lambda: any(Path(layout.root, "checkpoints").glob("step_*")),
            300,  # committed
            "a checkpoint",
            dump=dump,
        )
        out = subprocess.run(
            [*RAY_CLI, "job", "stop", "--address", address, trainer],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stdout + out.stderr  # it waits for the job to stop
        assert _status(address, trainer) == "STOPPED"

        def left() -> list[str]:
            return [
                p
                for p in _processes_with(f"root={layout.root}")
                if not any(w in p for w in (" -m rollout.", "ray_driver rollout", "launch.pool"))
            ]

        _wait(
            lambda: not left(),
            60,
            "the trainer's driver, torchrun agents and ranks to exit",
            dump=lambda: "\n".join(left()),
        )
        _wait(lambda: not _alive_actors(address, "NodeAgent"), 60, "the trainer's Ray actors to end")
        assert len(split_metrics(_metrics(layout))[0]) < STEPS

        # while the rollout jobs go on: add 1 -> one more Ray job, its worker up; remove 1 -> it
        # drains (flushes, exits) and the job ends STOPPED
        state_path = Path(layout.pool_state("el"))
        subprocess.run(
            [sys.executable, "-m", "launch.control", "--root", layout.root, "add", "1"],
            env=_env(),
            check=True,
            timeout=60,
        )
        new = _wait(lambda: (_pool_jobs(state_path) or [None])[0], 60, "the pool to submit a job", dump=dump)
        jobs.append(new["job_id"])
        beat = Path(layout.heartbeat(new["worker_id"]))
        _wait(beat.exists, 180, f"worker {new['worker_id']} to start", dump=dump)
        assert _status(address, new["job_id"]) == "RUNNING" and _running_rollout_jobs(address) == 3
        subprocess.run(
            [sys.executable, "-m", "launch.control", "--root", layout.root, "remove", "1"],
            env=_env(),
            check=True,
            timeout=60,
        )
        _wait(
            lambda: _status(address, new["job_id"]) == "STOPPED",
            150,
            f"job {new['job_id']} to drain and stop",
            dump=dump,
        )
        assert json.loads(beat.read_text())["state"] == "stopped"  # flushed, exited by itself
        assert "SIGTERM received" in ray_jobs.client(address).get_job_logs(new["job_id"])
        finished = _wait(lambda: json.loads(state_path.read_text()).get("finished"), 30, "the pool's record")
        assert [(f["job_id"], f["state"], f["drained"]) for f in finished] == [(new["job_id"], "STOPPED", True)]
        assert not _processes_with(f"worker.id={new['worker_id']}") and _running_rollout_jobs(address) == 2

        # resubmitted as one node of 2 ranks (entrypoint resources, torchrun --standalone), it
        # resumes from its checkpoint and finishes; the rollout jobs end on DONE
        trainer2 = _submit(address, "trainer", "--root", layout.root, "--nproc-per-node", "2", *trainer_args)
        jobs.append(trainer2)
        _wait(
            lambda: all(_status(address, j) not in ("PENDING", "RUNNING") for j in [trainer2, *rollouts]),
            420,
            "the trainer and the rollout jobs to finish",
            interval=1.0,
            dump=dump,
        )
        for j in [trainer2, *rollouts]:
            assert _status(address, j) == "SUCCEEDED", dump()
        assert "resumed from" in ray_jobs.client(address).get_job_logs(trainer2)
        assert pool.wait(timeout=120) == 0
    finally:
        if pool is not None and pool.poll() is None:
            pool.terminate()
            pool.wait(timeout=150)
        for j in jobs:
            if _status(address, j) in ("PENDING", "RUNNING"):
                ray_jobs.stop(address, j)
    assert not _processes_with(layout.root)

    rows, _ = split_metrics(_metrics(layout))
    final = {r["step"]: r for r in rows}  # a step redone after the stop: its later line wins
    assert sorted(final) == list(range(1, STEPS + 1))
    trained = [i for r in final.values() for i in r["samples/ids"]]
    assert len(trained) == len(set(trained))  # nothing trained twice across the stop
    ordered = [final[s] for s in range(1, STEPS + 1)]
    first = sum(r["reward/mean"] for r in ordered[:10]) / 10
    last = sum(r["reward/mean"] for r in ordered[-10:]) / 10
    assert last > first, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    print(f"Ray run: {STEPS} steps, {len(rows) - STEPS} redone after the stop; reward {first:.3f} -> {last:.3f}")


def test_ray_pool_adopts_its_job_after_a_restart(ray_head, tmp_path):
    """Submission ids live in the pool state file: a supervisor killed with SIGKILL and started
    again takes over its job (which outlived it); `remove 1` then stops that job, once."""
    root = str(tmp_path / "run")
    state_path = Path(RunLayout(root).pool_state("p"))
    cmd = [
        sys.executable,
        "-m",
        "launch.pool",
        f"root={root}",
        "pool.id=p",
        "pool.backend=ray",
        f"pool.ray.address={ray_head}",
        f"pool.ray.working_dir={REPO}",
        "pool.initial_workers=1",
        "pool.poll_interval=0.3",
        "data.train_files=[unused.parquet]",
    ]  # no trainer: it waits
    procs, job_id = [], None
    try:
        with open(tmp_path / "pool1.log", "wb") as log1:
            procs.append(subprocess.Popen(cmd, env=_env(), stdout=log1, stderr=subprocess.STDOUT))
        job_id = _wait(lambda: (_pool_jobs(state_path) or [{}])[0].get("job_id"), 60, "a submitted job")
        procs[0].kill()  # no chance to clean up
        procs[0].wait(timeout=30)
        assert _status(ray_head, job_id) in ("PENDING", "RUNNING")  # the job outlives its supervisor
        with open(tmp_path / "pool2.log", "wb") as log2:
            procs.append(subprocess.Popen(cmd, env=_env(), stdout=log2, stderr=subprocess.STDOUT))
        _wait(
            lambda: f"adopting jobs ['{job_id}']" in (tmp_path / "pool2.log").read_text(),
            60,
            "the restarted pool to adopt the job",
        )
        subprocess.run(
            [sys.executable, "-m", "launch.control", "--root", root, "remove", "1"], env=_env(), check=True, timeout=60
        )
        _wait(
            lambda: _status(ray_head, job_id) == "STOPPED",
            120,
            f"job {job_id} to stop",
            dump=lambda: _job_logs(ray_head, [job_id]),
        )
        finished = _wait(lambda: json.loads(state_path.read_text()).get("finished"), 30, "the record")
        assert [(f["job_id"], f["state"], f["drained"]) for f in finished] == [(job_id, "STOPPED", True)]
        state = json.loads(state_path.read_text())
        assert state["jobs"] == [] and state["next_index"] == 1, state  # nothing resubmitted
        procs[1].terminate()
        assert procs[1].wait(timeout=60) == 0
        assert "restart 1 of" not in (tmp_path / "pool2.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        if job_id and _status(ray_head, job_id) in ("PENDING", "RUNNING"):
            ray_jobs.stop(ray_head, job_id)
    _wait(lambda: not _processes_with(root), 60, "the worker's processes to exit")


def test_a_pool_of_reward_servers_as_ray_jobs_grows_and_drains(ray_head, tmp_path):
    """pool.role=reward with the Ray backend: one single-server Ray job per reward server (the
    entrypoint runs launch.ray_driver reward), announced in the run folder as <pool.id>-r<k>;
    `launch.control --role reward remove 1` stops the newest (ray job stop: it withdraws its
    endpoint and ends STOPPED), once."""
    from buffer.run import setup_trainer_run
    from rollout.reward_model import build_tiny_reward_model

    root = str(tmp_path / "run")
    os.makedirs(root)
    token = tmp_path / "token"
    token.write_text("ray-reward-token\n")
    rm = build_tiny_reward_model(tmp_path / "rm", seed=3)
    state_path = Path(RunLayout(root).pool_state("rm"))
    endpoints = setup_trainer_run(root).reward
    cmd = [sys.executable, "-m", "launch.pool", f"root={root}", "pool.id=rm", "pool.role=reward"]
    cmd += ["pool.backend=ray", f"pool.ray.address={ray_head}", f"pool.ray.working_dir={REPO}"]
    cmd += ["pool.initial_workers=2", "pool.poll_interval=0.3", f"reward_model.model.path={rm}"]
    cmd += ["server.device=cpu", "server.host=127.0.0.1", "server.beat_s=0.5", f"buffer.grpc_token_file={token}"]
    log_path = tmp_path / "pool.log"

    def live() -> set[str]:
        return {e.server_id for e in endpoints.live()}

    with open(log_path, "wb") as log:
        pool = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: live() == {"rm-r0", "rm-r1"}, 180, "two reward servers' endpoints", dump=log_path.read_text)
        newest = next(j["job_id"] for j in _pool_jobs(state_path) if j["worker_id"] == "rm-r1")
        subprocess.run(
            [sys.executable, "-m", "launch.control", "--root", root, "--role", "reward", "remove", "1"],
            env=_env(),
            check=True,
            timeout=60,
        )
        _wait(lambda: live() == {"rm-r0"}, 90, "the newest server withdrawn")
        _wait(lambda: _status(ray_head, newest) == "STOPPED", 90, f"job {newest} to stop")
        finished = _wait(lambda: json.loads(state_path.read_text()).get("finished"), 30, "the record")
        assert [(f["job_id"], f["state"], f["drained"]) for f in finished] == [(newest, "STOPPED", True)]
        pool.terminate()
        assert pool.wait(timeout=120) == 0
    finally:
        if pool.poll() is None:
            pool.kill()
            pool.wait(timeout=30)
        for job in _pool_jobs(state_path):
            if _status(ray_head, job["job_id"]) in ("PENDING", "RUNNING"):
                ray_jobs.stop(ray_head, job["job_id"])
    assert live() == set() and "crashed" not in log_path.read_text()
    _wait(lambda: not _processes_with(root), 60, "the servers' processes to exit")


def test_rendered_reward_servers_one_per_gpu(tmp_path, capsys):
    """launch.submit reward --backend ray: one Ray job, one reward server per GPU, each bound to
    one of the job's GPUs with its own server id, the settings passed as the server's --set."""
    root = str(tmp_path / "r")
    job, _ = _dry_run(
        capsys, "reward", "--root", root, "--gpus-per-node", "2", "--submission-id", "rm-1",
        "reward_model.model.path=/m/rm", "reward_model.max_length=512",
    )  # fmt: skip
    assert (job["entrypoint_num_gpus"], job["entrypoint_num_cpus"]) == (2, 2)
    procs = ray_driver.node_procs(_plan(job), 0, None)
    assert [p.env("4,5") for p in procs] == [{"CUDA_VISIBLE_DEVICES": "4"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    for k, p in enumerate(procs):
        assert p.argv == [
            sys.executable, "-m", "rollout.reward_server", "--run", root,
            "--set", "reward_model.model.path=/m/rm", "--set", "reward_model.max_length=512",
            "--set", f"server.id=r-rm-1-t{k}",
        ]  # fmt: skip


def _dry_run(capsys, *args: str) -> tuple[dict, str]:
    """launch.submit --backend ray --dry-run: the submit_job arguments (JSON) and the CLI line."""
    assert submit.main([*args, "--backend", "ray", "--address", "http://head:8265", "--dry-run"]) == 0
    text, cli = capsys.readouterr().out.rsplit("\n}\n", 1)
    return json.loads(text + "\n}"), cli.strip()


def _plan(job: dict):
    """The entrypoint's plan, as launch.ray_driver reads it in the job."""
    words = shlex.split(job["entrypoint"])
    assert words[:3] == [sys.executable, "-m", "launch.ray_driver"], words
    return ray_driver.parse_args(words[3:])


def test_rendered_four_node_trainer(tmp_path, capsys):
    """What docs/ray.md says a 4-node x 8-GPU trainer is: one Ray job whose driver asks for 4
    bundles of 8 GPUs on distinct nodes, and on each node one torchrun of 8 ranks meeting at node
    0's address; the run folder and the keys passed through; Ray's stop timeout in its env."""
    root = str(tmp_path / "r")
    job, cli = _dry_run(
        capsys,
        "trainer",
        "--root",
        root,
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--cpus-per-task",
        "64",
        "--port",
        "29555",
        "--max-restarts",
        "5",
        "--env",
        "NCCL_SOCKET_IFNAME=ib0",
        "actor_rollout_ref.model.path=/m",
        "trainer.total_training_steps=7",
    )
    assert "entrypoint_num_gpus" not in job and "entrypoint_num_cpus" not in job  # bundles hold them
    env = job["runtime_env"]["env_vars"]
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and env["RAY_JOB_STOP_WAIT_TIME_S"] == "60"
    assert env["OMP_NUM_THREADS"] == "8"  # 64 CPUs per node / 8 ranks
    assert "working_dir" not in job["runtime_env"]  # tandem installed on the nodes
    assert job["metadata"] == {"tandem_role": "trainer", "tandem_root": root}
    plan = _plan(job)
    assert (
        plan.role,
        plan.nodes,
        plan.gpus_per_node,
        plan.cpus_per_node,
        plan.nproc_per_node,
        plan.port,
        plan.placement_strategy,
    ) == ("trainer", 4, 8, 64, 8, "29555", "STRICT_SPREAD")
    assert plan.rdzv_id == job["submission_id"]
    for rank in range(4):
        [proc] = ray_driver.node_procs(plan, rank, "10.0.0.1:29555")
        assert proc.gpu is None  # torchrun's ranks use all 8 GPUs of the bundle
        assert proc.argv == [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=4",
            "--nproc_per_node=8",
            "--max-restarts=5",  # a rank that dies restarts the group from its checkpoint
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=10.0.0.1:29555",
            f"--rdzv_id={job['submission_id']}",
            f"--rdzv_conf=is_host={int(rank == 0)}",
            "-m",
            "trainer.main",
            f"root={root}",
            "actor_rollout_ref.model.path=/m",
            "trainer.total_training_steps=7",
        ]
    assert (
        cli.startswith("ray job submit --address http://head:8265 --submission-id ")
        and cli.endswith(" --no-wait -- " + job["entrypoint"])
        and "--entrypoint-num-gpus" not in cli
    )


def test_rendered_eight_gpu_rollout(tmp_path, capsys):
    """An 8-GPU rollout role: one Ray job holding 8 GPUs and 8 CPUs as entrypoint resources,
    eight workers each bound to one of the GPUs Ray gave it, with distinct worker ids."""
    root = str(tmp_path / "r")
    job, cli = _dry_run(
        capsys,
        "rollout",
        "--root",
        root,
        "--gpus-per-node",
        "8",
        "--flush-interval",
        "30",
        "--working-dir",
        str(REPO),
        "--submission-id",
        "roll-1",
        "data.train_files=[/d/t.parquet]",
        "actor_rollout_ref.rollout.name=vllm",
    )
    assert (job["submission_id"], job["entrypoint_num_gpus"], job["entrypoint_num_cpus"]) == ("roll-1", 8, 8)
    assert job["runtime_env"]["working_dir"] == str(REPO)
    assert job["runtime_env"]["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "120"
    assert "--entrypoint-num-cpus 8 --entrypoint-num-gpus 8" in cli and "--working-dir" not in cli
    procs = ray_driver.node_procs(_plan(job), 0, None)
    visible = "2,3,4,5,6,7,8,9"  # what Ray sets for the entrypoint's 8 GPUs
    assert [p.env(visible) for p in procs] == [{"CUDA_VISIBLE_DEVICES": str(g)} for g in range(2, 10)]
    for k, p in enumerate(procs):
        assert p.argv == [
            sys.executable,
            "-m",
            "rollout.worker",
            f"root={root}",
            "data.train_files=[/d/t.parquet]",
            "actor_rollout_ref.rollout.name=vllm",
            "buffer.flush_interval=30",
            f"worker.id=w-roll-1-t{k}",
        ]


def test_rendered_validate_and_sft(tmp_path, capsys):
    """The validator: one process on one GPU; SFT on one node: torchrun --standalone with its
    output folder as trainer.default_local_dir."""
    root = str(tmp_path / "r")
    job, _ = _dry_run(capsys, "validate", "--root", root, "--gpus-per-node", "1", "data.val_files=[/d/v.parquet]")
    assert (job["entrypoint_num_gpus"], job["entrypoint_num_cpus"]) == (1, 1)
    assert [p.argv for p in ray_driver.node_procs(_plan(job), 0, None)] == [
        [sys.executable, "-m", "rollout.validate", f"root={root}", "data.val_files=[/d/v.parquet]"]
    ]
    config = tmp_path / "sft.yaml"
    config.write_text("data:\n  train_files: [t.parquet]\nmodel:\n  partial_pretrain: m\n")
    job, _ = _dry_run(capsys, "sft", "--root", root, "--gpus-per-node", "4", "--config", str(config), "optim.lr=2e-5")
    assert (job["entrypoint_num_gpus"], job["entrypoint_num_cpus"]) == (4, 4)
    assert [p.argv for p in ray_driver.node_procs(_plan(job), 0, None)] == [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc_per_node=4",
            "--max-restarts=2",  # the default
            "--standalone",
            "-m",
            "trainer.sft",
            f"trainer.default_local_dir={root}",
            "--config",
            str(config),
            "optim.lr=2e-5",
        ]
    ]


def test_ray_submission_errors_are_clear(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # --address's defaults
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)

    def refused(role, *args) -> str:
        assert submit.main([role, "--root", str(tmp_path / "r"), "--backend", "ray", *args]) in (1, 2)
        return capsys.readouterr().err

    assert "--address: give the Ray dashboard" in refused("trainer", "--dry-run", "actor_rollout_ref.model.path=m")
    assert "--partition, --time: SLURM options" in refused(
        "rollout", "--address", "http://h:8265", "--partition", "p", "--time", "1:00", "data.train_files=[t]"
    )
    assert "trainer.no_such_key" in refused(
        "trainer", "--address", "http://h:8265", "actor_rollout_ref.model.path=m", "trainer.no_such_key=1"
    )
    assert "one validator per run" in refused(
        "validate", "--address", "http://h:8265", "--nodes", "2", "data.val_files=[v]"
    )
    port = _free_port()  # nothing listens there: Ray's own error, and what to check
    err = refused("rollout", "--address", f"http://127.0.0.1:{port}", "data.train_files=[t]")
    assert f"cannot reach the Ray Jobs API at http://127.0.0.1:{port}" in err, err


def test_export_hands_a_megatron_checkpoint_to_verl_or_names_what_to_install(tmp_path):
    """verl's Megatron layout goes to verl's own merger; without megatron-core it is refused,
    naming the package, and no folder appears."""
    import importlib.util

    if importlib.util.find_spec("megatron") is not None:
        pytest.skip("megatron-core is installed here: the merger would run, not be refused")
    ckpt = tmp_path / "global_step_5" / "actor"
    (ckpt / "model" / "dist_ckpt").mkdir(parents=True)
    builtin_task.write_model(ckpt / "model" / "huggingface")
    out = subprocess.run(
        [sys.executable, "-m", "launch.export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out
    assert (
        "a verl Megatron checkpoint" in out.stderr
        and "verl.model_merger merge --backend megatron" in out.stderr
        and "pip install megatron-core" in out.stderr
    ), out.stderr
    assert not (tmp_path / "hf").exists()


def test_check_env_checks_the_ray_cluster(ray_head, tmp_path):
    """launch.check_env --ray-address: the Jobs API reached, the same ray version, the head's
    resources (8 CPUs, no GPU); an address where nothing listens FAILs, saying what to check."""
    tmp_path.joinpath("run").mkdir()
    base = [sys.executable, "-m", "launch.check_env", "--root", str(tmp_path / "run")]
    out = subprocess.run([*base, "--ray-address", ray_head], env=_env(), capture_output=True, text=True, timeout=120)
    import ray

    assert out.returncode == 0, out.stdout + out.stderr
    assert f"PASS ray cluster {ray_head}: Jobs API reachable" in out.stdout
    assert f"PASS ray version: cluster {ray.__version__}, here {ray.__version__}" in out.stdout
    assert "PASS ray resources: 1 node(s) alive, 8 CPUs, 0 GPUs" in out.stdout, out.stdout
    dead = f"http://127.0.0.1:{_free_port()}"
    out = subprocess.run([*base, "--ray-address", dead], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and f"FAIL ray cluster {dead}: unreachable" in out.stdout, out.stdout
