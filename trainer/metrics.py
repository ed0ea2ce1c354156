"""One console line per step with units, and the same numbers as JSON lines; validation
results as lines of their own."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Callable

from buffer.storage import when_space


def rl_line(m: dict) -> str:
    """The RL trainer's console line."""
    return (
        f"step {m['step']}/{m['total']} | weights v{m['weights/version']} | "
        f"reward {m['reward/mean']:.3f} | staleness {m['staleness/mean']:.2f} versions | "
        + (
            f"loss {m['actor/pg_loss']:+.4f} | clipfrac {m['actor/pg_clipfrac']:.3f} | "
            f"grad norm {m['actor/grad_norm']:.3f} | "
            if "actor/pg_loss" in m
            else "actor: critic warmup | "
        )
        + (f"vf_loss {m['critic/vf_loss']:.4f} | " if "critic/vf_loss" in m else "")
        + (f"mismatch KL {m['rollout/mismatch_kl']:.1e} | " if "rollout/mismatch_kl" in m else "")
        + f"{m['samples/step']} samples, {m['tokens/step']} tokens | "
        f"step {m['time/step_s']:.2f} s (wait {m['time/wait_s']:.2f} s)"
        + (f" | compiled {m['perf/compiled_graphs']} graphs" if m.get("perf/compiled_graphs") else "")
    )


@contextlib.contextmanager
def timed(timing: dict, name: str):
    """verl's marked_timer: the phase's seconds, logged as timing_s/<name>."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        timing[f"timing_s/{name}"] = timing.get(f"timing_s/{name}", 0.0) + time.monotonic() - t0


def length_metrics(name: str, lengths: list[int], cap: int) -> dict:
    """verl's <name>/mean, max, min and clip_ratio (the share at the length cap)."""
    return {
        f"{name}/mean": sum(lengths) / len(lengths),
        f"{name}/max": max(lengths),
        f"{name}/min": min(lengths),
        f"{name}/clip_ratio": sum(n >= cap for n in lengths) / len(lengths),
    }


def generation_seconds(samples: list) -> float:
    """verl's timing_s/gen as a decoupled trainer sees it: the mean generation time of the
    worker batches its samples come from, each from the batch's start (its samples' created_at)
    to its first scored sample (the earliest finished_at: generation plus one reward)."""
    first_scored: dict[tuple[str, float], float] = {}
    for s in samples:
        batch = (s.worker_id, s.created_at)
        first_scored[batch] = min(first_scored.get(batch, s.finished_at), s.finished_at)
    return sum(end - start for (_, start), end in first_scored.items()) / len(first_scored)


def mfu(model_config, seqlens: list[int], seconds: float, passes: int, device) -> float:
    """verl's actor MFU of this rank: the model FLOPs of `passes` forward+backward passes over
    sequences of `seqlens` tokens in `seconds`, over the device's peak (verl's estimates per
    model type and its device table; 0 where it knows either not)."""
    import torch
    from verl.utils import flops_counter

    estimate = flops_counter.ESTIMATE_FUNC.get(model_config.model_type)
    # verl's own lookup asks CUDA for the device name even on a CPU machine: name it here
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    promised = flops_counter.get_device_flops(device_name=name)
    if estimate is None or promised in (0, float("inf")):
        return 0.0
    achieved = estimate(model_config, sum(seqlens), seqlens, max(seconds, 1e-9))
    return achieved * passes / promised


def memory_metrics(device) -> dict:
    """verl's perf/max_memory_allocated_gb and _reserved_gb (the GPU's peak) and
    perf/cpu_memory_used_gb."""
    import psutil
    import torch

    out = {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / 1024**3}
    if device.type == "cuda":
        out |= {
            "perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 1024**3,
            "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 1024**3,
        }
    return out


def _print(line: str) -> None:
    """The console line; lost, not fatal, when the console's log file is on a full disk."""
    try:
        print(line, flush=True)
    except OSError:
        pass


class MetricsLog:
    """`backends` as verl's `trainer.logger`: 'console' is this class's own line; the others
    (tensorboard, wandb, swanlab, mlflow, ...) go through verl's Tracking."""

    def __init__(
        self,
        path: str,
        total_steps: int,
        backends: list[str] | None = None,
        project: str = "tandem",
        experiment: str = "run",
        config: dict | None = None,
        tensorboard_dir: str | None = None,
        swanlab_dir: str | None = None,
        line: Callable[[dict], str] = rl_line,
    ):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
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
        # One write() per line: a reader tailing the file never sees half an object. On a full
        # disk the line waits for space (a partial one is cut off first).
        line = (json.dumps(row, sort_keys=True) + "\n").encode()
        when_space(lambda: self._write_line(line), self.path)

    def _write_line(self, line: bytes) -> None:
        size = os.fstat(self.fd).st_size
        try:
            if os.write(self.fd, line) != len(line):
                raise OSError(errno.ENOSPC, "short write")
            os.fsync(self.fd)
        except OSError:
            os.ftruncate(self.fd, size)
            raise

    def _track(self, row: dict, step: int) -> None:
        if self.tracking is not None:
            # scalars only: samples/ids (trainer.log_sample_ids) is a list, val/skipped a
            # string, for metrics.jsonl
            self.tracking.log(
                data={k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}, step=step
            )

    def write(self, metrics: dict) -> None:
        self._append(metrics)
        self._track(metrics, metrics["step"])
        _print(self.line({**metrics, "total": self.total}))

    def write_validation(self, row: dict, step_now: int) -> None:
        """A validation result: its own line, whose `step` is the step of the weights it
        measured. Trackers get it at `step_now`, the trainer's latest step (wandb ignores a step
        below its current one); `val/step` there names the measured step."""
        self._append(row)
        self._track({**row, "val/step": row["step"]}, step_now)
        scores = "; ".join(f"{k} {v:.3f}" for k, v in sorted(row.items()) if k.startswith("val-core/"))
        _print(
            f"validation of step {row['step']} (weights v{row['val/weights_version']}): "
            f"{scores or 'skipped: ' + row.get('val/skipped', '?')}"
            + (f" | {row['val/prompts']} prompts in {row['val/generate_s']:.2f} s" if "val/prompts" in row else "")
        )

    def close(self) -> None:
        os.close(self.fd)
        if self.tracking is not None:
            self.tracking.finish()
