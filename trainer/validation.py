"""The trainer's side of validation: which versions to validate, and logging the results.

verl validates before training (`trainer.val_before_train`), every `trainer.test_freq` steps and
at the last step, synchronously. Here `python -m rollout.validate` does the generating: after
publishing such a version the trainer writes a request (which also keeps the version on disk),
and logs the result whenever it shows up. Training never waits for it; only after the last step
does the trainer wait, at most `trainer.val_timeout_s`, for the results still pending.
"""

from __future__ import annotations

import logging
import time

from buffer.control.base import ValidationRequests
from protocol.validation import ValidationFormatError, ValidationResult
from trainer.metrics import MetricsLog

log = logging.getLogger("trainer")
NOTE_EVERY_S = 30.0  # a line while waiting, so a stalled validator is visible


def validation_due(tc, step: int, first: bool) -> bool:
    """Whether the version published at `step` is validated (`tc`: the trainer section).
    `first`: the initial weights, or the restored ones on resume, as verl's val_before_train."""
    if tc.test_freq <= 0:
        return False
    return tc.val_before_train if first else (step % tc.test_freq == 0 or step == tc.total_training_steps)


class ValidationLog:
    """Rank 0: requests validation of versions and logs each result once, when it arrives."""

    def __init__(self, queue: ValidationRequests, metrics: MetricsLog):
        self.queue = queue
        self.metrics = metrics
        self.pending: set[int] = set(self.queue.held())  # on resume: requests still open
        log.info(
            "validation: results of `python -m rollout.validate` are logged as they arrive (requests in %s)",
            self.queue.where(),
        )

    def request(self, version: int, step: int) -> None:
        self.queue.request(version, step)
        self.pending.add(version)

    def collect(self, step_now: int) -> None:
        """Log every result that has arrived; never waits."""
        for version in sorted(self.pending):
            try:
                result = self.queue.result(version)
            except ValidationFormatError as e:  # not written by rollout.validate: report it
                result = ValidationResult(version, -1, {}, skipped=str(e))
            if result is not None:
                self.pending.discard(version)
                self._log(result, step_now)

    def _log(self, r: ValidationResult, step_now: int) -> None:
        if r.skipped:
            log.warning("validation of weights v%d (step %d) skipped: %s", r.version, r.step, r.skipped)
            self.metrics.write_validation(
                {"step": r.step, "val/weights_version": r.version, "val/skipped": r.skipped, "time/unix": time.time()},
                step_now,
            )
            return
        self.metrics.write_validation(
            {
                "step": r.step,
                "val/weights_version": r.version,
                "val/prompts": r.prompts,
                "val/samples": r.samples,
                "val/generate_s": r.generate_s,
                "val/logged_at_step": step_now,
                "time/unix": time.time(),
                **r.metrics,
            },
            step_now,
        )

    def finish(self, timeout_s: float, step_now: int) -> None:
        """After the last step: wait for the pending results while the validator runs, at most
        `timeout_s`; then go on without them, naming them."""
        start = last_note = time.monotonic()
        while True:
            self.collect(step_now)
            if not self.pending:
                return
            beat = self.queue.beat() or {}
            waited = time.monotonic() - start
            if beat.get("state") == "stopped" or waited > timeout_s:
                why = (
                    "the validator has stopped"
                    if beat.get("state") == "stopped"
                    else f"trainer.val_timeout_s={timeout_s:.0f} s passed"
                )
                log.warning(
                    "finishing without the validation of weights %s: %s",
                    ", ".join(f"v{v}" for v in sorted(self.pending)),
                    why,
                )
                return
            if time.monotonic() - last_note > NOTE_EVERY_S:
                last_note = time.monotonic()
                log.info(
                    "waiting for the validation of weights %s (%.0f of %.0f s; is "
                    "`python -m rollout.validate` running? its heartbeat: %s)",
                    ", ".join(f"v{v}" for v in sorted(self.pending)),
                    waited,
                    timeout_s,
                    self.queue.where(),
                )
            time.sleep(0.5)
