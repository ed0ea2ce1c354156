"""Turn experience samples into padded tensors for the actor, and micro-batches into packed rows.

Sequences are prompt + response, right-padded to the longest in the batch. Response-aligned
tensors have shape (B, R) with R the longest response; position j of row i is the j-th response
token, predicted by the logits at absolute position len(prompt_i) - 1 + j.

`Batch.packed()` (use_remove_padding) concatenates a micro-batch's rows into one row of N tokens,
position ids restarting at 0 per row and no attention mask, so transformers keeps the rows apart
(varlen flash attention, or a block-diagonal mask for sdpa/eager/flex) and no token is padding.
Response-aligned tensors keep their (b, R) shape; `logit_index` then points into the N tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from protocol.experience import Sample

PACKED_ONLY = frozenset({"position_ids", "cu_seqlens", "max_seqlen"})


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long
    logit_index: torch.Tensor  # (B, R) long: position whose logits predict response token j
    response_ids: torch.Tensor  # (B, R) long
    response_mask: torch.Tensor  # (B, R) float
    behaviour_logprobs: torch.Tensor  # (B, R) float
    token_level_rewards: torch.Tensor  # (B, R) float, the reward on the last response token
    temperature: torch.Tensor  # (B,) float
    group_ids: list[str]
    position_ids: torch.Tensor | None = None  # (1, N) long when packed, else None
    # Packed only: the rows' boundaries in the N tokens, (b + 1,) int32 starting at 0, and the
    # longest row. Computed once per micro-batch here (the lengths are on the host already) and
    # handed to the attention kernel of every layer, which otherwise derives them from the
    # position ids itself: a host sync per layer, and a graph break in a compiled layer.
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0

    @property
    def is_packed(self) -> bool:
        return self.position_ids is not None

    def logit_rows(self) -> torch.Tensor:
        """(b, R): the row of the model's output that holds each response position's logits."""
        if self.is_packed:
            return torch.zeros_like(self.logit_index)
        return torch.arange(len(self), device=self.logit_index.device).unsqueeze(1).expand_as(self.logit_index)

    def packed(self) -> Batch:
        """This micro-batch's rows as one packed row (after `select(...).trimmed()`): row i's
        tokens start at offset_i, so its logit positions shift by offset_i."""
        lengths = self.attention_mask.sum(1)
        keep = self.attention_mask.bool()
        offsets = torch.cumsum(lengths, 0) - lengths
        host = lengths.tolist()
        positions = torch.cat([torch.arange(n, device=lengths.device) for n in host])
        cu = torch.tensor([0, *itertools.accumulate(host)], dtype=torch.int32, device=lengths.device)
        return dataclasses.replace(
            self,
            input_ids=self.input_ids[keep].unsqueeze(0),
            attention_mask=torch.ones((1, sum(host)), dtype=torch.long, device=lengths.device),
            position_ids=positions.unsqueeze(0),
            cu_seqlens=cu,
            max_seqlen=max(host),
            logit_index=(self.logit_index + offsets.unsqueeze(1)) * self.response_mask.long(),
        )

    def to(self, device) -> Batch:
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def select(self, rows: torch.Tensor) -> Batch:
        """The rows at indices `rows` (1-D long), of a padded batch."""
        assert not self.is_packed, "select rows before packing"
        picked = rows.tolist()
        fields: dict[str, Any] = {
            f.name: (v[rows.to(v.device)] if isinstance(v, torch.Tensor) else [v[i] for i in picked])
            for f in dataclasses.fields(self)
            if f.name not in PACKED_ONLY
            for v in [getattr(self, f.name)]
        }
        return Batch(**fields)

    def trimmed(self) -> Batch:
        """The same rows without the columns that are padding for every row (after `select`)."""
        t = int(self.attention_mask.sum(1).max())
        r = int(self.response_mask.sum(1).max())
        return dataclasses.replace(
            self,
            input_ids=self.input_ids[:, :t],
            attention_mask=self.attention_mask[:, :t],
            logit_index=self.logit_index[:, :r],
            response_ids=self.response_ids[:, :r],
            response_mask=self.response_mask[:, :r],
            behaviour_logprobs=self.behaviour_logprobs[:, :r],
            token_level_rewards=self.token_level_rewards[:, :r],
        )

    def __len__(self) -> int:
        """Rows (sequences), packed or not."""
        return self.response_ids.shape[0]


def collate(samples: list[Sample], pad_id: int = 0) -> Batch:
    B = len(samples)
    T = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    R = max(len(s.response_ids) for s in samples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    logit_index = torch.zeros((B, R), dtype=torch.long)
    response_ids = torch.full((B, R), pad_id, dtype=torch.long)
    response_mask = torch.zeros((B, R))
    behaviour = torch.zeros((B, R))
    rewards = torch.zeros((B, R))
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention_mask[i, : p + r] = 1
        logit_index[i, :r] = torch.arange(p - 1, p - 1 + r)
        response_ids[i, :r] = torch.tensor(s.response_ids)
        response_mask[i, :r] = 1.0
        behaviour[i, :r] = torch.tensor(s.behaviour_logprobs)
        rewards[i, r - 1] = s.reward
    return Batch(
        input_ids,
        attention_mask,
        logit_index,
        response_ids,
        response_mask,
        behaviour,
        rewards,
        torch.tensor([s.temperature for s in samples]),
        [s.group_id for s in samples],
    )
