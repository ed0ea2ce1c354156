"""Run the whole pipeline on one machine: a torchrun trainer and rollout workers as processes.

    python -m launch.local --root runs/demo --steps 150

Without inputs given, it builds the built-in tiny model and task into the run folder. Every
child is its own process group, owned here: on success, on Ctrl-C, or when any child fails, all
are stopped (SIGTERM, then SIGKILL after a grace period) and the exit code says what happened.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from buffer.layout import RunLayout
from buffer.weights import hf_folder_problem
from rollout import builtin_task

# The built-in task's recipe (tuned so a random-init model learns it by RL in a few minutes;
# see rollout/builtin_task.py). User overrides (--trainer/--worker) come after and win.
BUILTIN_TRAINER = ["actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.weight_decay=0",
                   "data.train_batch_size=16", "trainer.max_staleness=4", "buffer.poll_interval=0.2"]
BUILTIN_WORKER = ["actor_rollout_ref.rollout.n=16", "actor_rollout_ref.rollout.prompts_per_batch=16",
                  "buffer.flush_samples=128", "buffer.flush_interval=5", "buffer.max_backlog_samples=256"]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m launch.local", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="run folder (created; must not hold an earlier run)")
    p.add_argument("--steps", type=int, default=200, help="trainer steps (default 200)")
    p.add_argument("--workers", type=int, default=2, help="rollout worker processes (default 2)")
    p.add_argument("--nproc", type=int, default=2, help="trainer ranks under torchrun (default 2)")
    p.add_argument("--model", help="HF model folder (default: build the built-in tiny model)")
    p.add_argument("--data", help="verl-format parquet (default: write the built-in task)")
    p.add_argument("--digits", type=int, default=3, help="built-in task: digits per prompt")
    p.add_argument("--trainer", action="append", default=[], metavar="KEY=VALUE",
                   help="extra trainer override, repeatable (e.g. trainer.publish_freq=2)")
    p.add_argument("--worker", action="append", default=[], metavar="KEY=VALUE",
                   help="extra worker override, repeatable")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before giving up (default 3600)")
    p.add_argument("--trainer-gpus", help="CUDA_VISIBLE_DEVICES of the trainer, e.g. 0")
    p.add_argument("--worker-gpus", help="GPUs for the workers, one each in turn, e.g. 1,2")
    args = p.parse_args(argv)
    if args.steps < 1 or args.workers < 1 or args.nproc < 1:
        p.error("--steps, --workers and --nproc must be at least 1")
    return args


def prepare(layout: RunLayout, args) -> tuple[str, str]:
    """Model folder and dataset for the run, building the built-in ones when not given."""
    if os.path.exists(layout.weights_dir) or os.path.exists(layout.metrics):
        raise SystemExit(f"launch.local: {layout.root} already holds a run; choose a new --root")
    if args.model and (problem := hf_folder_problem(args.model)):  # before starting anything
        raise SystemExit(f"launch.local: --model {problem}")
    if args.data and not os.path.isfile(args.data):
        raise SystemExit(f"launch.local: --data {args.data} not found (a verl-format parquet file)")
    model = args.model or layout.init_model
    if not args.model and not os.path.exists(model):
        builtin_task.write_model(model)
    data = args.data or layout.train_parquet
    if not args.data and not os.path.exists(data):
        builtin_task.write_parquet(data, builtin_task.make_rows(2000, args.digits))
    return model, data


class Child:
    def __init__(self, name: str, cmd: list[str], log_path: str, gpus: str | None = None):
        self.name, self.log_path = name, log_path
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "ab")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

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


def start_children(layout: RunLayout, args, model: str, data: str) -> tuple[Child, list[Child]]:
    py = sys.executable
    trainer = Child("trainer", [py, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc_per_node={args.nproc}", "-m", "trainer.main",
                                f"root={layout.root}", f"actor_rollout_ref.model.path={model}",
                                f"trainer.total_training_steps={args.steps}",
                                *BUILTIN_TRAINER, *args.trainer], layout.log("trainer"),
                    args.trainer_gpus)
    worker_gpus = args.worker_gpus.split(",") if args.worker_gpus else None
    workers = [Child(f"worker w{i}", [py, "-m", "rollout.worker", f"root={layout.root}",
                                      f"worker.id=w{i}", f"worker.seed={i}",
                                      f"data.train_files=[{data}]",
                                      f"data.max_response_length={args.digits}",
                                      *BUILTIN_WORKER, *args.worker], layout.log(f"worker-w{i}"),
                     worker_gpus[i % len(worker_gpus)] if worker_gpus else None)
               for i in range(args.workers)]
    return trainer, workers


def read_metrics(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def supervise(trainer: Child, workers: list[Child], layout: RunLayout, args) -> Child | None:
    """Wait for the trainer to finish; return the child that failed, if any."""
    from tqdm import tqdm
    deadline = time.monotonic() + args.timeout
    bar = tqdm(total=args.steps, unit="step", desc="training", dynamic_ncols=True,
               mininterval=1.0 if sys.stderr.isatty() else 15.0)
    try:
        while True:
            rows = read_metrics(layout.metrics)
            if rows and rows[-1]["step"] != bar.n:
                bar.set_postfix(reward=f"{rows[-1]['reward/mean']:.3f}",
                                version=rows[-1]["weights/version"], refresh=False)
                bar.update(rows[-1]["step"] - bar.n)  # redraws at most every `mininterval`
            code = trainer.poll()
            if code is not None:
                return None if code == 0 else trainer
            for w in workers:
                if w.poll() not in (None, 0):
                    return w
            if time.monotonic() > deadline:
                raise TimeoutError(f"launch.local: the trainer did not finish within --timeout {args.timeout:.0f} s")
            time.sleep(0.5)
    finally:
        bar.close()


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
        print(f"launch.local: {signal.Signals(signum).name} again: killing what is left now",
              file=sys.stderr)
        self.hurry.set()


def stop_all(children: list[Child], grace_s: float, signals: Signals) -> None:
    """SIGTERM every child's process group at once, wait (up to `grace_s` in all), SIGKILL the
    rest; a second signal kills at once."""
    signals.cleaning = True
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
                print(f"launch.local: {child.name} ignored SIGTERM for {grace_s:.0f} s; killing it",
                      file=sys.stderr)
            child.signal_group(signal.SIGKILL)
            child.proc.wait(timeout=30)
        child.log.close()


def summarize(layout: RunLayout) -> None:
    rows = read_metrics(layout.metrics)
    if not rows:
        return
    k = min(10, len(rows))
    first = sum(r["reward/mean"] for r in rows[:k]) / k
    last = sum(r["reward/mean"] for r in rows[-k:]) / k
    print(f"reward/mean: first {k} steps {first:.3f} -> last {k} steps {last:.3f}; "
          f"final weights v{rows[-1]['weights/version'] + 1} in {layout.weights_dir}")
    for hb in sorted(Path(layout.workers_dir).glob("*.json")):
        beat = json.loads(hb.read_text())
        print(f"worker {beat['worker_id']}: {beat['samples_written']} samples, "
              f"{len(set(beat['versions_loaded']))} weight versions loaded")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layout = RunLayout(os.path.abspath(args.root))
    model, data = prepare(layout, args)
    print(f"launch.local: run folder {layout.root}; logs in {os.path.dirname(layout.log('x'))}")
    signals = Signals()
    trainer, workers = start_children(layout, args, model, data)
    failed, code = None, 0
    try:
        failed = supervise(trainer, workers, layout, args)
    except KeyboardInterrupt:
        print("launch.local: interrupted; stopping all processes", file=sys.stderr)
        code = 130
    except TimeoutError as e:
        print(e, file=sys.stderr)
        code = 1
    finally:
        stop_all([*workers, trainer], grace_s=60, signals=signals)
    if failed is not None:
        print(f"launch.local: {failed.name} exited with code {failed.proc.returncode}; "
              f"see {failed.log_path}. Last lines:\n{failed.tail()}", file=sys.stderr)
        return 1
    if code == 0:
        summarize(layout)
    return code


if __name__ == "__main__":
    sys.exit(main())
