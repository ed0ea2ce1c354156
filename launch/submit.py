"""Submit one role of a run as a SLURM job: the rollout workers, the trainer, the validator or SFT.

    python -m launch.submit rollout --root /shared/runs/r1 --partition cheap --nodes 2 \\
        --gpus-per-node 8 data.train_files=[/shared/data/train.parquet] actor_rollout_ref.rollout.name=vllm
    python -m launch.submit trainer --root /shared/runs/r1 --partition big --nodes 4 \\
        --gpus-per-node 8 --nproc-per-node 8 actor_rollout_ref.model.path=/shared/models/base \\
        trainer.test_freq=10
    python -m launch.submit validate --root /shared/runs/r1 --partition cheap --gpus-per-node 1 \\
        data.val_files=[/shared/data/test.parquet] actor_rollout_ref.rollout.name=vllm
    python -m launch.submit reward --root /shared/runs/r1 --partition cheap --nodes 1 \\
        --gpus-per-node 8 reward_model.model.path=/shared/models/rm reward_model.max_length=4096
    python -m launch.submit sft --root /shared/sft/s1 --partition big --nodes 2 --gpus-per-node 8 \\
        --config sft.yaml model.partial_pretrain=/shared/models/base

On a Ray cluster (`--backend ray`, docs/ray.md) each role is a Ray job instead, submitted through
Ray's Jobs API to the head's dashboard; `--dry-run` prints the submission (JSON, and as a `ray job
submit` command line):

    python -m launch.submit trainer --backend ray --address http://HEAD:8265 --root /shared/runs/r1 \
        --nodes 4 --gpus-per-node 8 actor_rollout_ref.model.path=/shared/models/base

Renders the role's sbatch script (launch/slurm/rollout.sbatch, validate.sbatch, or trainer.sbatch
for the torchrun roles trainer and sft) with these settings, submits it with `sbatch --parsable`
and prints the job id; `--dry-run` prints the script instead. Every `key=value` argument goes to
the role's process (`python -m rollout.worker` per task, `python -m rollout.validate`,
`trainer.main` or `trainer.sft` under torchrun) and is validated here first. The run folder (for
sft: the output folder, trainer.default_local_dir) must be on a filesystem every node sees at the
same path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from launch import ray_jobs, slurm
from protocol.config import ConfigError, build, split_argv


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m launch.submit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("role", choices=["rollout", "trainer", "sft", "validate", "reward"])
    p.add_argument(
        "--root",
        required=True,
        help="run folder, on the shared filesystem (sft: the output folder, trainer.default_local_dir)",
    )
    p.add_argument("--partition", help="SLURM partition (default: the cluster's default)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs per node (rollout: one worker per GPU; default 0: CPU)"
    )
    p.add_argument(
        "--tasks-per-node",
        type=int,
        default=1,
        help="rollout on CPU: workers per node (default 1; with GPUs: one per GPU)",
    )
    p.add_argument(
        "--cpus-per-task",
        type=int,
        default=None,
        help="CPUs per worker (rollout, default 1) or per node (trainer/sft, default nproc)",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="trainer/sft: ranks per node (default: --gpus-per-node, or 1 on CPU)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=2,
        help="trainer/sft: when a rank dies (a native crash, an OOM kill), torchrun restarts every "
        "rank from the last checkpoint, this many times before the job fails (default 2)",
    )
    p.add_argument("--time", default="1-00:00:00", help="time limit (default 1-00:00:00)")
    p.add_argument(
        "--signal-before",
        type=int,
        default=None,
        metavar="SECONDS",
        help="this long before the time limit: rollout workers get SIGTERM (flush, "
        "exit; default 120); the trainer checkpoints, exits and its job is "
        "requeued to resume (default 600: a checkpoint of a large model takes "
        "minutes)",
    )
    p.add_argument("--array", help="rollout: job array spec, e.g. 0-3 or 0-7%%2 (one job per task)")
    p.add_argument("--flush-interval", type=float, help="rollout: seconds before a partial shard is published")
    p.add_argument(
        "--port",
        default="auto",
        help="trainer/sft: c10d rendezvous port on the first node (default: 20000 + job id %% 20000)",
    )
    p.add_argument("--job-name", default="", help="job name (default tandem-<role>)")
    p.add_argument(
        "--worker-prefix",
        default="",
        help="rollout: worker id prefix (default w-j<job id>); reward: server id prefix (default r-j<job id>)",
    )
    p.add_argument("--output", help="job output file (default ROOT/logs/slurm-<role>-%%j.out)")
    p.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="extra sbatch option, repeatable (e.g. --sbatch=--account=rl)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the script instead of submitting it")
    ray = p.add_argument_group("Ray (--backend ray; docs/ray.md)")
    ray.add_argument(
        "--backend",
        choices=["slurm", "ray"],
        default="slurm",
        help="slurm (default): an sbatch job; ray: a Ray job (Jobs API)",
    )
    ray.add_argument(
        "--address",
        default=os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS"),
        help="the Ray dashboard, e.g. http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS, then $RAY_ADDRESS)",
    )
    ray.add_argument(
        "--working-dir",
        help="runtime_env working_dir: a folder Ray uploads and runs the "
        "job in (the tandem checkout); default: tandem installed on every node",
    )
    ray.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="runtime_env env var, repeatable (e.g. --env NCCL_SOCKET_IFNAME=ib0)",
    )
    ray.add_argument(
        "--runtime-env",
        metavar="FILE",
        help="a runtime_env YAML/JSON file (pip, conda, env_vars...), merged under tandem's own env vars",
    )
    ray.add_argument(
        "--python", default=sys.executable, help="the python on the nodes (default: this one, %(default)s)"
    )
    ray.add_argument("--submission-id", default="", help="Ray submission id (default <job name>-<time>-<random>)")
    ray.add_argument(
        "--placement-strategy",
        default="STRICT_SPREAD",
        choices=ray_jobs.STRATEGIES,
        help="trainer/sft on several nodes: how the per-node bundles are placed "
        "(default STRICT_SPREAD: one bundle per node)",
    )
    ray.add_argument(
        "--stop-timeout",
        type=int,
        default=None,
        metavar="SECONDS",
        help="ray job stop: SIGKILL this long after SIGTERM (default 120; trainer 60)",
    )
    return p.parse_known_args(argv)  # the rest: the role's key=value arguments


def role_args(role: str, root: str, rest: list[str]) -> list[str]:
    """The role's key=value arguments, validated against its config (fail here, not in the job)."""
    overrides, yaml_file, _ = split_argv(rest)
    root_key = slurm.TORCHRUN_ROLES[role][1] if role in slurm.TORCHRUN_ROLES else "root"
    if root_key in overrides or root_key.rsplit(".", 1)[-1] in overrides:
        raise ConfigError(f"{root_key}: give the {'output' if role == 'sft' else 'run'} folder with --root")
    cls: type
    if role == "rollout":
        from rollout.config import WorkerConfig as cls

        if "worker.id" in overrides or "id" in overrides:
            raise ConfigError("worker.id: set per task by the job (use --worker-prefix)")
    elif role == "validate":
        from rollout.config import ValidatorConfig as cls
    elif role == "reward":
        from rollout.config import RewardServerConfig as cls

        if "server.id" in overrides:
            raise ConfigError("server.id: set per task by the job (use --worker-prefix)")
    elif role == "sft":
        from trainer.sft_config import SFTConfig as cls
    else:
        from trainer.config import TrainerConfig as cls
    build(cls, {**overrides, root_key: root}, yaml_file)
    out = [f"{k}={v}" for k, v in overrides.items()]
    if yaml_file:
        out = ["--config", os.path.abspath(yaml_file), *out]
    return out


def spec_from(args) -> slurm.JobSpec:
    nproc = args.nproc_per_node or args.gpus_per_node or 1
    cpus = args.cpus_per_task or (nproc if args.role in slurm.TORCHRUN_ROLES else 1)
    return slurm.JobSpec(
        root=os.path.abspath(args.root),
        partition=args.partition,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        cpus_per_task=cpus,
        time=args.time,
        job_name=args.job_name,
        array=args.array,
        flush_interval=args.flush_interval,
        nproc_per_node=nproc,
        port=str(args.port),
        max_restarts=args.max_restarts,
        worker_prefix=args.worker_prefix,
        signal_before_s=args.signal_before or (600 if args.role == "trainer" else 120),
        output=args.output,
        sbatch_args=args.sbatch,
    )


# launch.submit's SLURM-only options, with their defaults: refused with --backend ray;
SLURM_ONLY = {
    "partition": None,
    "time": "1-00:00:00",
    "signal_before": None,
    "array": None,
    "output": None,
    "sbatch": [],
}

# and the Ray-only ones, refused without it
RAY_ONLY = {
    "working_dir": None,
    "env": [],
    "runtime_env": None,
    "python": sys.executable,
    "submission_id": "",
    "placement_strategy": "STRICT_SPREAD",
    "stop_timeout": None,
}


def _given(args, defaults: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}" for k, v in defaults.items() if getattr(args, k) != v]


def ray_spec_from(args) -> ray_jobs.RaySpec:
    given = _given(args, SLURM_ONLY)
    if given:
        raise ValueError(
            f"{', '.join(given)}: SLURM options; a Ray job takes --nodes, --gpus-per-node, "
            "--cpus-per-task and the Ray options (docs/ray.md)"
        )
    if not args.address:
        raise ValueError("--address: give the Ray dashboard, e.g. --address http://HEAD:8265")
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--env {item!r}: give KEY=VALUE")
        env[key] = value
    runtime_env: dict = {}
    if args.runtime_env:
        import yaml

        with open(args.runtime_env) as f:
            runtime_env = yaml.safe_load(f) or {}
        if not isinstance(runtime_env, dict):
            raise ValueError(f"--runtime-env {args.runtime_env}: not a mapping of runtime_env fields")
    nproc = args.nproc_per_node or args.gpus_per_node or 1
    torchrun = args.role in slurm.TORCHRUN_ROLES
    return ray_jobs.RaySpec(
        root=os.path.abspath(args.root),
        address=args.address,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task or (nproc if torchrun else 1),
        nproc_per_node=nproc,
        max_restarts=args.max_restarts,
        port=str(args.port),
        strategy=args.placement_strategy,
        worker_prefix=args.worker_prefix,
        flush_interval=args.flush_interval,
        stop_timeout_s=args.stop_timeout or (60 if args.role == "trainer" else 120),
        submission_id=args.submission_id,
        job_name=args.job_name,
        working_dir=args.working_dir
        if not args.working_dir or "://" in args.working_dir
        else os.path.abspath(args.working_dir),  # a local folder, or a URI Ray fetches (s3://...)
        env=env,
        runtime_env=runtime_env,
        python=args.python,
    )


def main_ray(args, rest: list[str]) -> int:
    try:
        spec = ray_spec_from(args)
        job = ray_jobs.render(args.role, spec, role_args(args.role, spec.root, rest))
    except (ConfigError, ValueError, OSError) as e:
        print(f"launch.submit: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps(job, indent=2))
        print(ray_jobs.as_cli(spec.address, job))
        return 0
    try:
        print(ray_jobs.submit(spec.address, job))
    except ray_jobs.RayJobError as e:
        print(f"launch.submit: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    if args.backend == "ray":
        return main_ray(args, rest)
    try:
        if _given(args, RAY_ONLY):
            raise ValueError(f"{', '.join(_given(args, RAY_ONLY))}: Ray options; add --backend ray")
        spec = spec_from(args)
        extra = role_args(args.role, spec.root, rest)
        if args.role == "rollout":
            script = slurm.render_rollout(spec, extra)
        elif args.role == "validate":
            script = slurm.render_validate(spec, extra)
        elif args.role == "reward":
            script = slurm.render_reward(spec, extra)
        else:
            script = slurm.render_trainer(spec, extra, args.role)
    except (ConfigError, ValueError) as e:
        print(f"launch.submit: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(script, end="")
        return 0
    os.makedirs(os.path.dirname(slurm.output_path(spec, args.role)), exist_ok=True)
    try:
        job_id = slurm.submit(script)
    except slurm.SlurmError as e:
        print(f"launch.submit: {e}", file=sys.stderr)
        return 1
    print(job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
