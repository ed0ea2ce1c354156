"""One console line per step with units, and the same numbers as JSON lines."""
from __future__ import annotations

import json
import os
from typing import Callable


def rl_line(m: dict) -> str:
    """The RL trainer's console line."""
    return (f"step {m['step']}/{m['total']} | weights v{m['weights/version']} | "
            f"reward {m['reward/mean']:.3f} | staleness {m['staleness/mean']:.2f} versions | "
            f"loss {m['actor/pg_loss']:+.4f} | grad norm {m['actor/grad_norm']:.3f} | "
            f"{m['samples/step']} samples, {m['tokens/step']} tokens | "
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

    def write(self, metrics: dict) -> None:
        # One write() per line: a reader tailing the file never sees half an object.
        self.file.write(json.dumps(metrics, sort_keys=True) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        if self.tracking is not None:
            # scalars only: samples/ids (trainer.log_sample_ids) is a list, for metrics.jsonl
            self.tracking.log(data={k: v for k, v in metrics.items() if k != "step"
                                    and isinstance(v, (int, float))}, step=metrics["step"])
        print(self.line({**metrics, "total": self.total}), flush=True)

    def close(self) -> None:
        self.file.close()
        if self.tracking is not None:
            self.tracking.finish()
