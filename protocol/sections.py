"""Config sections that several roles read from the one run config (verl's YAML shape, see
protocol/verl_keys.py): each is defined once, here, and every role's schema uses it. What one role
requires of a shared section is that role's rule (its config's `check()` or `REQUIRED`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from protocol.config import ConfigError, F


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


ALL_LINEAR = "all-linear"


@dataclasses.dataclass
class LoraFields:
    """verl's FSDP LoRA keys of a model section (`actor_rollout_ref.model.*`, `critic.model.*`,
    SFT's `model.*`): adapters on the frozen base (trainer/lora.py). `lora_dropout` is tandem's
    name (verl's FSDP configs have none; PEFT's LoraConfig.lora_dropout)."""

    lora_rank: int = F(
        0,
        "LoRA rank: > 0 trains low-rank adapters on the frozen base instead of all weights (the "
        "optimizer holds the adapters only; the base, adapter disabled, is the KL reference); "
        "0: full fine-tuning",
        ge=0,
        le=4096,
    )
    lora_alpha: float = F(16, "LoRA alpha: the adapter's update is scaled by lora_alpha / lora_rank", gt=0)
    target_modules: Any = F(
        ALL_LINEAR,
        "modules that get adapters: 'all-linear' (every linear layer but the output head) or a list of "
        "module names as PEFT matches them, e.g. [q_proj,k_proj,v_proj,o_proj]",
    )
    exclude_modules: Any = F(None, "module names left without adapters (a list; None: none), as PEFT matches them")
    lora_dropout: float = F(
        0.0, "dropout on the adapter's input during updates (never in pi_old/reference passes)", ge=0, le=0.9
    )

    def check_lora(self, section: str) -> None:
        """target_modules/exclude_modules normalised to 'all-linear' or a list of names; errors
        name `section`.field."""
        self.target_modules = module_names(self.target_modules, f"{section}.target_modules", allow_all=True)
        if self.exclude_modules is not None:
            self.exclude_modules = module_names(self.exclude_modules, f"{section}.exclude_modules", allow_all=False)
        if self.lora_rank and isinstance(self.target_modules, list) and "lm_head" in self.target_modules:
            raise ConfigError(
                f"{section}.target_modules: lm_head cannot get an adapter (the logprobs are computed from "
                "the head's weight directly); 'all-linear' leaves it out"
            )


def module_names(value, setting: str, allow_all: bool):
    """'all-linear' (when allowed) or a non-empty list of module names, from a YAML list, a
    command-line '[a,b]' or a comma-separated string."""
    if isinstance(value, str):
        text = value.strip()
        if allow_all and text == ALL_LINEAR:
            return ALL_LINEAR
        value = [v.strip().strip("'\"") for v in text.strip("[]").split(",") if v.strip()]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return list(value)
    wanted = f"'{ALL_LINEAR}' or a list of module names" if allow_all else "a list of module names"
    raise ConfigError(f"{setting}: {value!r}, expected {wanted}")


@dataclasses.dataclass
class ModelConfig(LoraFields):
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

    def check(self) -> None:
        self.check_lora("actor_rollout_ref.model")
