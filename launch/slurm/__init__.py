"""SLURM job scripts for the roles, rendered from the templates in this folder, and the few
SLURM commands tandem runs (sbatch, scancel, squeue, scontrol), with their errors surfaced.

`render_rollout` / `render_trainer` / `render_validate` take a `JobSpec` (the run's settings) and the role's own
`key=value` arguments and return the sbatch script text; `submit` hands it to `sbatch --parsable`.
The torchrun roles (TORCHRUN_ROLES: the RL trainer and SFT) share trainer.sbatch.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import string
import subprocess
import sys
from pathlib import Path

from launch import torchrun

HERE = Path(__file__).resolve().parent
TASK_SCRIPT = HERE / "rollout_task.sh"
REWARD_TASK_SCRIPT = HERE / "reward_task.sh"
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^UNLIMITED$|^INFINITE$", re.I)
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


# torchrun roles: (module, the key= argument that receives the job's --root folder)
TORCHRUN_ROLES = {"trainer": ("trainer.main", "root"), "sft": ("trainer.sft", "trainer.default_local_dir")}


class SlurmError(RuntimeError):
    """A SLURM command is missing or failed; the message carries its own error text."""


@dataclasses.dataclass
class JobSpec:
    root: str
    partition: str | None = None
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int = 1  # rollout on CPU: workers per node (GPU: = gpus_per_node)
    cpus_per_task: int = 1
    time: str = "1-00:00:00"
    job_name: str = ""
    array: str | None = None  # rollout only, e.g. "0-3" or "0-7%2"
    flush_interval: float | None = None
    nproc_per_node: int = 1  # trainer only: ranks per node
    port: str = "auto"  # trainer only: rendezvous port ("auto": 20000 + job id % 20000)
    max_restarts: int = 2  # trainer/sft: torchrun restarts every rank from its last checkpoint
    # this many times after one rank dies (a native crash, an OOM kill), before the job fails
    worker_prefix: str = ""  # rollout only: worker ids <prefix>[-a<k>][-t<rank>]
    signal_before_s: int = 120  # rollout, validate: SIGTERM, trainer: checkpoint + requeue,
    # this long before the time limit
    output: str | None = None  # default: <root>/logs/slurm-<role>-%j.out
    sbatch_args: list[str] = dataclasses.field(default_factory=list)  # extra #SBATCH lines
    python: str = sys.executable
    workdir: str = dataclasses.field(default_factory=os.getcwd)

    def check(self, role: str) -> None:
        def bad(msg):
            raise ValueError(f"{role} job: {msg}")

        if self.nodes < 1:
            bad(f"--nodes must be at least 1, got {self.nodes}")
        for name in ("gpus_per_node", "tasks_per_node", "cpus_per_task", "nproc_per_node"):
            v = getattr(self, name)
            if v < (0 if name == "gpus_per_node" else 1):
                bad(f"--{name.replace('_', '-')} must be at least {0 if name == 'gpus_per_node' else 1}, got {v}")
        if not 0 <= self.max_restarts <= 100:
            bad(f"--max-restarts must be in 0..100, got {self.max_restarts}")
        if not _TIME.match(self.time):
            bad(f"--time {self.time!r}: use SLURM's forms, e.g. 30, 4:00:00, 2-00:00:00")
        if self.partition is not None and not _NAME.match(self.partition):
            bad(f"--partition {self.partition!r}: not a partition name")
        if self.port != "auto" and not (self.port.isdigit() and 1 <= int(self.port) <= 65535):
            bad(f"--port {self.port!r}: give a TCP port or 'auto'")
        if self.array is not None and not re.match(r"^[0-9,\-%:]+$", self.array):
            bad(f"--array {self.array!r}: use SLURM's form, e.g. 0-3 or 0-7%2")
        if self.worker_prefix and not _NAME.match(self.worker_prefix):
            bad(f"--worker-prefix {self.worker_prefix!r}: use letters, digits, '_', '.', '-'")


def _template(name: str) -> string.Template:
    return string.Template((HERE / name).read_text())


def _q(words) -> str:
    return " ".join(shlex.quote(str(w)) for w in words)


def output_path(spec: JobSpec, role: str) -> str:
    from buffer.run import setup_trainer_run

    return spec.output or setup_trainer_run(spec.root).files.slurm_output(role)


def _common(spec: JobSpec, role: str) -> dict:
    optional = []
    if spec.gpus_per_node:
        optional.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    optional += [f"#SBATCH {a}" for a in spec.sbatch_args]
    return {
        "job_name": spec.job_name or f"tandem-{role}",
        "partition": spec.partition or "",
        "nodes": spec.nodes,
        "cpus_per_task": spec.cpus_per_task,
        "time": spec.time,
        "workdir": shlex.quote(spec.workdir),
        "output": output_path(spec, role),
        "optional_lines": "\n".join(optional),
        "python": shlex.quote(spec.python),
        "omp_threads": max(1, spec.cpus_per_task // max(1, spec.nproc_per_node if role in TORCHRUN_ROLES else 1)),
        "torchrun_env": " ".join(f"{k}={shlex.quote(v)}" for k, v in torchrun.ENV.items()),
    }


def _finish(text: str, spec: JobSpec) -> str:
    if not spec.partition:  # the cluster's default partition
        text = "\n".join(line for line in text.splitlines() if not line.startswith("#SBATCH --partition=")) + "\n"
    return re.sub(r"\n{2,}set -euo", "\nset -euo", text)


def render_rollout(spec: JobSpec, worker_args: list[str]) -> str:
    spec.check("rollout")
    tasks = spec.gpus_per_node or spec.tasks_per_node
    args = [f"root={spec.root}", *worker_args]
    if spec.flush_interval is not None:
        args.append(f"buffer.flush_interval={spec.flush_interval:g}")
    values = _common(spec, "rollout")
    if spec.array:
        values["optional_lines"] = f"#SBATCH --array={spec.array}\n" + values["optional_lines"]
        if not spec.output:
            values["output"] = values["output"].replace("%j", "%A_%a")
    values.update(
        tasks_per_node=tasks,
        signal_before_s=spec.signal_before_s,
        worker_prefix=shlex.quote(spec.worker_prefix),
        bind_gpu=1 if spec.gpus_per_node else 0,
        task_script=shlex.quote(str(TASK_SCRIPT)),
        worker_args=_q(args),
    )
    return _finish(_template("rollout.sbatch").substitute(values), spec)


def render_reward(spec: JobSpec, server_args: list[str]) -> str:
    """Reward servers (rollout/reward_server.py), one per GPU (or per task on CPU); `server_args`
    are key=value settings (each passed as --set) and optionally --config FILE."""
    from rollout import reward_server

    spec.check("reward")
    if spec.array:
        raise ValueError("reward job: --array is for rollout jobs only (give --nodes)")
    flags = reward_server.argv(spec.root, server_args)
    values = _common(spec, "reward")
    values.update(
        tasks_per_node=spec.gpus_per_node or spec.tasks_per_node,
        signal_before_s=spec.signal_before_s,
        worker_prefix=shlex.quote(spec.worker_prefix),
        bind_gpu=1 if spec.gpus_per_node else 0,
        task_script=shlex.quote(str(REWARD_TASK_SCRIPT)),
        server_args=_q(flags),
    )
    return _finish(_template("reward.sbatch").substitute(values), spec)


def render_trainer(spec: JobSpec, trainer_args: list[str], role: str = "trainer") -> str:
    """A torchrun role's job: `role` 'trainer' (trainer.main) or 'sft' (trainer.sft)."""
    spec.check(role)
    if spec.array:
        raise ValueError(f"{role} job: --array is for rollout jobs only")
    if spec.gpus_per_node and spec.nproc_per_node > spec.gpus_per_node:
        raise ValueError(
            f"{role} job: --nproc-per-node {spec.nproc_per_node} ranks on "
            f"{spec.gpus_per_node} GPUs per node: use one rank per GPU"
        )
    module, root_key = TORCHRUN_ROLES[role]
    values = _common(spec, role)
    from buffer.run import setup_trainer_run

    layout = setup_trainer_run(spec.root).files  # trainer.stop, DONE: the RL trainer's (trainer.sft has neither)
    values.update(
        nproc_per_node=spec.nproc_per_node,
        port=spec.port,
        max_restarts=spec.max_restarts,
        role=role,
        module=module,
        signal_before_s=spec.signal_before_s,
        stoppable=int(role == "trainer"),
        stop_file=shlex.quote(layout.trainer_stop),
        done_marker=shlex.quote(layout.done_marker),
        trainer_args=_q([f"{root_key}={spec.root}", *trainer_args]),
    )
    return _finish(_template("trainer.sbatch").substitute(values), spec)


def render_validate(spec: JobSpec, validate_args: list[str]) -> str:
    spec.check("validate")
    if spec.nodes != 1 or spec.array:
        raise ValueError("validate job: one validator per run: one node, no --array")
    values = _common(spec, "validate")
    values.update(signal_before_s=spec.signal_before_s, validate_args=_q([f"root={spec.root}", *validate_args]))
    return _finish(_template("validate.sbatch").substitute(values), spec)


# --- SLURM commands -------------------------------------------------------------------------
def _run(cmd: list[str], stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    if shutil.which(cmd[0]) is None:
        raise SlurmError(
            f"{cmd[0]} not found on PATH: run this on a SLURM login node "
            "(for a local test cluster: scripts/slurm/start.sh)"
        )
    try:
        return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(cmd)} did not answer in {timeout:.0f} s (is slurmctld up?)") from None


def submit(script: str) -> str:
    """sbatch the script text; returns the job id (for an array: the array's id)."""
    out = _run(["sbatch", "--parsable"], stdin=script)
    if out.returncode != 0:
        raise SlurmError(f"sbatch failed (exit {out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    job_id = out.stdout.strip().split(";")[0]  # "<id>[;<cluster>]"
    if not job_id:
        raise SlurmError(f"sbatch printed no job id: {out.stdout!r} {out.stderr!r}")
    return job_id


def cancel(job_id: str, signal_name: str | None = None) -> None:
    """scancel the job; with a signal, only signal its steps (the job goes on until they exit)."""
    cmd = ["scancel", *([f"--signal={signal_name}"] if signal_name else []), job_id]
    out = _run(cmd)
    if (
        out.returncode != 0
        and "already completing or completed" not in out.stderr
        and "Invalid job id" not in out.stderr
    ):
        raise SlurmError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")


def queue_states(job_ids: list[str]) -> dict[str, str]:
    """{job id: state} for the given jobs still known to squeue (PENDING, RUNNING, COMPLETING...)."""
    if not job_ids:
        return {}
    out = _run(["squeue", "-h", "-o", "%i %T", "-j", ",".join(job_ids)])
    if out.returncode != 0 and "Invalid job id" not in out.stderr:
        raise SlurmError(f"squeue failed: {out.stderr.strip()}")
    states = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def job_info(job_id: str) -> dict[str, str]:
    """scontrol's record of a job (kept MinJobAge seconds after it ends): JobState, ExitCode, ...;
    {} when SLURM no longer knows it."""
    out = _run(["scontrol", "show", "job", "-o", job_id])
    if out.returncode != 0:
        return {}
    info = {}
    for token in out.stdout.split():
        key, sep, value = token.partition("=")
        if sep and key not in info:
            info[key] = value
    return info
