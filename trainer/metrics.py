"""One console line per step with units, and the same numbers as JSON lines."""
from __future__ import annotations

import json
import os


class MetricsLog:
    """`backends` as verl's `trainer.logger`: 'console' is this class's own line; the others
    (tensorboard, wandb, swanlab, mlflow, ...) go through verl's Tracking."""

    def __init__(self, path: str, total_steps: int, backends: list[str] | None = None,
                 project: str = "tandem", experiment: str = "run", config: dict | None = None,
                 tensorboard_dir: str | None = None):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.file = open(path, "a", buffering=1)
        self.total = total_steps
        self.tracking = None
        others = [b for b in backends or [] if b != "console"]
        if others:
            if tensorboard_dir:
                os.environ.setdefault("TENSORBOARD_DIR", tensorboard_dir)
            from verl.utils.tracking import Tracking
            self.tracking = Tracking(project, experiment, default_backend=others, config=config)

    def write(self, metrics: dict) -> None:
        # One write() per line: a reader tailing the file never sees half an object.
        self.file.write(json.dumps(metrics, sort_keys=True) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        if self.tracking is not None:
            self.tracking.log(data={k: v for k, v in metrics.items() if k != "step"},
                              step=metrics["step"])
        m = metrics
        actor = (f"loss {m['actor/pg_loss']:+.4f} | clipfrac {m['actor/pg_clipfrac']:.3f} | "
                 f"grad norm {m['actor/grad_norm']:.3f} | " if "actor/pg_loss" in m
                 else "actor: critic warmup | ")
        critic = f"vf_loss {m['critic/vf_loss']:.4f} | " if "critic/vf_loss" in m else ""
        print(f"step {m['step']}/{self.total} | weights v{m['weights/version']} | "
              f"reward {m['reward/mean']:.3f} | staleness {m['staleness/mean']:.2f} versions | "
              f"{actor}{critic}{m['samples/step']} samples, {m['tokens/step']} tokens | "
              f"step {m['time/step_s']:.2f} s (wait {m['time/wait_s']:.2f} s)", flush=True)

    def close(self) -> None:
        self.file.close()
        if self.tracking is not None:
            self.tracking.finish()
