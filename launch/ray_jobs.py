"""The roles as Ray jobs: what launch.submit and launch.pool hand to Ray's Jobs API
(`ray.job_submission.JobSubmissionClient`), and the few calls they make to it.

`render(role, spec, role_args)` returns the keyword arguments of `JobSubmissionClient.submit_job`:
the entrypoint (`python -m launch.ray_driver ROLE ...`, which starts the role's processes on the
node or nodes Ray gives the job), the runtime environment (env vars, optional working_dir) and the
resources. A one-node role asks for its GPUs and CPUs as entrypoint resources; a multi-node
torchrun role asks for one placement-group bundle per node from inside the job (an entrypoint
holds resources on one node only), so its entrypoint asks for nothing. docs/ray.md describes both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shlex
import sys
import time

from launch.slurm import TORCHRUN_ROLES  # {role: (module, the key that takes --root)}

STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Ray's own stop timeout (seconds between ray job stop's SIGTERM and its SIGKILL), read by the
# job's supervisor from the job's env vars (dashboard/modules/job/job_supervisor.py)
STOP_WAIT_VAR = "RAY_JOB_STOP_WAIT_TIME_S"


class RayJobError(RuntimeError):
    """Ray is missing, the cluster cannot be reached, or the Jobs API refused a call; the
    message carries Ray's own error text."""


@dataclasses.dataclass
class RaySpec:
    root: str
    address: str
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int = 1  # rollout on CPU: workers per node (GPU: one per GPU)
    cpus_per_task: int = 1  # rollout/validate: per worker; trainer/sft: per node
    nproc_per_node: int = 1  # trainer/sft: ranks per node
    max_restarts: int = 2  # trainer/sft: torchrun's restarts of every rank after one dies
    port: str = "auto"  # trainer/sft on several nodes: rendezvous port on node 0
    strategy: str = "STRICT_SPREAD"  # trainer/sft on several nodes: placement-group strategy
    worker_prefix: str = ""  # rollout: worker ids <prefix>[-t<k>]; default w-<submission id>
    flush_interval: float | None = None
    stop_timeout_s: int = 120  # ray job stop: SIGTERM, then SIGKILL this much later
    submission_id: str = ""  # default tandem-<role>-<time>-<random>
    job_name: str = ""  # the default submission id's prefix (default tandem-<role>)
    working_dir: str | None = None  # runtime_env working_dir (uploaded by Ray), else installed
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    runtime_env: dict = dataclasses.field(default_factory=dict)  # --runtime-env FILE's content
    python: str = sys.executable

    def check(self, role: str) -> None:
        def bad(msg):
            raise ValueError(f"{role} job: {msg}")

        if not re.match(r"^(https?://)?[^\s/:]+(:\d+)?/?$", self.address or ""):
            bad(f"--address {self.address!r}: give the Ray dashboard's address, e.g. http://HEAD:8265")
        for name, low in (
            ("nodes", 1),
            ("gpus_per_node", 0),
            ("tasks_per_node", 1),
            ("cpus_per_task", 1),
            ("nproc_per_node", 1),
            ("stop_timeout_s", 1),
        ):
            if getattr(self, name) < low:
                flag = "--stop-timeout" if name == "stop_timeout_s" else f"--{name.replace('_', '-')}"
                bad(f"{flag} must be at least {low}, got {getattr(self, name)}")
        if not 0 <= self.max_restarts <= 100:
            bad(f"--max-restarts must be in 0..100, got {self.max_restarts}")
        if self.nodes > 1 and role == "validate":
            bad("one validator per run: one node")
        if self.strategy not in STRATEGIES:
            bad(f"--placement-strategy {self.strategy!r}: one of {', '.join(STRATEGIES)}")
        if self.port != "auto" and not (self.port.isdigit() and 1 <= int(self.port) <= 65535):
            bad(f"--port {self.port!r}: give a TCP port or 'auto'")
        if role in TORCHRUN_ROLES and self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            bad(
                f"--nproc-per-node {self.nproc_per_node} ranks on {self.gpus_per_node} GPUs per "
                "node: use one rank per GPU"
            )
        for flag, value in (
            ("--worker-prefix", self.worker_prefix),
            ("--submission-id", self.submission_id),
            ("--job-name", self.job_name),
        ):
            if value and not _NAME.match(value):
                bad(f"{flag} {value!r}: use letters, digits, '_', '.', '-'")
        for key in self.env:
            if not _ENV_KEY.match(key):
                bad(f"--env {key!r}: not an environment variable name")
        if self.working_dir and "://" not in self.working_dir and not os.path.isdir(self.working_dir):
            bad(f"--working-dir {self.working_dir}: no such folder here (Ray uploads it from this machine)")


def _node_cpus(role: str, spec: RaySpec) -> int:
    if role in TORCHRUN_ROLES:
        return spec.cpus_per_task
    return spec.cpus_per_task * ((spec.gpus_per_node or spec.tasks_per_node) if role in ("rollout", "reward") else 1)


def new_submission_id(role: str, spec: RaySpec) -> str:
    return (
        spec.submission_id
        or f"{spec.job_name or 'tandem-' + role}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    )


def driver_argv(role: str, spec: RaySpec, role_args: list[str], submission_id: str) -> list[str]:
    """The entrypoint's words: launch.ray_driver, its plan, then the role's own key=value args."""
    root_key = TORCHRUN_ROLES[role][1] if role in TORCHRUN_ROLES else "root"
    args = [f"{root_key}={spec.root}", *role_args]
    if role == "rollout" and spec.flush_interval is not None:
        args.append(f"buffer.flush_interval={spec.flush_interval:g}")
    plan = ["--nodes", spec.nodes, "--gpus-per-node", spec.gpus_per_node, "--cpus-per-node", _node_cpus(role, spec)]
    if role in TORCHRUN_ROLES:
        plan += [
            "--nproc-per-node",
            spec.nproc_per_node,
            "--max-restarts",
            spec.max_restarts,
            "--rdzv-id",
            submission_id,
        ]
        if spec.nodes > 1:
            plan += ["--port", spec.port, "--placement-strategy", spec.strategy]
    elif role in ("rollout", "reward"):  # one process per GPU (or per task on CPU), named apart
        plan += [
            "--tasks-per-node",
            spec.gpus_per_node or spec.tasks_per_node,
            "--worker-prefix",
            spec.worker_prefix or f"{'r' if role == 'reward' else 'w'}-{submission_id}",
        ]
    return [spec.python, "-m", "launch.ray_driver", role, *map(str, plan), "--", *args]


def render(role: str, spec: RaySpec, role_args: list[str]) -> dict:
    """`JobSubmissionClient.submit_job`'s keyword arguments for the role."""
    spec.check(role)
    submission_id = new_submission_id(role, spec)
    cpus = _node_cpus(role, spec)
    env = {
        **spec.runtime_env.get("env_vars", {}),
        **spec.env,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(
            max(1, spec.cpus_per_task // spec.nproc_per_node) if role in TORCHRUN_ROLES else spec.cpus_per_task
        ),
        STOP_WAIT_VAR: str(spec.stop_timeout_s),
    }
    runtime_env = {**spec.runtime_env, "env_vars": env}
    if spec.working_dir:
        runtime_env["working_dir"] = spec.working_dir
    job: dict = {
        "submission_id": submission_id,
        "entrypoint": " ".join(shlex.quote(w) for w in driver_argv(role, spec, role_args, submission_id)),
        "runtime_env": runtime_env,
        "metadata": {"tandem_role": role, "tandem_root": spec.root},
    }
    if spec.nodes == 1:  # the role's processes are the entrypoint's children: its resources
        job["entrypoint_num_cpus"] = cpus
        if spec.gpus_per_node:
            job["entrypoint_num_gpus"] = spec.gpus_per_node
    return job


def as_cli(address: str, job: dict) -> str:
    """The same submission as a `ray job submit` command line (what --dry-run also prints)."""
    words = [
        "ray",
        "job",
        "submit",
        "--address",
        address,
        "--submission-id",
        job["submission_id"],
        "--runtime-env-json",
        json.dumps(job["runtime_env"], sort_keys=True),
        "--metadata-json",
        json.dumps(job["metadata"], sort_keys=True),
    ]
    if "entrypoint_num_cpus" in job:
        words += ["--entrypoint-num-cpus", str(job["entrypoint_num_cpus"])]
    if "entrypoint_num_gpus" in job:
        words += ["--entrypoint-num-gpus", str(job["entrypoint_num_gpus"])]
    return " ".join(shlex.quote(w) for w in words) + " --no-wait -- " + job["entrypoint"]


# --- Ray's Jobs API ---------------------------------------------------------------------------
def client(address: str):
    """A JobSubmissionClient for the cluster's dashboard; RayJobError when it cannot be reached."""
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError as e:
        raise RayJobError(
            f"ray is not installed here ({e}): pip install 'tandem[ray]' (the same ray version as the cluster's)"
        ) from None
    try:
        return JobSubmissionClient(address)
    except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError...
        raise RayJobError(
            f"cannot reach the Ray Jobs API at {address}: {str(e).splitlines()[0]} "
            "(is the head up with the dashboard, `ray start --head "
            "--include-dashboard=true`, and its port 8265 reachable from here?)"
        ) from None


def submit(address: str, job: dict, jobs_client=None) -> str:
    c = jobs_client or client(address)
    try:
        return c.submit_job(**job)
    except Exception as e:  # noqa: BLE001
        raise RayJobError(f"submitting {job['submission_id']} to {address} failed: {e}") from None


def stop(address: str, submission_id: str, jobs_client=None) -> bool:
    """`ray job stop`: SIGTERM to the entrypoint and its processes, SIGKILL after the job's
    RAY_JOB_STOP_WAIT_TIME_S. Whether the job was still running."""
    c = jobs_client or client(address)
    try:
        return c.stop_job(submission_id)
    except Exception as e:  # noqa: BLE001
        raise RayJobError(f"ray job stop {submission_id} at {address} failed: {e}") from None


def info(address: str, submission_id: str, jobs_client=None) -> dict:
    """{status, message, driver_exit_code}; status UNKNOWN when Ray no longer knows the job."""
    c = jobs_client or client(address)
    try:
        details = c.get_job_info(submission_id)
    except Exception as e:  # noqa: BLE001 - RuntimeError from Ray, or the HTTP client's errors
        if "does not exist" in str(e) or "404" in str(e):
            return {"status": "UNKNOWN", "message": str(e), "driver_exit_code": None}
        raise RayJobError(f"ray job status {submission_id} at {address} failed: {e}") from None
    return {
        "status": str(details.status),
        "message": details.message or "",
        "driver_exit_code": details.driver_exit_code,
    }
