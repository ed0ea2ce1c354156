"""One console line per step with units, and the same numbers as JSON lines."""
from __future__ import annotations

import errno
import json
import os

from buffer.storage import when_space


def _print(line: str) -> None:
    """The console line; lost, not fatal, when the console's log file is on a full disk."""
    try:
        print(line, flush=True)
    except OSError:
        pass


class MetricsLog:
    """`backends` as verl's `trainer.logger`: 'console' is this class's own line; the others
    (tensorboard, wandb, swanlab, mlflow, ...) go through verl's Tracking."""

    def __init__(self, path: str, total_steps: int, backends: list[str] | None = None,
                 project: str = "tandem", experiment: str = "run", config: dict | None = None,
                 tensorboard_dir: str | None = None):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.total = total_steps
        self.tracking = None
        others = [b for b in backends or [] if b != "console"]
        if others:
            if tensorboard_dir:
                os.environ.setdefault("TENSORBOARD_DIR", tensorboard_dir)
            from verl.utils.tracking import Tracking
            self.tracking = Tracking(project, experiment, default_backend=others, config=config)

    def write(self, metrics: dict) -> None:
        # One write() per line: a reader tailing the file never sees half an object. On a full
        # disk the line waits for space (a partial one is cut off first).
        line = (json.dumps(metrics, sort_keys=True) + "\n").encode()
        when_space(lambda: self._append(line), self.path)
        if self.tracking is not None:
            self.tracking.log(data={k: v for k, v in metrics.items() if k != "step"},
                              step=metrics["step"])
        m = metrics
        _print(f"step {m['step']}/{self.total} | weights v{m['weights/version']} | "
              f"reward {m['reward/mean']:.3f} | staleness {m['staleness/mean']:.2f} versions | "
              f"loss {m['actor/pg_loss']:+.4f} | grad norm {m['actor/grad_norm']:.3f} | "
              f"{m['samples/step']} samples, {m['tokens/step']} tokens | "
              f"step {m['time/step_s']:.2f} s (wait {m['time/wait_s']:.2f} s)")

    def _append(self, line: bytes) -> None:
        size = os.fstat(self.fd).st_size
        try:
            if os.write(self.fd, line) != len(line):
                raise OSError(errno.ENOSPC, "short write")
            os.fsync(self.fd)
        except OSError:
            os.ftruncate(self.fd, size)
            raise

    def close(self) -> None:
        os.close(self.fd)
        if self.tracking is not None:
            self.tracking.finish()
