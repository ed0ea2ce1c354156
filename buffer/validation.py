"""Validation requests and results on the shared filesystem (schemas in protocol/validation.py).

The trainer `request`s a version after publishing it; `WeightStore.prune` keeps requested versions
(up to `keep` of them beyond the newest `keep`), so a slow validator does not lose them and a dead
one cannot fill the disk. The validator reads `requests()` oldest first and `answer`s each: the
result is written atomically, then the request removed, which releases the version.
"""
from __future__ import annotations

import logging
import time

from buffer.layout import RunLayout
from buffer.storage import atomic_write, filesystem
from protocol.validation import ValidationFormatError, ValidationRequest, ValidationResult

log = logging.getLogger(__name__)


class ValidationQueue:
    def __init__(self, root: str):
        self.fs, root_path = filesystem(root)
        self.layout = RunLayout(root_path)

    def _versions(self, folder: str) -> list[int]:
        try:
            names = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        return sorted(v for v in map(RunLayout.validation_version, names) if v is not None)

    # --- trainer side ---------------------------------------------------------------------
    def request(self, version: int, step: int) -> None:
        req = ValidationRequest(version=version, step=step, requested_at=time.time())
        atomic_write(self.fs, self.layout.validation_request(version), req.to_json().encode())

    def result(self, version: int) -> ValidationResult | None:
        path = self.layout.validation_result(version)
        try:
            text = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return ValidationResult.from_json(text, where=path)

    def held(self) -> list[int]:
        """Versions with an open request, oldest first (kept on disk by WeightStore.prune)."""
        return self._versions(self.layout.validation_requests_dir)

    # --- validator side -------------------------------------------------------------------
    def requests(self) -> list[ValidationRequest]:
        """Open requests, oldest version first; a malformed one is answered as skipped."""
        out = []
        for version in self.held():
            path = self.layout.validation_request(version)
            if self.fs.exists(self.layout.validation_result(version)):
                self._release(version)
                continue
            try:
                out.append(ValidationRequest.from_json(self.fs.cat_file(path), where=path))
            except FileNotFoundError:
                continue  # answered meanwhile
            except ValidationFormatError as e:
                log.warning("%s", e)
                self.answer(ValidationResult(version=version, step=-1, metrics={}, skipped=str(e),
                                             finished_at=time.time()))
        return out

    def answer(self, result: ValidationResult) -> None:
        """Publish the result, then release the version. A crash in between leaves a request
        whose result exists; `requests` releases it without evaluating it again."""
        atomic_write(self.fs, self.layout.validation_result(result.version), result.to_json().encode())
        self._release(result.version)

    def _release(self, version: int) -> None:
        try:
            self.fs.rm_file(self.layout.validation_request(version))
        except FileNotFoundError:
            pass
