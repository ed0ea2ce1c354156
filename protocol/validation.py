"""Validation requests and results: what the trainer and `rollout.validate` exchange.

The trainer writes a request (`RunLayout.validation_request`) for each weight version it wants
measured on `data.val_files`; while the request exists the version is kept on disk. The validator
answers with a result (`RunLayout.validation_result`), written atomically, then removes the
request. A result carries verl's validation metric names (`val-core/<data_source>/reward/mean@1`,
`val-aux/...`), or, when the version could not be evaluated, `skipped` saying why.
"""

from __future__ import annotations

import dataclasses
import json


class ValidationFormatError(ValueError):
    """A request or result file does not parse; the message names the file."""


@dataclasses.dataclass
class ValidationRequest:
    version: int
    step: int  # trainer steps taken when the version was published (0: the initial weights)
    requested_at: float

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> ValidationRequest:
        return _parse(cls, text, where)


@dataclasses.dataclass
class ValidationResult:
    version: int
    step: int
    metrics: dict[str, float]  # verl's names: val-core/<data_source>/reward/mean@1, val-aux/...
    prompts: int = 0
    samples: int = 0
    generate_s: float = 0.0  # seconds of generation and scoring
    finished_at: float = 0.0
    skipped: str = ""  # why the version was not evaluated (e.g. pruned); metrics then empty

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> ValidationResult:
        return _parse(cls, text, where)


def _parse(cls, text, where: str):
    try:
        d = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
    except (TypeError, ValueError) as e:
        raise ValidationFormatError(f"{where}: malformed {cls.__name__}: {e}") from None
