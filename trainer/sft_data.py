"""SFT data: parquet rows to token sequences with a loss mask, and packed micro-batches.

A row is a prompt/response pair (`data.prompt_key`, `data.response_key`), tokenised as verl's SFT
dataset does: the prompt through the chat template with the generation prompt, the response
followed by eos; or, with `data.multiturn.enable`, a list of chat messages whose assistant turns
carry the loss. Every rank loads the same rows (the order of a step's samples depends only on
the seed and the step, never on the number of ranks). A bad row stops the run at start with
the file, column and row named.

Micro-batches are packed: a rank's sequences are concatenated into one row with position ids
restarting at 0 per sequence and no attention mask; transformers then builds a block-diagonal
causal mask (sdpa, eager, flex) or runs varlen flash attention, so no token is padding.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from trainer.sft_config import SFTDataConfig

log = logging.getLogger(__name__)


class SFTDataError(ValueError):
    """A data file or row is unusable; the message names the file, column and row."""


@dataclasses.dataclass
class Sequences:
    """Tokenised samples. `ids[i]` (int64, length n_i) and `target[i]` (bool, n_i): token t of
    sample i is predicted by the loss (a response token); `target[i][0]` is always False."""

    ids: list[np.ndarray]
    target: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> list[int]:
        return [len(x) for x in self.ids]

    def loss_tokens(self, indices) -> int:
        return int(sum(self.target[i].sum() for i in indices))


@dataclasses.dataclass
class Packed:
    """One packed micro-batch: T tokens of several sequences in one row, K loss positions."""

    input_ids: torch.Tensor  # (1, T) long
    position_ids: torch.Tensor  # (1, T) long, restarting at 0 at each sequence
    logit_index: torch.Tensor  # (K,) long: positions whose logits predict a target token
    targets: torch.Tensor  # (K,) long: the tokens they predict

    def to(self, device) -> Packed:
        return Packed(*(t.to(device) for t in dataclasses.astuple(self)))


# --- loading -------------------------------------------------------------------------------
def _read_rows(file: str, setting: str) -> list[dict]:
    import pyarrow.parquet as pq

    if not Path(file).exists():
        raise SFTDataError(f"{setting}: {file} does not exist")
    try:
        table = pq.read_table(file)
    except Exception as e:  # pyarrow raises several types for a non-parquet file
        raise SFTDataError(f"{setting}: {file} is not a readable parquet file: {e}") from None
    if table.num_rows == 0:
        raise SFTDataError(f"{setting}: {file} has no rows (an empty file)")
    return table.to_pylist()


def _column(
    rows: list[dict], file: str, key: str, setting: str, dict_keys: Sequence[str] = (), dict_setting: str = ""
) -> list:
    if key not in rows[0]:
        raise SFTDataError(
            f"{file}: no column {key!r} ({setting}; row 0 and every other row lack "
            f"it); the file has columns {sorted(rows[0])}"
        )
    values = []
    for i, row in enumerate(rows):
        value = row[key]
        for k in dict_keys:
            if not isinstance(value, dict) or k not in value:
                raise SFTDataError(f"{file} row {i}: column {key!r} has no key {k!r} ({dict_setting})")
            value = value[k]
        values.append(value)
    return values


def _as_messages(value, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if (
        isinstance(value, (list, tuple))
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise SFTDataError(
        f"{where}: expected a string or a list of {{role, content}} messages, "
        f"got {type(value).__name__} {str(value)[:80]!r}"
    )


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def _pair_sequences(rows, file, tokenizer, cfg: SFTDataConfig) -> tuple[list, list, list[str]]:
    prompts = _column(rows, file, cfg.prompt_key, "data.prompt_key", cfg.prompt_dict_keys, "data.prompt_dict_keys")
    responses = _column(
        rows, file, cfg.response_key, "data.response_key", cfg.response_dict_keys, "data.response_dict_keys"
    )
    eos = tokenizer.eos_token
    if eos is None:
        raise SFTDataError(f"{file}: the tokenizer has no eos token to end responses with")
    prompt_text, response_text = [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        messages = _as_messages(p, f"{file} row {i}: column {cfg.prompt_key!r}")
        if not isinstance(r, str):
            raise SFTDataError(
                f"{file} row {i}: column {cfg.response_key!r} must be a string, got {type(r).__name__} {str(r)[:80]!r}"
            )
        prompt_text.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        response_text.append(r + eos)
    ids, target = [], []
    for p, r in zip(_encode(tokenizer, prompt_text), _encode(tokenizer, response_text)):
        ids.append(p + r)
        target.append([False] * len(p) + [True] * len(r))
    return ids, target, [f"columns {cfg.prompt_key!r} + {cfg.response_key!r}"] * len(ids)


def _multiturn_sequences(rows, file, tokenizer, cfg: SFTDataConfig) -> tuple[list, list, list[str]]:
    """Each message's tokens are the growth of the chat template over the conversation so far;
    the assistant messages' tokens are targets."""
    key = cfg.multiturn.messages_key
    conversations = _column(rows, file, key, "data.multiturn.messages_key")
    ids, target = [], []
    for i, value in enumerate(conversations):
        where = f"{file} row {i}: column {key!r}"
        messages = _as_messages(value, where)
        seq: list[int] = []
        mask: list[int] = []
        for k, m in enumerate(messages):
            text = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
            now = _encode(tokenizer, [text])[0]
            if now[: len(seq)] != seq:
                raise SFTDataError(
                    f"{where}: the chat template renders message {k} so that the "
                    "conversation before it changes; its assistant turns cannot "
                    "be masked by prefix"
                )
            mask += [m["role"] == "assistant"] * (len(now) - len(seq))
            seq = now
        if not any(mask):
            raise SFTDataError(f"{where}: no assistant message to train on")
        ids.append(seq)
        target.append(mask)
    return ids, target, [f"column {key!r}"] * len(ids)


def load_sequences(files: list[str], tokenizer, cfg: SFTDataConfig, setting: str = "data.train_files") -> Sequences:
    """Read, tokenise, truncate. Raises SFTDataError naming the file, column and row."""
    if not files:
        raise SFTDataError(f"{setting}: no files given")
    out = Sequences([], [])
    dropped = 0
    for file in files:
        rows = _read_rows(file, setting)
        build = _multiturn_sequences if cfg.multiturn.enable else _pair_sequences
        ids, target, columns = build(rows, file, tokenizer, cfg)
        for i, (seq, mask, column) in enumerate(zip(ids, target, columns)):
            if len(seq) > cfg.max_length:
                if cfg.truncation == "error":
                    raise SFTDataError(
                        f"{file} row {i}: {len(seq)} tokens ({column}, "
                        f"{len(seq) - sum(mask)} prompt + {sum(mask)} response) exceed "
                        f"data.max_length={cfg.max_length} with data.truncation=error "
                        "(raise max_length, or set truncation to left or right)"
                    )
                keep = slice(-cfg.max_length, None) if cfg.truncation == "left" else slice(cfg.max_length)
                seq, mask = seq[keep], mask[keep]
            mask = np.asarray(mask, dtype=bool)
            mask[0] = False  # nothing predicts the first token
            if not mask.any():
                dropped += 1
                continue
            out.ids.append(np.asarray(seq, dtype=np.int64))
            out.target.append(mask)
    if dropped:
        log.warning(
            "%s: %d rows have no response token left after data.truncation=%s; skipped",
            setting,
            dropped,
            cfg.truncation,
        )
    if not out.ids:
        raise SFTDataError(f"{setting}: no usable rows in {files}")
    return out


# --- batching ------------------------------------------------------------------------------
def split_by_tokens(lengths: list[int], indices: list[int], parts: int) -> list[list[int]]:
    """Balance sequences over `parts` ranks by tokens: longest first, each to the least loaded
    rank (ties: lowest rank). Deterministic, so every rank computes the same split."""
    load = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        r = load.index(min(load))
        out[r].append(i)
        load[r] += lengths[i]
    return out


def micro_batches(
    lengths: list[int], indices: list[int], token_budget: int | None, max_seqs: int | None
) -> list[list[int]]:
    """Group sequences into packed micro-batches: by token budget (first fit, longest first; a
    sequence longer than the budget goes alone) or `max_seqs` at a time."""
    if token_budget is None:
        return [indices[k : k + max_seqs] for k in range(0, len(indices), max_seqs)]
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        b = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
        if b is None:
            bins.append([])
            room.append(token_budget)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


def pack(seqs: Sequences, indices: list[int]) -> Packed:
    """Concatenate sequences into one row. Logits at position p predict token p + 1 of the same
    sequence, so a sequence's target token j is predicted from position start + j - 1."""
    ids = np.concatenate([seqs.ids[i] for i in indices])
    positions: list = []
    logit_index: list = []
    targets: list = []
    start = 0
    for i in indices:
        n = len(seqs.ids[i])
        positions.append(np.arange(n))
        j = np.nonzero(seqs.target[i])[0]  # >= 1: target[0] is always False
        logit_index.append(start + j - 1)
        targets.append(seqs.ids[i][j])
        start += n
    return Packed(
        torch.from_numpy(ids).unsqueeze(0),
        torch.from_numpy(np.concatenate(positions)).unsqueeze(0),
        torch.from_numpy(np.concatenate(logit_index)),
        torch.from_numpy(np.concatenate(targets)),
    )
