"""Config sections that several roles read from the one run config (verl's YAML shape, see
protocol/verl_keys.py): each is defined once, here, and every role's schema uses it. What one role
requires of a shared section is that role's rule (its config's `check()` or `REQUIRED`)."""

from __future__ import annotations

import dataclasses

from protocol.config import F


@dataclasses.dataclass
class DataConfig:
    """`data.*`: the prompts the workers sample (train_files), the validator measures
    (val_files), and how many groups one trainer step takes (train_batch_size)."""

    train_files: list[str] = F(doc="verl-format parquet files of prompts (data.train_files)", factory=list)
    prompt_key: str = F("prompt", "column holding the chat messages [{role, content}]")
    max_prompt_length: int = F(512, "tokens; longer prompts are skipped (counted in the log)", ge=1)
    max_response_length: int = F(512, "tokens generated at most per response", ge=1)
    shuffle: bool = F(True, "shuffle prompts each epoch (seeded per worker)")
    val_files: list[str] = F(
        doc="verl-format parquet files of held-out prompts, evaluated by `python -m rollout.validate` (data.val_files)",
        factory=list,
    )
    val_batch_size: int | None = F(
        None, "validation prompts submitted to the engine at once (default: all of them)", ge=1
    )
    train_batch_size: int = F(
        16,
        "prompt groups per trainer step (over all ranks), cut into "
        "actor_rollout_ref.actor.ppo_mini_batch_size mini-batches",
        ge=1,
    )


@dataclasses.dataclass
class ModelConfig:
    """`actor_rollout_ref.model.*`."""

    path: str = F(
        "",
        "HF model folder of the initial actor (config, weights, tokenizer); "
        "required by the trainer, informational for workers, which always start from "
        "the newest version the trainer published",
    )
    enable_gradient_checkpointing: bool = F(
        False, "trainer: recompute activations in backward (less memory, about a third more compute)"
    )
    use_remove_padding: bool = F(
        True,
        "trainer: pack each micro-batch's rows into one row (position ids restarting per row, no "
        "padding tokens; varlen flash attention or a block-diagonal mask) instead of padding them "
        "to the longest; also the critic's default (critic.model.use_remove_padding)",
    )
