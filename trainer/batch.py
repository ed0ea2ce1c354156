"""Turn experience samples into padded tensors for the actor.

Sequences are prompt + response, right-padded to the longest in the batch. Response-aligned
tensors have shape (B, R) with R the longest response; position j of row i is the j-th response
token, predicted by the logits at absolute position len(prompt_i) - 1 + j.
"""

from __future__ import annotations

import dataclasses

import torch

from protocol.experience import Sample


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
        """The rows at indices `rows` (1-D long)."""
        picked = rows.tolist()
        return Batch(
            **{
                f.name: (v[rows.to(v.device)] if isinstance(v, torch.Tensor) else [v[i] for i in picked])
                for f in dataclasses.fields(self)
                for v in [getattr(self, f.name)]
            }
        )

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
        return self.input_ids.shape[0]


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
