"""Elastic rollout pool: a supervisor that starts and drains workers as the control file says.

    python -m launch.pool root=RUN pool.id=node1 pool.initial_workers=1 pool.gpus=[0,1] \\
        data.train_files=[train.parquet] actor_rollout_ref.rollout.name=vllm

Keys under `pool.` configure the supervisor (command line only); every other key, and a
`--config FILE`, is passed to each worker (and validated as a worker config before anything
starts). `add N` raises the target, `remove N` lowers it; the newest workers are drained
(SIGTERM: finish the batch, flush, exit 0). Applied command ids and the target are saved before
they take effect, so a command is applied once even across supervisor restarts. One worker per
GPU when `pool.gpus` is set.

With `pool.backend=slurm` the workers are SLURM jobs instead of local processes (the supervisor
runs wherever sbatch works, e.g. a login node):

    python -m launch.pool root=/shared/run pool.backend=slurm pool.slurm.partition=rollout \
        pool.initial_workers=4 data.train_files=[/shared/train.parquet]

`add N` submits N one-worker rollout jobs (launch/slurm/rollout.sbatch); `remove N` drains the
newest: `scancel --signal=TERM` reaches the worker, which finishes its batch, flushes and exits 0,
so the job ends COMPLETED with exit code 0 (a job still pending is simply cancelled). Job ids,
and the final state and exit code of each ended job, are kept in the pool state file; a
restarted supervisor adopts the jobs it finds there.

With `pool.role=reward` the members are reward servers (rollout/reward_server.py) instead of
rollout workers, `<pool.id>-r<k>`, one per GPU of `pool.gpus` (local) or one single-server
reward job each (slurm, ray); every other key is a reward-server key. It follows the commands given
with `python -m launch.control --role reward`; `remove N` drains the newest servers (SIGTERM:
withdraw the endpoint, finish the queued groups, exit 0); the workers move to the others.

    python -m launch.pool root=RUN pool.id=rm pool.role=reward pool.gpus=[0,1] \
        pool.initial_workers=2 reward_model.model.path=/shared/models/rm

With `pool.backend=ray` each worker is a Ray job (docs/ray.md); `remove N` is `ray job stop` on
the newest (SIGTERM: the worker flushes and exits; the job ends STOPPED):

    python -m launch.pool root=/shared/run pool.backend=ray pool.ray.address=http://HEAD:8265 \
        pool.initial_workers=4 data.train_files=[/shared/train.parquet]
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from buffer.layout import check_worker_id
from buffer.run import setup_worker_run
from protocol import control
from protocol.config import ConfigError, F, build, split_argv, usage
from rollout import reward_server
from rollout.config import RewardServerConfig, WorkerConfig

log = logging.getLogger("launch.pool")


@dataclasses.dataclass
class SlurmPoolSection:
    partition: str = F("", "partition of the rollout jobs (empty: the cluster's default)")
    gpus_per_job: int = F(0, "GPUs per rollout job, one worker each (0: a CPU worker)", ge=0, le=1)
    cpus_per_task: int = F(1, "CPUs per rollout job", ge=1)
    time: str = F("1-00:00:00", "time limit of each rollout job")
    job_name: str = F("", "job name (default tandem-<pool.id>)")
    sbatch_args: list[str] = F(doc="extra sbatch options, e.g. [--account=rl]", factory=list)
    resignal_interval: float = F(
        5.0,
        "seconds between SIGTERMs to a draining job that still runs (its worker may have started after the first)",
        gt=0,
    )


@dataclasses.dataclass
class RayPoolSection:
    address: str = F("", "the Ray dashboard, e.g. http://HEAD:8265 (pool.backend=ray)")
    gpus_per_job: int = F(0, "GPUs per rollout job, one worker each (0: a CPU worker)", ge=0, le=1)
    cpus_per_job: int = F(1, "CPUs per rollout job (its entrypoint resources)", ge=1)
    working_dir: str = F("", "runtime_env working_dir Ray uploads (empty: tandem installed on the nodes)")
    env: dict[str, str] = F(doc="runtime_env env vars of each job", factory=dict)
    python: str = F("", "the python on the nodes (empty: the supervisor's)")


@dataclasses.dataclass
class PoolSection:
    id: str = F("pool", "supervisor id, unique per node (names its workers <id>-w<k>, reward servers <id>-r<k>)")
    role: str = F(
        "rollout",
        "rollout: rollout workers (rollout.worker); reward: reward servers (rollout.reward_server), "
        "following the control commands given with --role reward",
        choices=list(control.ROLES),
    )
    backend: str = F(
        "local",
        "local: worker processes on this node; slurm: one SLURM job per worker; ray: one Ray job per worker",
        choices=["local", "slurm", "ray"],
    )
    initial_workers: int = F(1, "workers started when the supervisor first starts", ge=0)
    max_workers: int = F(64, "upper bound on the target, whatever the commands say", ge=1)
    gpus: list[int] = F(doc="GPU indices to bind workers to, one each (empty: no GPUs)", factory=list)
    poll_interval: float = F(1.0, "seconds between reads of the control file", gt=0)
    drain_timeout_s: float = F(300.0, "seconds a draining worker may take before SIGKILL", gt=0)
    max_restarts: int = F(3, "restarts of crashed workers before the supervisor gives up", ge=0)
    slurm: SlurmPoolSection = F(factory=SlurmPoolSection)
    ray: RayPoolSection = F(factory=RayPoolSection)

    def check(self) -> None:
        try:
            check_worker_id(self.id)  # names files and its workers' ids
        except ValueError as e:
            raise ConfigError(f"pool.id: {e}") from None
        if self.backend == "ray" and not self.ray.address:
            raise ConfigError("pool.ray.address: give the Ray dashboard, e.g. http://HEAD:8265")


@dataclasses.dataclass
class PoolConfig:
    root: str = F(doc="run folder")
    pool: PoolSection = F(factory=PoolSection)


def _die_with_parent() -> None:
    """In the child: get SIGTERM (drain) if the supervisor dies, instead of running orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclasses.dataclass
class Member:
    worker_id: str
    gpu: int | None
    proc: subprocess.Popen
    draining_since: float | None = None


class Pool:
    def __init__(self, cfg: PoolConfig, worker_args: list[str]):
        self.cfg = cfg.pool
        self.root = cfg.root
        self.stores = setup_worker_run(cfg)  # cfg.buffer: the workers' (parse), else the shared folder
        self.control = self.stores.control
        self.worker_args = worker_args
        self.members: list[Member] = []
        self.restarts = 0
        self.stopping = False
        self._wake = threading.Event()
        self._unwatch = lambda: None
        self.state = self.control.pool_state(self.cfg.id) or {
            "applied": [],
            "target": self.cfg.initial_workers,
            "next_index": 0,
        }

    # --- commands ----------------------------------------------------------------------------
    def read_commands(self) -> list[control.Command]:
        """The hand-written control file's commands, then control.d/'s in id order."""
        cmds, errors = self.control.commands()
        for e in errors:
            if self.state.get("last_error") != e:  # say it once, not every poll
                log.error("ignoring the control file: %s", e)
                self.state["last_error"] = e
        return cmds

    def apply_new_commands(self) -> None:
        applied = set(self.state["applied"])
        for cmd in self.read_commands():
            if cmd.id in applied or cmd.role != self.cfg.role:  # another pool's command
                continue
            delta = cmd.count if cmd.action == "add" else -cmd.count
            limit = min(self.cfg.max_workers, len(self.cfg.gpus) or self.cfg.max_workers)
            target = max(0, min(limit, self.state["target"] + delta))
            log.info("command %s: %s %d -> target %d %s", cmd.id, cmd.action, cmd.count, target, self.members_are)
            self.state["target"] = target
            self.state["applied"].append(cmd.id)
            applied.add(cmd.id)
            self.save()  # persisted before it takes effect: applied exactly once

    def save(self) -> None:
        self.state["workers"] = [
            {
                "worker_id": m.worker_id,
                "pid": m.proc.pid,
                "gpu": m.gpu,
                "state": "draining" if m.draining_since else "running",
            }
            for m in self.members
        ]
        self.state["updated"] = time.time()
        self.control.save_pool_state(self.cfg.id, self.state)

    # --- workers -----------------------------------------------------------------------------
    @property
    def members_are(self) -> str:
        return "reward servers" if self.cfg.role == "reward" else "workers"

    def member_id(self, index: int) -> str:
        return f"{self.cfg.id}-{'r' if self.cfg.role == 'reward' else 'w'}{index}"

    def member_argv(self, member_id: str) -> list[str]:
        """The member's command line: a rollout worker, or a reward server (pool.role)."""
        if self.cfg.role == "reward":
            return [
                sys.executable,
                "-m",
                "rollout.reward_server",
                *reward_server.argv(self.root, self.worker_args),
                "--set",
                f"server.id={member_id}",
            ]
        return [
            sys.executable,
            "-m",
            "rollout.worker",
            f"root={self.root}",
            f"worker.id={member_id}",
            *self.worker_args,
        ]

    def _free_gpu(self) -> int | None:
        used = {m.gpu for m in self.members}
        return next((g for g in self.cfg.gpus if g not in used), None)

    def start_worker(self) -> None:
        index = self.state["next_index"]
        self.state["next_index"] = index + 1
        worker_id = self.member_id(index)
        gpu = self._free_gpu()
        env = dict(os.environ)
        if self.cfg.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        proc = subprocess.Popen(self.member_argv(worker_id), env=env, preexec_fn=_die_with_parent)
        self.members.append(Member(worker_id, gpu, proc))
        log.info("started %s (pid %d%s)", worker_id, proc.pid, f", GPU {gpu}" if gpu is not None else "")

    def drain(self, member, states: dict[str, str] | None = None) -> None:
        """Ask `member` to finish and stop (`states`: a batch pool's view of its jobs)."""
        if member.draining_since is None and member.proc.poll() is None:
            member.proc.send_signal(signal.SIGTERM)
            member.draining_since = time.monotonic()
            log.info("draining %s (pid %d)", member.worker_id, member.proc.pid)

    def reap(self) -> dict[str, str] | None:
        """Record the members that ended (a batch pool returns the job states it saw)."""
        for m in list(self.members):
            code = m.proc.poll()
            if code is None:
                if m.draining_since and time.monotonic() - m.draining_since > self.cfg.drain_timeout_s:
                    log.error("%s did not drain in %.0f s; killing it", m.worker_id, self.cfg.drain_timeout_s)
                    m.proc.kill()
                continue
            self.members.remove(m)
            if m.draining_since is not None or code == 0:
                log.info("%s exited with code %d", m.worker_id, code)
            else:
                self.restarts += 1
                log.error(
                    "%s crashed with code %d (restart %d of %d)",
                    m.worker_id,
                    code,
                    self.restarts,
                    self.cfg.max_restarts,
                )
                if self.restarts > self.cfg.max_restarts:
                    raise RuntimeError(f"{self.members_are} crashed {self.restarts} times; see their logs")
        return None

    def reconcile(self) -> None:
        self.reap()
        live = [m for m in self.members if m.draining_since is None]
        for _ in range(self.state["target"] - len(live)):
            if self.cfg.gpus and self._free_gpu() is None:
                break  # a draining worker still holds its GPU; retry next round
            self.start_worker()
        for m in live[self.state["target"] :][::-1]:
            self.drain(m)
        self.save()

    # --- lifecycle ---------------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._unwatch = self.control.on_change(self._wake.set)  # events only cut latency
        try:
            while not self.stopping and not self.stores.state.done():
                self.apply_new_commands()
                self.reconcile()
                self._wake.wait(self.cfg.poll_interval)
                self._wake.clear()
        finally:
            self.shutdown()

    def _on_signal(self, signum, _frame) -> None:
        log.info("%s received: draining all workers", signal.Signals(signum).name)
        self.stopping = True
        self._wake.set()

    def shutdown(self) -> None:
        for m in self.members:
            self.drain(m)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        for m in self.members:
            try:
                code = m.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                log.info("%s exited with code %d", m.worker_id, code)
            except subprocess.TimeoutExpired:
                log.error("%s did not drain in time; killing it", m.worker_id)
                m.proc.kill()
                m.proc.wait(timeout=30)
        self.members = []
        self.save()
        self._unwatch()


@dataclasses.dataclass
class Job:
    job_id: str
    worker_id: str
    draining_since: float | None = None  # time.time(): survives a supervisor restart
    last_signal: float | None = None


class JobPool(Pool):
    """The pool with batch jobs as workers, one single-worker rollout job each (SlurmPool, RayPool).
    Job ids, and how each ended job ended, live in the pool state file: a restarted supervisor
    adopts its jobs. Subclasses submit, drain and poll jobs; `Error` is their backend's error."""

    kind = "batch"

    def queue_states(self, job_ids: list[str]) -> dict[str, str]:
        """Job id -> its backend state (each backend answers it)."""
        raise NotImplementedError(f"{type(self).__name__} has no queue_states")

    Error: type[Exception] = RuntimeError

    def __init__(self, cfg: PoolConfig, worker_args: list[str]):
        super().__init__(cfg, worker_args)
        self.run_root = self.root if "://" in self.root else os.path.abspath(self.root)
        self.jobs = [Job(**j) for j in self.state.get("jobs", [])]  # adopted after a restart
        self.state.setdefault("finished", [])
        if self.jobs:
            log.info("adopting jobs %s from %s", [j.job_id for j in self.jobs], self.control.where())

    def submit_worker(self, worker_id: str) -> str:
        raise NotImplementedError

    def save(self) -> None:
        self.state["jobs"] = [dataclasses.asdict(j) for j in self.jobs]
        self.state["workers"] = [
            {"worker_id": j.worker_id, "job_id": j.job_id, "state": "draining" if j.draining_since else "running"}
            for j in self.jobs
        ]
        self.state["updated"] = time.time()
        self.control.save_pool_state(self.cfg.id, self.state)

    def start_worker(self) -> None:
        index = self.state["next_index"]
        self.state["next_index"] = index + 1
        worker_id = self.member_id(index)
        job_id = self.submit_worker(worker_id)
        self.jobs.append(Job(job_id, worker_id))
        self.save()  # the job id is on record before anything else can fail
        log.info("submitted %s as %s job %s", worker_id, self.kind, job_id)

    def ended(self, job: Job, final: str, code, ok: bool, where: str) -> None:
        """Record a job that has left the queue; count it as a crash unless it ended well."""
        self.jobs.remove(job)
        self.state["finished"].append(
            {
                "job_id": job.job_id,
                "worker_id": job.worker_id,
                "state": final,
                "exit_code": code,
                "drained": job.draining_since is not None,
                "ended": time.time(),
            }
        )
        if ok:
            log.info("job %s (%s) ended: %s, exit code %s", job.job_id, job.worker_id, final, code)
            return
        self.restarts += 1
        log.error(
            "job %s (%s) ended %s with exit code %s (restart %d of %d); see %s",
            job.job_id,
            job.worker_id,
            final,
            code,
            self.restarts,
            self.cfg.max_restarts,
            where,
        )
        if self.restarts > self.cfg.max_restarts:
            self.save()
            raise RuntimeError(f"{self.cfg.role} jobs failed {self.restarts} times; see their output")

    def reconcile(self) -> None:
        states = self.reap()
        live = [j for j in self.jobs if j.draining_since is None]
        for _ in range(self.state["target"] - len(live)):
            self.start_worker()
        for job in live[self.state["target"] :][::-1]:
            self.drain(job, states)
        self.save()

    def shutdown(self) -> None:
        """On SIGTERM/SIGINT drain every job; after DONE the workers stop by themselves. Either
        way wait (up to pool.drain_timeout_s) for the jobs to end, to record how they ended."""
        try:
            if self.stopping:
                states = self.queue_states([j.job_id for j in self.jobs])
                for job in self.jobs:
                    self.drain(job, states)
            deadline = time.monotonic() + self.cfg.drain_timeout_s + 30
            while self.jobs and time.monotonic() < deadline:
                self.reap()
                self.save()
                if self.jobs:
                    time.sleep(self.cfg.poll_interval)
        except (self.Error, RuntimeError) as e:
            log.error("shutdown: %s", e)
        if self.jobs:
            log.warning("jobs still in %s at exit: %s", self.kind, [j.job_id for j in self.jobs])
        self.save()
        self._unwatch()


class SlurmPool(JobPool):
    """One single-worker SLURM rollout job per worker."""

    kind = "SLURM"

    def __init__(self, cfg: PoolConfig, worker_args: list[str]):
        from launch import slurm

        self.slurm = slurm
        self.Error = slurm.SlurmError
        super().__init__(cfg, worker_args)

    def spec(self, worker_id: str):
        sc = self.cfg.slurm
        return self.slurm.JobSpec(
            root=self.run_root,
            partition=sc.partition or None,
            gpus_per_node=sc.gpus_per_job,
            cpus_per_task=sc.cpus_per_task,
            time=sc.time,
            job_name=sc.job_name or f"tandem-{self.cfg.id}",
            worker_prefix=worker_id,
            sbatch_args=list(sc.sbatch_args),
        )

    def submit_worker(self, worker_id: str) -> str:
        spec = self.spec(worker_id)
        role = self.cfg.role
        if "://" not in self.run_root:  # sbatch does not make the output file's folder
            os.makedirs(os.path.dirname(self.slurm.output_path(spec, role)), exist_ok=True)
        render = self.slurm.render_reward if role == "reward" else self.slurm.render_rollout
        return self.slurm.submit(render(spec, self.worker_args))

    def queue_states(self, job_ids: list[str]) -> dict[str, str]:
        return self.slurm.queue_states(job_ids)

    def drain(self, job: Job, states: dict[str, str] | None = None) -> None:
        if job.draining_since is not None:
            return
        state = (states if states is not None else self.slurm.queue_states([job.job_id])).get(job.job_id)
        now = time.time()
        job.draining_since = job.last_signal = now
        if state == "PENDING":
            self.slurm.cancel(job.job_id)  # nothing runs yet: nothing to drain
            log.info("cancelled pending job %s (%s)", job.job_id, job.worker_id)
        else:
            self.slurm.cancel(job.job_id, "TERM")
            log.info("draining %s: SIGTERM to job %s", job.worker_id, job.job_id)

    def reap(self) -> dict[str, str]:
        try:
            states = self.slurm.queue_states([j.job_id for j in self.jobs])
        except self.slurm.SlurmError as e:
            log.warning("squeue: %s; retrying", e)
            return {j.job_id: "UNKNOWN" for j in self.jobs}
        now = time.time()
        for job in list(self.jobs):
            state = states.get(job.job_id)
            if state is not None:
                if job.draining_since is None:
                    continue
                if now - job.draining_since > self.cfg.drain_timeout_s:
                    log.error("job %s did not drain in %.0f s; cancelling it", job.job_id, self.cfg.drain_timeout_s)
                    self.slurm.cancel(job.job_id)
                    job.draining_since = now  # give SLURM's own TERM/KILL a new period
                elif state == "RUNNING" and now - job.last_signal > self.cfg.slurm.resignal_interval:
                    self.slurm.cancel(job.job_id, "TERM")  # the worker may have started since
                    job.last_signal = now
                continue
            info = self.slurm.job_info(job.job_id)
            final, code = info.get("JobState", "UNKNOWN"), info.get("ExitCode", "?")
            ok = final == "COMPLETED" or (job.draining_since is not None and final in ("CANCELLED", "UNKNOWN"))
            self.ended(job, final, code, ok, info.get("StdOut", "its output file"))
        return states


class RayPool(JobPool):
    """One single-worker Ray job per worker (launch.ray_jobs); `remove` is `ray job stop`:
    SIGTERM, the worker finishes its batch, flushes and exits; Ray's SIGKILL only after
    pool.drain_timeout_s (the job's RAY_JOB_STOP_WAIT_TIME_S). A stopped job ends STOPPED."""

    kind = "Ray"

    def __init__(self, cfg: PoolConfig, worker_args: list[str]):
        from launch import ray_jobs

        self.ray_jobs = ray_jobs
        self.Error = ray_jobs.RayJobError
        super().__init__(cfg, worker_args)
        self.client = ray_jobs.client(self.cfg.ray.address)

    def spec(self, worker_id: str):
        rc = self.cfg.ray
        return self.ray_jobs.RaySpec(
            root=self.run_root,
            address=rc.address,
            gpus_per_node=rc.gpus_per_job,
            cpus_per_task=rc.cpus_per_job,
            worker_prefix=worker_id,
            stop_timeout_s=int(self.cfg.drain_timeout_s),
            job_name=f"tandem-{self.cfg.id}",
            submission_id=f"tandem-{worker_id}-{os.urandom(2).hex()}",
            working_dir=rc.working_dir or None,
            env=dict(rc.env),
            python=rc.python or sys.executable,
        )

    def submit_worker(self, worker_id: str) -> str:
        job = self.ray_jobs.render(self.cfg.role, self.spec(worker_id), self.worker_args)
        return self.ray_jobs.submit(self.cfg.ray.address, job, self.client)

    def queue_states(self, job_ids: list[str]) -> dict[str, str]:
        return {j: self.ray_jobs.info(self.cfg.ray.address, j, self.client)["status"] for j in job_ids}

    def drain(self, job: Job, states: dict[str, str] | None = None) -> None:
        if job.draining_since is None:
            job.draining_since = job.last_signal = time.time()
            self.ray_jobs.stop(self.cfg.ray.address, job.job_id, self.client)
            log.info("draining %s: ray job stop %s", job.worker_id, job.job_id)

    def reap(self) -> dict[str, str]:
        states = {}
        for job in list(self.jobs):
            try:
                info = self.ray_jobs.info(self.cfg.ray.address, job.job_id, self.client)
            except self.Error as e:
                log.warning("%s; retrying", e)
                states[job.job_id] = "UNKNOWN"
                continue
            states[job.job_id] = final = info["status"]
            if final in ("PENDING", "RUNNING"):
                continue
            drained = job.draining_since is not None
            ok = final == "SUCCEEDED" or (drained and final in ("STOPPED", "UNKNOWN"))
            self.ended(job, final, info["driver_exit_code"], ok, f"ray job logs {job.job_id}")
        return states


def parse(argv: list[str]) -> tuple[PoolConfig, list[str]]:
    """Split `pool.*` (and root) from the members' keys; validate both before starting."""
    overrides, yaml_file, wants_help = split_argv(argv)
    if wants_help:
        print(usage(PoolConfig, "python -m launch.pool", __doc__.split("\n\n")[0]))
        print("\nEvery other key is a worker key (python -m rollout.worker --help), or with pool.role=reward")
        print("a reward-server key (python -m rollout.reward_server --help)")
        raise SystemExit(0)
    mine = {k: v for k, v in overrides.items() if k == "root" or k.startswith("pool.")}
    theirs = {k: v for k, v in overrides.items() if k not in mine}
    cfg = build(PoolConfig, mine)
    reward = cfg.pool.role == "reward"
    schema, id_key, kind = (RewardServerConfig, "server.id", "r") if reward else (WorkerConfig, "worker.id", "w")
    member = build(schema, {**theirs, "root": cfg.root}, yaml_file)  # fail now, not in every member
    cfg.buffer = member.buffer  # the members' transport: where the pool finds the run's stores
    if id_key in theirs or "id" in theirs:
        raise ConfigError(f"{id_key}: set by the pool (<pool.id>-{kind}<k>); set pool.id instead")
    config = ["--config", os.path.abspath(yaml_file)] if yaml_file else []  # the workers' file
    return cfg, [*config, *(f"{k}={v}" for k, v in theirs.items())]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s pool[%(process)d] %(message)s"
    )
    try:
        cfg, worker_args = parse(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"python -m launch.pool: config error: {e}", file=sys.stderr)
        return 2
    if cfg.pool.backend in ("slurm", "ray"):
        from launch import ray_jobs, slurm

        try:
            pool = (SlurmPool if cfg.pool.backend == "slurm" else RayPool)(cfg, worker_args)
            pool.spec("x").check(cfg.pool.role)
            pool.run()
        except (slurm.SlurmError, ray_jobs.RayJobError, ValueError) as e:
            print(f"python -m launch.pool: {e}", file=sys.stderr)
            return 1
        return 0
    Pool(cfg, worker_args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
