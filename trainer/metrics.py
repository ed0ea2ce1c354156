"""One console line per step with units, and the same numbers as JSON lines; validation
results as lines of their own."""
from __future__ import annotations

import json
import os
from typing import Callable


def rl_line(m: dict) -> str:
    """The RL trainer's console line."""
    return (f"step {m['step']}/{m['total']} | weights v{m['weights/version']} | "
            f"reward {m['reward/mean']:.3f} | staleness {m['staleness/mean']:.2f} versions | "
            + (f"loss {m['actor/pg_loss']:+.4f} | clipfrac {m['actor/pg_clipfrac']:.3f} | "
               f"grad norm {m['actor/grad_norm']:.3f} | " if "actor/pg_loss" in m
               else "actor: critic warmup | ")
            + (f"vf_loss {m['critic/vf_loss']:.4f} | " if "critic/vf_loss" in m else "")
            + (f"mismatch KL {m['rollout/mismatch_kl']:.1e} | " if "rollout/mismatch_kl" in m else "")
            + f"{m['samples/step']} samples, {m['tokens/step']} tokens | "
            f"step {m['time/step_s']:.2f} s (wait {m['time/wait_s']:.2f} s)")


class MetricsLog:
    """`backends` as verl's `trainer.logger`: 'console' is this class's own line; the others
    (tensorboard, wandb, swanlab, mlflow, ...) go through verl's Tracking."""

    def __init__(self, path: str, total_steps: int, backends: list[str] | None = None,
                 project: str = "tandem", experiment: str = "run", config: dict | None = None,
                 tensorboard_dir: str | None = None, swanlab_dir: str | None = None,
                 line: Callable[[dict], str] = rl_line):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.file = open(path, "a", buffering=1)
        self.total = total_steps
        self.line = line  # the console line of a metrics row (with "total": the step count)
        self.tracking = None
        others = [b for b in backends or [] if b != "console"]
        if others:
            # Default folders inside the run (verl's defaults are relative to the working dir).
            # SwanLab: SWANLAB_MODE=local keeps it offline (verl's default mode is 'cloud').
            for var, folder in (("TENSORBOARD_DIR", tensorboard_dir), ("SWANLAB_LOG_DIR", swanlab_dir)):
                if folder:
                    os.environ.setdefault(var, folder)
            from verl.utils.tracking import Tracking
            self.tracking = Tracking(project, experiment, default_backend=others, config=config)

    def _append(self, row: dict) -> None:
        # One write() per line: a reader tailing the file never sees half an object.
        self.file.write(json.dumps(row, sort_keys=True) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def _track(self, row: dict, step: int) -> None:
        if self.tracking is not None:
            # scalars only: samples/ids (trainer.log_sample_ids) is a list, val/skipped a
            # string, for metrics.jsonl
            self.tracking.log(data={k: v for k, v in row.items() if k != "step"
                                    and isinstance(v, (int, float))}, step=step)

    def write(self, metrics: dict) -> None:
        self._append(metrics)
        self._track(metrics, metrics["step"])
        print(self.line({**metrics, "total": self.total}), flush=True)

    def write_validation(self, row: dict, step_now: int) -> None:
        """A validation result: its own line, whose `step` is the step of the weights it
        measured. Trackers get it at `step_now`, the trainer's latest step (wandb ignores a step
        below its current one); `val/step` there names the measured step."""
        self._append(row)
        self._track({**row, "val/step": row["step"]}, step_now)
        scores = "; ".join(f"{k} {v:.3f}" for k, v in sorted(row.items()) if k.startswith("val-core/"))
        print(f"validation of step {row['step']} (weights v{row['val/weights_version']}): "
              f"{scores or 'skipped: ' + row.get('val/skipped', '?')}"
              + (f" | {row['val/prompts']} prompts in {row['val/generate_s']:.2f} s"
                 if "val/prompts" in row else ""), flush=True)

    def close(self) -> None:
        self.file.close()
        if self.tracking is not None:
            self.tracking.finish()
