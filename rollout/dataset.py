"""Prompts from verl-format RL parquet files.

A row is {data_source, prompt: [{role, content}], ability, reward_model: {style, ground_truth},
extra_info: {index, ...}}. Rows are checked when loaded; a bad row names the file, the row and
the field.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from pathlib import Path

import pyarrow.parquet as pq

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    pass


@dataclasses.dataclass
class Prompt:
    prompt_id: str
    data_source: str
    token_ids: list[int]
    ground_truth: object
    extra_info: dict
    # the chat messages the prompt came from: what a reward server re-tokenises (issue 28)
    messages: list = dataclasses.field(default_factory=list)


def _row_field(row: dict, field: str, where: str):
    value = row
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            raise DatasetError(f"{where}: missing field {field!r}")
        value = value[part]
    return value


def _read(file: str, field: str, columns: list[str] | None = None):
    if not Path(file).exists():
        raise DatasetError(f"{field}: {file} does not exist")
    try:
        return pq.read_table(file, columns=columns)
    except Exception as e:  # pyarrow raises several types for a non-parquet file
        what = f" with column(s) {', '.join(columns)}" if columns else ""
        raise DatasetError(f"{field}: {file} is not a readable parquet file{what}: {e}") from None


def data_sources(files: list[str], field: str = "data.train_files") -> dict[str, str]:
    """Each distinct `data_source` and the first file naming it; reads only that column, so
    the reward functions can be checked before an engine loads."""
    out: dict[str, str] = {}
    for file in map(os.path.expanduser, files):
        for value in _read(file, field, ["data_source"]).column("data_source").unique().to_pylist():
            out.setdefault(str(value), file)
    return out


def load_prompts(
    files: list[str], tokenizer, prompt_key: str, max_prompt_length: int, field: str = "data.train_files"
) -> list[Prompt]:
    """Every usable row of `files`; `field` is the setting they came from, for errors."""
    prompts, skipped = [], 0
    for file in map(os.path.expanduser, files):  # verl's configs write ~/data/...
        rows = _read(file, field).to_pylist()
        for i, row in enumerate(rows):
            where = f"{file} row {i}"
            messages = _row_field(row, prompt_key, where)
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
            ):
                raise DatasetError(
                    f"{where}: field {prompt_key!r} must be a non-empty list of "
                    f"{{role, content}}, got {str(messages)[:80]}"
                )
            extra = row.get("extra_info") or {}
            if not isinstance(extra, dict):
                raise DatasetError(f"{where}: field 'extra_info' must be a mapping, got {str(extra)[:80]}")
            try:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except Exception as e:  # noqa: BLE001 - jinja/tokenizer errors: name the row
                raise DatasetError(
                    f"{where}: the tokenizer's chat template failed on field {prompt_key!r}: {type(e).__name__}: {e}"
                ) from None
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            if len(ids) > max_prompt_length:
                skipped += 1
                continue
            prompts.append(
                Prompt(
                    prompt_id=str(extra.get("index", f"{Path(file).name}:{i}")),
                    data_source=str(_row_field(row, "data_source", where)),
                    token_ids=list(ids),
                    ground_truth=_row_field(row, "reward_model.ground_truth", where),
                    extra_info=extra,
                    messages=[{"role": str(m["role"]), "content": str(m["content"])} for m in messages],
                )
            )
    if skipped:
        log.warning("skipped %d prompts longer than data.max_prompt_length=%d", skipped, max_prompt_length)
    if not prompts:
        raise DatasetError(f"{field}: no usable prompts in {files}")
    return prompts


class PromptStream:
    """Endless prompt order: shuffled epochs, seeded so each worker draws a different order."""

    def __init__(self, prompts: list[Prompt], shuffle: bool, seed: int):
        self.prompts = prompts
        self.shuffle = shuffle
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.epoch = 0

    def take(self, k: int) -> list[Prompt]:
        out: list[Prompt] = []
        while len(out) < k:
            if not self.order:
                self.order = list(range(len(self.prompts)))
                if self.shuffle:
                    self.rng.shuffle(self.order)
                self.epoch += 1
            out.append(self.prompts[self.order.pop()])
        return out
