"""Run the whole pipeline on one machine: a torchrun trainer and rollout workers as processes.

    python -m launch.local --root runs/demo --steps 150
    python -m launch.local --root runs/warm --sft-steps 100    # SFT warm start, then RL
    python -m launch.local --root runs/grpo --config my_verl_grpo.yaml
    python -m launch.local --root runs/arith --task arith --sft-steps 200   # GSM8K-format task

Without inputs given, it builds the built-in tiny model and task (--task) into the run folder
(the model is copied from a per-machine cache, $TANDEM_CACHE_DIR or ~/.cache/tandem, built there once),
with some of the task's distinct questions held out (copy: a fifth; arith: 100 of 2000): a
validator (`rollout.validate`) measures them every --test-freq steps. A --config file (verl's
shape) goes to every role; its model path, train files, step count and validation
(data.val_files, trainer.test_freq) are used unless --model, --data, --steps, --val-data,
--test-freq say otherwise, and its settings win over the built-in recipe. Every child is its own
process group, owned here: on success, on Ctrl-C, or when any child fails, all are stopped
(SIGTERM, then SIGKILL after a grace period) and the exit code says what happened.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from buffer.channel import TOKEN_ENV
from buffer.run import TrainerRun, setup_trainer_run
from buffer.storage import respect_umask
from buffer.weights.fs import hf_folder_problem
from launch import status, torchrun
from protocol.config import ConfigError, file_values, load, split_argv
from protocol.fields import _flatten, _read_yaml
from rollout import builtin_task
from rollout.tasks import arith

# The built-in task's recipe (tuned so a random-init model learns it by RL in a few minutes;
# see rollout/builtin_task.py). User overrides (--trainer/--worker) come after and win.
BUILTIN_TRAINER = [
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.optim.weight_decay=0",
    "data.train_batch_size=16",
    "trainer.max_staleness=4",
    "buffer.poll_interval=0.2",
    "critic.optim.lr=1e-3",  # the critic's, used with algorithm.adv_estimator=gae
    # The built-in task's rows are all of about one length (nothing to unpad), and on CPU a packed
    # row attends through a dense block-diagonal mask: padded micro-batches are faster here
    # (issue 25, benchmarks/README.md). A --config or --trainer setting wins, as always.
    "actor_rollout_ref.model.use_remove_padding=false",
]
# SFT on the built-in task's (question, answer) pairs: 100 steps copy unseen questions greedily
# (tests/test_sft.py). total_epochs is only a cap: --sft-steps sets the length.
BUILTIN_SFT = [
    "data.train_batch_size=64",
    "optim.lr=3e-3",
    "optim.weight_decay=0",
    "model.enable_gradient_checkpointing=false",
    "data.max_token_len_per_gpu=1024",
    "trainer.total_epochs=1000",
]
BUILTIN_WORKER = [
    "actor_rollout_ref.rollout.n=16",
    "actor_rollout_ref.rollout.prompts_per_batch=16",
    "buffer.flush_samples=128",
    "buffer.flush_interval=5",
    "buffer.max_backlog_samples=256",
]
MODEL, TRAIN_FILES, STEPS = "actor_rollout_ref.model.path", "data.train_files", "trainer.total_training_steps"
VAL_FILES, TEST_FREQ = "data.val_files", "trainer.test_freq"
REMOTE = ["buffer.transport=grpc"]  # --remote-workers, every role
DEFAULT_STEPS, DEFAULT_TEST_FREQ = 200, 10


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m launch.local", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", required=True, help="run folder (created; must not hold an earlier run)")
    p.add_argument(
        "--config", help="YAML config for both roles, e.g. a verl GRPO/PPO config (see README, 'Coming from verl')"
    )
    p.add_argument("--steps", type=int, help=f"trainer steps (default: the config's {STEPS}, else {DEFAULT_STEPS})")
    p.add_argument("--workers", type=int, default=2, help="rollout worker processes (default 2)")
    p.add_argument("--nproc", type=int, default=2, help="trainer ranks under torchrun (default 2)")
    p.add_argument("--model", help="HF model folder (default: build the built-in tiny model)")
    p.add_argument("--data", help="verl-format parquet (default: write the built-in task)")
    p.add_argument(
        "--val-data",
        help="verl-format parquet of held-out prompts (default: the "
        f"config's {VAL_FILES}, else the built-in task's validation split when the "
        "built-in task is trained on)",
    )
    p.add_argument(
        "--test-freq",
        type=int,
        help=f"validate every this many steps (default: the config's {TEST_FREQ}, else {DEFAULT_TEST_FREQ}; 0: never)",
    )
    p.add_argument(
        "--task",
        default="copy",
        choices=("copy", "arith"),
        help="built-in task: copy (copy 3 digits) or arith (rollout/tasks/arith.py: "
        "GSM8K-format word problems scored by verl's gsm8k reward, with its own "
        "BPE tokenizer and tiny model)",
    )
    p.add_argument("--digits", type=int, default=3, help="copy task: digits per prompt")
    p.add_argument(
        "--sft-steps",
        type=int,
        default=0,
        help="first warm-start the model with this many SFT steps (python -m trainer.sft) "
        "on the built-in task's (question, answer) pairs; RL then starts from "
        "ROOT/sft/hf (default 0: no SFT)",
    )
    p.add_argument(
        "--sft-config",
        help="YAML config of the SFT stage (verl's sft_trainer.yaml or "
        "sft_trainer_engine.yaml shape), with --sft-steps; its model and data are the "
        "built-in ones unless it names them",
    )
    p.add_argument(
        "--sft",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra trainer.sft override, repeatable (e.g. optim.lr=3e-4)",
    )
    p.add_argument(
        "--trainer",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra trainer override, repeatable (e.g. trainer.publish_freq=2)",
    )
    p.add_argument(
        "--worker", action="append", default=[], metavar="KEY=VALUE", help="extra worker override, repeatable"
    )
    p.add_argument(
        "--validator",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra validator override, repeatable (e.g. data.val_batch_size=64)",
    )
    p.add_argument(
        "--remote-workers",
        action="store_true",
        help="run the workers and the validator as if they had no access to the "
        "trainer's run folder: buffer.transport=grpc (a free loopback port; a "
        f"random token in ${TOKEN_ENV} unless set) and each of them gets its own "
        "separate folder ROOT/remote/<id> as its root (weight cache, shard claim, "
        "log, a copy of its data files); heartbeats, weights, validation and the "
        "end of the run go through the trainer's run service, experience over "
        "gRPC, nothing by path",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds before giving up (default 3600)")
    p.add_argument(
        "--no-report",
        action="store_true",
        help="no HTML report at the end (~2 s of plotting; `python -m launch.report RUN` writes it later)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="start a worker or the validator that died again, at most this many times each "
        "(default 3; 0: a death ends the run); one that refused to run (exit code 2) is never restarted. "
        "The trainer and SFT: torchrun's --max-restarts, as on SLURM and Ray (every rank again, resumed "
        "from the last checkpoint; torchrun cannot tell a refusal, so one repeats its refusal that often)",
    )
    p.add_argument(
        "--reward-model",
        help="score the workers' and the validator's responses with this reward model (an HF sequence "
        "classifier, one output) on --reward-servers reward servers (python -m rollout.reward_server) in "
        "place of the rule reward, which the experience keeps beside it (reward_model.enable) and "
        "validation reports as val-aux/<data_source>/rule_reward",
    )
    p.add_argument("--reward-servers", type=int, default=1, help="reward server processes (default 1)")
    p.add_argument("--reward-gpus", help="GPUs for the reward servers, one each in turn, e.g. 3")
    p.add_argument("--trainer-gpus", help="CUDA_VISIBLE_DEVICES of the trainer, e.g. 0")
    p.add_argument("--worker-gpus", help="GPUs for the workers, one each in turn, e.g. 1,2")
    p.add_argument("--validator-gpu", help="CUDA_VISIBLE_DEVICES of the validator, e.g. 3")
    args = p.parse_args(argv)
    if (args.steps is not None and args.steps < 1) or args.workers < 1 or args.nproc < 1:
        p.error("--steps, --workers and --nproc must be at least 1")
    if args.sft_steps < 0 or (args.test_freq is not None and args.test_freq < 0) or args.max_restarts < 0:
        p.error("--sft-steps, --test-freq and --max-restarts must be at least 0")
    if args.sft_config and not args.sft_steps:
        p.error("--sft-config needs --sft-steps")
    if args.reward_servers < 1:
        p.error("--reward-servers must be at least 1")
    if args.reward_model:
        if not os.path.isdir(args.reward_model):
            p.error(f"--reward-model {args.reward_model}: not a folder")
        args.reward_model = os.path.abspath(args.reward_model)
    return args


def builtin_recipe(args) -> tuple[list[str], list[str]]:
    """The built-in task's trainer and worker overrides."""
    if args.task == "arith":
        return BUILTIN_TRAINER, [
            *BUILTIN_WORKER,
            f"data.max_prompt_length={arith.MAX_PROMPT_LENGTH}",
            f"data.max_response_length={arith.MAX_RESPONSE_LENGTH}",
        ]
    return BUILTIN_TRAINER, [*BUILTIN_WORKER, f"data.max_response_length={args.digits}"]


def sft_max_length(args) -> int:
    """Tokens of the longest SFT sequence of the built-in task."""
    if args.task == "arith":
        return arith.MAX_PROMPT_LENGTH + arith.MAX_RESPONSE_LENGTH
    return 2 * args.digits + 2  # digits '=' digits eos


def from_config(args, run: TrainerRun) -> dict:
    """The values the --config file sets for the inputs and recipe keys launch.local chooses."""
    if not args.config:
        return {}
    recipe_keys = [a.split("=", 1)[0] for part in builtin_recipe(args) for a in part]
    try:
        # --data replaces the file's train files for its interpolations too (val_files may be
        # ${data.train_files}, as in tests/data/verl_grpo.yaml)
        values = file_values(
            args.config,
            [MODEL, TRAIN_FILES, STEPS, VAL_FILES, TEST_FREQ, *recipe_keys],
            {"root": run.files.root, **({TRAIN_FILES: [args.data]} if args.data else {})},
        )
    except ConfigError as e:
        raise SystemExit(f"launch.local: {e}") from None
    for key in (TRAIN_FILES, VAL_FILES):  # verl's own default is one path, not a list
        if isinstance(values.get(key), str):
            values[key] = [values[key]]
    for key in (STEPS, TEST_FREQ):
        if key in values:
            values[key] = _as_int(values[key], f"{key} in --config {args.config}")
    return values


def _as_int(value, what: str) -> int:
    try:
        if isinstance(value, (bool, float)):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise SystemExit(f"launch.local: {what}: expected an integer, got {value!r}") from None


CACHE_ENV = "TANDEM_CACHE_DIR"  # where launch.local keeps the built-in initial models


def initial_model(dest: str, task: str) -> None:
    """The built-in task's random-init model folder at `dest`, copied from this machine's cache
    ($TANDEM_CACHE_DIR, else ~/.cache/tandem) and built there on first use: building imports
    torch and transformers (~5 s of a CPU's time), which would otherwise delay every run's
    start. The cache key covers what decides the bytes (the task, the versions of the libraries
    that build and write it, the code that builds it); both folders are made atomically, so a
    crash leaves no half a model. An unwritable cache only means building in place."""
    key = _model_key(task)
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tandem") / "init-models" / key
    if not cache.is_dir():
        tmp = Path(f"{cache}.tmp-{os.getpid()}")
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            _write_model(str(tmp), task)
            tmp.rename(cache)  # another run may have won the race: its copy is the same
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if not cache.is_dir():
                print(f"launch.local: no model cache ({e}); building the initial model in place", file=sys.stderr)
                _write_model(dest, task)
                return
    tmp_dest = f"{dest}.tmp"
    shutil.rmtree(tmp_dest, ignore_errors=True)  # a crashed launch's copy
    shutil.copytree(cache, tmp_dest)
    respect_umask(tmp_dest)  # this run's umask, not the one the cache was built under
    os.replace(tmp_dest, dest)


def _write_model(out_dir: str, task: str) -> None:
    if task == "arith":
        arith.write_model(out_dir, "tiny")
    else:
        builtin_task.write_model(out_dir)


def _model_key(task: str) -> str:
    import hashlib
    from importlib import metadata

    h = hashlib.sha256(task.encode())
    for dist in ("torch", "transformers", "tokenizers", "safetensors"):
        h.update(f"{dist}={metadata.version(dist)};".encode())
    for module in (builtin_task, arith):  # the tokenizer, the shape, the seed
        h.update(Path(module.__file__ or "").read_bytes())
    return f"{task}-{h.hexdigest()[:16]}"


def prepare(run: TrainerRun, args, config: dict) -> tuple[str, str | None, list[str] | None]:
    """Model folder, dataset and validation datasets for the run (flags, else the config, else the
    built-in ones, built when missing). The dataset is None when the config names the train
    files; the validation datasets are None when there is no validation. Sets args.test_freq."""
    if os.path.exists(run.files.weights_dir) or os.path.exists(run.files.metrics):
        raise SystemExit(f"launch.local: {run.files.root} already holds a run; choose a new --root")
    model = os.path.expanduser(args.model or config.get(MODEL) or run.files.init_model)
    if model == run.files.init_model and not os.path.exists(model):
        initial_model(model, args.task)
    elif problem := hf_folder_problem(model):  # before starting anything
        where = "--model" if args.model else f"{MODEL} in --config {args.config}"
        raise SystemExit(f"launch.local: {where}: {problem}")
    if args.data and not os.path.isfile(args.data):
        raise SystemExit(f"launch.local: --data {args.data} not found (a verl-format parquet file)")
    builtin = not args.data and TRAIN_FILES not in config
    if builtin and not os.path.exists(run.files.prepared_parquet("rl", "train")):
        # rollout.preprocess's files: the validation split holds out whole questions
        paths = {(k, s): run.files.prepared_parquet(k, s) for k in ("sft", "rl") for s in ("train", "val")}
        if args.task == "arith":
            arith.write_task(paths, num=2000)  # 100 held out: a CPU validator answers in seconds
        else:
            builtin_task.write_sft_and_rl(paths, digits=args.digits)
    data = args.data or (run.files.prepared_parquet("rl", "train") if builtin else None)
    val = (
        [args.val_data]
        if args.val_data
        else config.get(VAL_FILES) or ([run.files.prepared_parquet("rl", "val")] if builtin else None)
    )
    if args.test_freq is None:
        args.test_freq = config.get(TEST_FREQ, DEFAULT_TEST_FREQ)
    return model, data, (val if args.test_freq > 0 else None)


def recipe(config: dict, args) -> tuple[list[str], list[str]]:
    """The built-in recipe's trainer and worker overrides, less the keys the config sets."""
    trainer, worker = ([a for a in part if a.split("=", 1)[0] not in config] for part in builtin_recipe(args))
    return trainer, worker


class Child:
    def __init__(self, name: str, cmd: list[str], log_path: str, gpus: str | None = None):
        self.name, self.log_path, self.cmd, self.restarts = name, log_path, cmd, 0
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "ab")
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.env.update(torchrun.ENV)  # read by the trainer's and SFT's torchrun only
        if gpus is not None:
            self.env["CUDA_VISIBLE_DEVICES"] = gpus
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )

    def restart(self) -> None:
        """The same command again (its log appended to); the dead process was waited for."""
        self.restarts += 1
        self.proc = self._start()

    def poll(self):
        return self.proc.poll()

    def signal_group(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def tail(self, lines: int = 15) -> str:
        """The log's last lines, preceded by its error lines (torchrun prints its own summary
        after the child's traceback, which would otherwise hide the cause)."""
        try:
            text = Path(self.log_path).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [line for line in text[:-lines] if "Error" in line or "error:" in line][-5:]
        return "\n".join([*errors, "...", *text[-lines:]] if errors else text[-lines:])


class ChildFailed(RuntimeError):
    """A child that had to succeed before the next phase exited with an error."""


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(
        total=total, unit="step", desc=desc, dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 15.0
    )


def _advance(bar, rows: list[dict], postfix) -> None:
    """Move a progress bar to the newest metrics row."""
    if rows and rows[-1]["step"] != bar.n:
        bar.set_postfix(**postfix(rows[-1]), refresh=False)
        bar.update(rows[-1]["step"] - bar.n)  # redraws at most every `mininterval`


def sft_args(run: TrainerRun, args, model: str) -> list[str]:
    """trainer.sft's config arguments: --sft-config, then the built-in model, data and recipe
    for what that file does not set."""
    given: set[str] = set()
    if args.sft_config:
        try:
            given = set(_flatten(_read_yaml(args.sft_config), set()))
        except ConfigError as e:
            raise SystemExit(f"launch.local: --sft-config: {e}") from None
    builtin = [
        f"data.train_files=[{run.files.prepared_parquet('sft', 'train')}]",
        f"data.val_files=[{run.files.prepared_parquet('sft', 'val')}]",
        f"data.max_length={sft_max_length(args)}",
        *BUILTIN_SFT,
    ]
    if not given & {"model.partial_pretrain", "model.path"}:
        builtin.append(f"model.partial_pretrain={model}")
    return ([f"--config={os.path.abspath(args.sft_config)}"] if args.sft_config else []) + [
        a for a in builtin if a.split("=", 1)[0] not in given
    ]


def sft_command(run: TrainerRun, args, model: str) -> list[str]:
    """trainer.sft's whole argument list: its config, its output folder ROOT/sft and step count,
    then --sft's overrides."""
    return [
        *sft_args(run, args, model),
        f"trainer.default_local_dir={run.files.sft_dir}",
        f"trainer.total_training_steps={args.sft_steps}",
        *args.sft,
    ]


def run_sft(run: TrainerRun, args, argv: list[str], signals: Signals) -> str:
    """Run trainer.sft with `argv` to completion (a bar from its metrics); returns its final HF
    folder."""
    out = setup_trainer_run(run.files.sft_dir).files
    child = Child(
        "sft",
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.nproc}",
            f"--max-restarts={args.max_restarts}",  # as on SLURM and Ray: every rank again, resumed
            "-m",
            "trainer.sft",
            *argv,
        ],
        run.files.log("sft"),
        args.trainer_gpus,
    )
    deadline = time.monotonic() + args.timeout
    bar = _progress(args.sft_steps, "sft")
    try:
        while child.poll() is None:
            _advance(bar, read_metrics(out.metrics), lambda m: {"loss": f"{m['train/loss']:.3f}"})
            if time.monotonic() > deadline:
                raise TimeoutError(f"SFT did not finish within --timeout {args.timeout:.0f} s")
            time.sleep(0.5)
    finally:
        bar.close()
        stop_all([child], 60, signals)
    code = child.proc.returncode
    if code != 0:
        raise ChildFailed(f"sft exited with code {code}; see {child.log_path}. Last lines:\n{child.tail()}")
    rows = read_metrics(out.metrics)
    val = next((r["val/loss"] for r in reversed(rows) if "val/loss" in r), float("nan"))
    print(
        f"sft: {len(rows)} steps, train loss {rows[0]['train/loss']:.3f} -> "
        f"{rows[-1]['train/loss']:.3f}, held-out loss {val:.3f}; RL starts from {out.hf_model}"
    )
    return out.hf_model


def role_args(
    run: TrainerRun, args, model: str, data: str | None, config: dict, val: list[str] | None
) -> tuple[list[str], list[str], list[str] | None]:
    """The trainer's, the workers' (each adds its id and seed) and the validator's config
    arguments; no validator without `val`, and then the trainer requests no validation."""
    common = ["--config", os.path.abspath(args.config)] if args.config else []
    common.append(f"root={run.files.root}")
    # every role: the workers and the validator apply adapter-only (LoRA) versions to this base
    common.append(f"{MODEL}={model}")
    trainer_recipe, worker_recipe = recipe(config, args)
    trainer = [
        *common,
        f"{STEPS}={args.steps}",
        *trainer_recipe,
        f"{TEST_FREQ}={args.test_freq if val else -1}",
        *args.trainer,
    ]
    data_arg = [f"{TRAIN_FILES}=[{data}]"] if data else []
    model_rm = getattr(args, "reward_model", None)  # tests build their own namespaces
    # --reward-model: the workers and the validator score on the reward servers (as verl's
    # validation uses rm_scores when reward_model.enable is set)
    rm = ["reward_model.enable=true", f"reward_model.model.path={model_rm}"] if model_rm else []
    validator = (
        [
            *common,
            f"{VAL_FILES}=[{','.join(val)}]",
            *[a for a in worker_recipe if a.startswith("data.max_response_length=")],
            "validator.poll_interval_s=0.5",
            *rm,
            *args.validator,
        ]
        if val
        else None
    )
    return trainer, [*common, *data_arg, *worker_recipe, *rm, *args.worker], validator


def reward_plan(run: TrainerRun, args) -> list[tuple[list[str], int]]:
    """--reward-model: each reward server's config arguments and its port (free now, on
    loopback: with --remote-workers the workers are told the addresses, reward_model.addresses)."""
    if not getattr(args, "reward_model", None):
        return []
    out = []
    for i in range(args.reward_servers):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = [f"root={run.files.root}", f"reward_model.model.path={args.reward_model}", f"server.id=r{i}"]
        argv = [*(["--config", os.path.abspath(args.config)] if args.config else []), *argv]
        out.append(([*argv, "server.host=127.0.0.1", f"server.port={port}", "server.beat_s=1"], port))
    return out


def check_config(
    trainer_args: list[str],
    worker_args: list[str],
    validator_args: list[str] | None,
    sft: list[str] | None = None,
    reward: list[str] | None = None,
) -> None:
    """Build the roles' configs (and SFT's, `sft`) now, so that a bad key or an engine that
    cannot start stops the run before any process starts; print each line about verl keys that
    do not apply once (the roles' logs have them too)."""
    from rollout.config import RewardServerConfig, ValidatorConfig, WorkerConfig
    from rollout.engine_types import engine_problem  # no torch: the supervisor never imports it
    from trainer.config import TrainerConfig, device_problem
    from trainer.sft_config import SFTConfig

    lines: list[str] = []
    roles = [(TrainerConfig, trainer_args), (WorkerConfig, worker_args)]
    roles += [(ValidatorConfig, validator_args)] if validator_args else []
    for cls, argv in roles + ([(SFTConfig, sft)] if sft else []) + ([(RewardServerConfig, reward)] if reward else []):
        try:
            overrides, yaml_file, _ = split_argv(argv)
            cfg, warnings = load(cls, overrides, yaml_file)
            lines += [w for w in warnings if w not in lines]
            if cls is RewardServerConfig:
                continue
            problem = (
                engine_problem(cfg.actor_rollout_ref.rollout.name)
                if cls in (WorkerConfig, ValidatorConfig)
                else device_problem(cfg.trainer.device)
            )
            if problem:
                raise ConfigError(problem)
        except ConfigError as e:
            print(f"launch.local: config error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    for line in lines:
        print(f"config: {line}", file=sys.stderr)


def remote(run: TrainerRun, role: str, argv: list[str], grpc: list[str], user: list[str]) -> tuple[list[str], str]:
    """--remote-workers: `argv` of a worker or the validator with its own root
    ROOT/remote/<role> (its data files copied there) and the gRPC settings `grpc` (the user's
    overrides `user` still win); and its log file, in that folder."""
    own = setup_trainer_run(run.files.remote_root(role)).files
    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "root":
            arg = f"root={own.root}"
        elif key in (TRAIN_FILES, VAL_FILES) and value.startswith("["):
            os.makedirs(os.path.dirname(own.train_parquet), exist_ok=True)
            copies = []
            for i, path in enumerate(value.strip("[]").split(",")):
                copies.append(
                    os.path.join(
                        os.path.dirname(own.train_parquet), f"{key.rsplit('.', 1)[1]}-{i}-{os.path.basename(path)}"
                    )
                )
                shutil.copyfile(path, copies[-1])
            arg = f"{key}=[{','.join(copies)}]"
        out.append(arg)
    return [*out, *grpc, *user], own.log(role)


def remote_settings(args) -> tuple[list[str], list[str]]:
    """--remote-workers: the trainer's and the others' gRPC settings (a free loopback port;
    the token from $TANDEM_GRPC_TOKEN, made up now if unset: the children inherit it)."""
    if not os.environ.get(TOKEN_ENV):
        os.environ[TOKEN_ENV] = secrets.token_hex(16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return (
        [*REMOTE, f"buffer.grpc_bind=127.0.0.1:{port}", *args.trainer],
        [*REMOTE, f"buffer.grpc_address=127.0.0.1:{port}"],
    )


def worker_command(i: int, argv: list[str]) -> list[str]:
    """Worker i's whole argument list: its id and seed, then the workers' config arguments."""
    return [f"worker.id=w{i}", f"worker.seed={i}", *argv]


def reward_children(run: TrainerRun, args, reward: list[tuple[list[str], int]]) -> list[Child]:
    """The reward servers (--reward-model), owned like the workers (restarted when they die);
    the token they and the workers share from $TANDEM_GRPC_TOKEN, made up now if unset."""
    if reward and not os.environ.get(TOKEN_ENV):
        os.environ[TOKEN_ENV] = secrets.token_hex(16)
    gpus = args.reward_gpus.split(",") if getattr(args, "reward_gpus", None) else None
    config = ["--config", os.path.abspath(args.config)] if args.config else []
    return [
        Child(
            f"reward server r{i}",
            [sys.executable, "-m", "rollout.reward_server", "--run", run.files.root, *config, *_sets(argv)],
            run.files.log(f"reward-r{i}"),
            gpus[i % len(gpus)] if gpus else None,
        )
        for i, (argv, _) in enumerate(reward)
    ]


def _sets(argv: list[str]) -> list[str]:
    """A reward server's config arguments as its flags (its root is --run, its file --config)."""
    keys = [a for a in argv if "=" in a and not a.startswith("root=")]
    return [x for a in keys for x in ("--set", a)]


def start_children(
    run: TrainerRun,
    args,
    trainer_args: list[str],
    worker_args: list[str],
    validator_args: list[str] | None,
    reward: list[tuple[list[str], int]] = (),  # type: ignore[assignment]
) -> tuple[Child, list[Child]]:
    """The trainer, and the other children: the reward servers, the workers, then the validator
    if it has args. With --remote-workers each worker and the validator runs in its own folder
    (`remote`), told the reward servers' addresses."""
    py = sys.executable
    grpc: list[str] = []
    servers = reward_children(run, args, list(reward))
    if args.remote_workers and reward:
        addresses = f"reward_model.addresses=[{','.join(f'127.0.0.1:{p}' for _, p in reward)}]"
        worker_args = [*worker_args, addresses]
        validator_args = [*validator_args, addresses] if validator_args is not None else None
    if args.remote_workers:
        trainer_extra, grpc = remote_settings(args)
        trainer_args = [*trainer_args, *trainer_extra]
    place = (
        (lambda role, argv, log, user: remote(run, role, argv, grpc, user))
        if args.remote_workers
        else (lambda role, argv, log, user: (argv, log))
    )
    trainer = Child(
        "trainer",
        [
            py,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.nproc}",
            f"--max-restarts={args.max_restarts}",  # as on SLURM and Ray: every rank again, resumed
            "-m",
            "trainer.main",
            *trainer_args,
        ],
        run.files.log("trainer"),
        args.trainer_gpus,
    )
    worker_gpus = args.worker_gpus.split(",") if args.worker_gpus else None
    workers = []
    for i in range(args.workers):
        argv, log = place(f"w{i}", worker_args, run.files.log(f"worker-w{i}"), args.worker)
        workers.append(
            Child(
                f"worker w{i}",
                [py, "-m", "rollout.worker", *worker_command(i, argv)],
                log,
                worker_gpus[i % len(worker_gpus)] if worker_gpus else None,
            )
        )
    if validator_args is not None:
        argv, log = place("validator", validator_args, run.files.log("validator"), args.validator)
        workers.append(Child("validator", [py, "-m", "rollout.validate", *argv], log, args.validator_gpu))
    return trainer, [*servers, *workers]


def read_metrics(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def rl_metrics(run: TrainerRun) -> tuple[list[dict], dict[str, list[list]]]:
    """(one row per trainer step, every val-core metric's [step, unix time, value] points)."""
    rows, vals = status.split_metrics(read_metrics(run.files.metrics))
    return rows, status.validation_series(vals)


def supervise(trainer: Child, workers: list[Child], run: TrainerRun, args) -> Child | None:
    """Wait for the trainer to finish; return the child that failed, if any."""
    deadline = time.monotonic() + args.timeout
    bar = _progress(args.steps, "training")
    try:
        while True:
            rows, vals = rl_metrics(run)
            val = {"val": f"{min(vals.items())[1][-1][2]:.3f}"} if vals else {}
            _advance(
                bar,
                rows,
                lambda m, val=val: {"reward": f"{m['reward/mean']:.3f}", "version": m["weights/version"], **val},
            )
            code = trainer.poll()
            if code is not None:
                return None if code == 0 else trainer
            if (dead := restart_dead(workers, args.max_restarts)) is not None:
                return dead
            if time.monotonic() > deadline:
                raise TimeoutError(f"launch.local: the trainer did not finish within --timeout {args.timeout:.0f} s")
            time.sleep(0.5)
    finally:
        bar.close()


REFUSED = 2  # a role's exit code for a refusal (config, data, reward set-up): never restarted


def restart_dead(children: list[Child], max_restarts: int) -> Child | None:
    """Start again each child that died (a crash, a kill) while the run goes on, up to
    `max_restarts` times each: one worker's death costs its batch in flight, not the run. The
    child that refused to run (exit code 2: it would refuse again) or died once too often is
    returned; None otherwise."""
    for child in children:
        code = child.poll()
        if code in (None, 0):
            continue
        if code == REFUSED or child.restarts >= max_restarts:
            return child
        print(
            f"launch.local: {child.name} exited with code {code}; starting it again "
            f"(restart {child.restarts + 1} of --max-restarts {max_restarts}; log {child.log_path})",
            file=sys.stderr,
        )
        child.restart()
    return None


class Signals:
    """SIGTERM (e.g. from a batch system) is handled like Ctrl-C: the first one interrupts the
    supervision (KeyboardInterrupt); once cleanup has begun, another one only cuts its grace
    period short, so cleanup itself is never interrupted."""

    def __init__(self):
        self.cleaning = False
        self.hurry = threading.Event()
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)

    def __call__(self, signum, _frame):
        if not self.cleaning:
            self.cleaning = True
            raise KeyboardInterrupt
        print(f"launch.local: {signal.Signals(signum).name} again: killing what is left now", file=sys.stderr)
        self.hurry.set()


def stop_all(children: list[Child], grace_s: float, signals: Signals) -> None:
    """SIGTERM every child's process group at once, wait (up to `grace_s` in all), SIGKILL the
    rest; a second signal kills at once. Signals interrupt again afterwards unless one came
    before (SFT, then RL)."""
    was, signals.cleaning = signals.cleaning, True
    hurry = signals.hurry
    for child in children:
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(c.poll() is None for c in children) and time.monotonic() < deadline:
        if hurry.wait(0.2):
            break
    for child in children:
        if child.poll() is None:
            if not hurry.is_set():
                print(f"launch.local: {child.name} ignored SIGTERM for {grace_s:.0f} s; killing it", file=sys.stderr)
            child.signal_group(signal.SIGKILL)
            child.proc.wait(timeout=30)
        child.log.close()
    signals.cleaning = was
    hurry.clear()


def summarize(run: TrainerRun) -> None:
    rows, vals = rl_metrics(run)
    if not rows:
        return
    k = min(10, len(rows))
    first = sum(r["reward/mean"] for r in rows[:k]) / k
    last = sum(r["reward/mean"] for r in rows[-k:]) / k
    print(
        f"reward/mean: first {k} steps {first:.3f} -> last {k} steps {last:.3f}; "
        f"final weights v{rows[-1]['weights/version'] + 1} in {run.files.weights_dir}"
    )
    for name, points in sorted(vals.items()):
        (first_step, _, first), (last_step, _, last) = points[0], points[-1]
        print(
            f"validation (held-out prompts) {name}: step {first_step} {first:.3f} "
            f"-> step {last_step} {last:.3f} ({len(points)} results)"
        )
    for beat in run.heartbeats.all():
        print(
            f"worker {beat['worker_id']}: {beat['samples_written']} samples, "
            f"{len(set(beat['versions_loaded']))} weight versions loaded"
        )


@dataclass
class Plan:
    """What launch.local settled before starting any process (see `plan`)."""

    run: TrainerRun
    config: dict  # the --config file's values of the keys launch.local chooses (from_config)
    model: str  # the RL stage's initial model (before SFT, if any)
    data: str | None  # None: the config names the train files
    val: list[str] | None  # None: no validation
    sft: list[str] | None  # trainer.sft's arguments; None: no SFT stage
    reward: list[tuple[list[str], int]]  # each reward server's arguments and port (--reward-model)


def plan(args) -> Plan:
    """The run folder, inputs and every role's arguments; each role's config is built here so
    that a bad key stops the run before SFT or any process starts."""
    run = setup_trainer_run(os.path.abspath(args.root))
    config = from_config(args, run)
    args.steps = int(args.steps or config.get(STEPS) or DEFAULT_STEPS)
    model, data, val = prepare(run, args, config)
    sft = sft_command(run, args, model) if args.sft_steps else None
    reward = reward_plan(run, args)
    check_config(*role_args(run, args, model, data, config, val), sft, reward[0][0] if reward else None)
    return Plan(run, config, model, data, val, sft, reward)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    p = plan(args)
    run, model = p.run, p.model
    print(
        f"launch.local: run folder {run.files.root}; logs in {os.path.dirname(run.files.log('x'))}"
        + (
            f"; workers and validator in their own folders {run.files.remote_root('x')[:-2]}<id> (--remote-workers)"
            if args.remote_workers
            else ""
        )
    )
    signals = Signals()
    if p.sft is not None:
        try:
            model = run_sft(run, args, p.sft, signals)
        except (KeyboardInterrupt, TimeoutError, ChildFailed) as e:
            print(f"launch.local: SFT stopped: {e or 'interrupted'}", file=sys.stderr)
            return 130 if isinstance(e, KeyboardInterrupt) else 1
    trainer, workers = start_children(run, args, *role_args(run, args, model, p.data, p.config, p.val), p.reward)
    failed, code = None, 0
    try:
        failed = supervise(trainer, workers, run, args)
    except KeyboardInterrupt:
        print("launch.local: interrupted; stopping all processes", file=sys.stderr)
        code = 130
    except TimeoutError as e:
        print(e, file=sys.stderr)
        code = 1
    finally:
        stop_all([*workers, trainer], grace_s=60, signals=signals)
    if failed is not None:
        print(
            f"launch.local: {failed.name} exited with code {failed.proc.returncode}; "
            f"see {failed.log_path}. Last lines:\n{failed.tail()}",
            file=sys.stderr,
        )
        return 1
    if code == 0:
        summarize(run)
        if not args.no_report:
            from launch.report import write_report

            print(f"report: {write_report(run.files.root)} (live view of a run: python -m launch.status RUN)")
    return code


if __name__ == "__main__":
    sys.exit(main())
