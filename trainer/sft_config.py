"""Configuration of supervised fine-tuning (`torchrun -m trainer.sft`). Names follow verl's SFT
trainer (`verl.trainer.fsdp_sft_trainer`), so a verl `sft.yaml` carries over."""

from __future__ import annotations

import dataclasses

from protocol.config import ConfigError, F
from protocol.sections import LoraFields
from trainer.config import check_betas


@dataclasses.dataclass
class MultiturnConfig:
    enable: bool = F(
        False,
        "rows hold a list of chat messages (messages_key) instead of a "
        "prompt/response pair; the loss covers the assistant turns",
    )
    messages_key: str = F("messages", "column with the [{role, content}] list in multi-turn mode")


@dataclasses.dataclass
class SFTDataConfig:
    train_files: list[str] = F(doc="parquet files of training rows", factory=list)
    val_files: list[str] = F(doc="parquet files of validation rows (empty: no validation)", factory=list)
    prompt_key: str = F(
        "prompt",
        "column with the prompt: a string (sent as one user message "
        "through the chat template) or a [{role, content}] list",
    )
    response_key: str = F("response", "column with the response string (eos is appended)")
    prompt_dict_keys: list[str] = F(
        doc="keys to descend into when the prompt column holds a dict, e.g. [question] for extra_info.question",
        factory=list,
    )
    response_dict_keys: list[str] = F(doc="the same for the response column", factory=list)
    multiturn: MultiturnConfig = F(factory=MultiturnConfig)
    train_batch_size: int = F(256, "sequences per optimizer step, over all ranks", ge=1)
    micro_batch_size_per_gpu: int = F(
        4,
        "without use_dynamic_bsz: sequences per forward/backward on each rank (packed into one row, no padding)",
        ge=1,
    )
    use_dynamic_bsz: bool = F(
        True, "micro-batches by token budget (max_token_len_per_gpu) instead of by sequence count"
    )
    max_token_len_per_gpu: int = F(
        8192,
        "with use_dynamic_bsz: tokens per packed micro-batch on "
        "each rank (sequences are never split; must be >= max_length)",
        ge=1,
    )
    max_length: int = F(1024, "tokens per sequence (prompt + response) at most", ge=2)
    truncation: str = F(
        "error",
        "over-long sequences: 'error' (stop, naming the row), 'left' "
        "(keep the last max_length tokens) or 'right' (keep the first)",
        choices=("error", "left", "right"),
    )

    def check(self) -> None:
        if not self.train_files:
            raise ConfigError("data.train_files: at least one parquet file is required")
        if self.use_dynamic_bsz and self.max_token_len_per_gpu < self.max_length:
            raise ConfigError(
                f"data.max_token_len_per_gpu={self.max_token_len_per_gpu} must be at "
                f"least data.max_length={self.max_length}: a sequence is never split"
            )


@dataclasses.dataclass
class SFTModelConfig(LoraFields):
    """`model.*`; with lora_rank > 0 the HF folders SFT writes hold the merged weights (base +
    adapter: a model folder RL and the workers load as is), its checkpoints the adapter."""

    partial_pretrain: str = F(doc="HF model folder to start from (config, weights, tokenizer)")
    enable_gradient_checkpointing: bool = F(
        True, "recompute activations in backward (less memory, about a third more compute)"
    )
    trust_remote_code: bool = F(False, "allow model/tokenizer code from the model folder")
    attn_implementation: str = F(
        "auto",
        "attention kernel for packed sequences: auto "
        "(flash_attention_2 when installed on GPU, else sdpa), sdpa, "
        "flash_attention_2, flex_attention or eager",
        choices=("auto", "sdpa", "flash_attention_2", "flex_attention", "eager"),
    )

    def check(self) -> None:
        self.check_lora("model")


@dataclasses.dataclass
class SFTOptimConfig:
    lr: float = F(1e-5, "AdamW peak learning rate", gt=0)
    betas: list[float] = F(doc="AdamW betas", factory=lambda: [0.9, 0.95])
    weight_decay: float = F(0.01, "AdamW weight decay", ge=0)
    warmup_steps_ratio: float = F(0.1, "fraction of total steps with linear warmup", ge=0, le=1)
    clip_grad: float = F(1.0, "max global gradient norm", gt=0)
    lr_scheduler: str = F("cosine", "after warmup: 'cosine' decay or 'constant'", choices=("cosine", "constant"))
    min_lr_ratio: float = F(0.0, "cosine floor as a fraction of lr", ge=0, le=1)

    def check(self) -> None:
        check_betas(self.betas, "optim.betas")


@dataclasses.dataclass
class SFTTrainerSection:
    default_local_dir: str = F(
        "",
        "output folder: checkpoints/, weights/v<step>/ (HF folders), "
        "hf (the final one), metrics.jsonl; default "
        "checkpoints/<project_name>/<experiment_name>",
    )
    project_name: str = F("tandem-sft", "project name for the tracking backends")
    experiment_name: str = F("sft", "experiment name for the tracking backends")
    total_epochs: int = F(4, "passes over data.train_files", ge=1)
    total_training_steps: int | None = F(
        None,
        "stop after this many optimizer steps (default: total_epochs x steps per epoch, whichever comes first)",
        ge=1,
    )
    save_freq: int = F(
        -1, "every this many steps: a checkpoint and an HF folder (-1 or 0: only the HF folder at the end)", ge=-1
    )
    test_freq: int = F(
        -1, "validation loss every this many steps (-1 or 0: only at each epoch end and the last step)", ge=-1
    )
    max_ckpt_to_keep: int = F(2, "checkpoints and HF step folders kept on disk", ge=1)
    resume_mode: str = F(
        "auto",
        "'auto': resume from the newest complete checkpoint in "
        "default_local_dir if there is one; 'disable': never; 'resume_path': "
        "from resume_from_path; or a checkpoint folder path",
    )
    resume_from_path: str | None = F(None, "checkpoint folder for resume_mode=resume_path")
    logger: list[str] = F(
        doc="metrics backends as in verl: console, tensorboard, wandb, swanlab, "
        "mlflow (metrics.jsonl is always written)",
        factory=lambda: ["console"],
    )
    seed: int = F(1, "seed of the data order (each epoch shuffles with seed + epoch)")
    device: str = F("auto", "auto|cpu|cuda", choices=("auto", "cpu", "cuda"))
    timeout_s: float = F(1800.0, "seconds a collective may wait for the other ranks", gt=0)

    def check(self) -> None:
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ConfigError("trainer.resume_from_path: required with trainer.resume_mode=resume_path")

    @property
    def output_dir(self) -> str:
        return self.default_local_dir or f"checkpoints/{self.project_name}/{self.experiment_name}"


@dataclasses.dataclass
class SFTConfig:
    data: SFTDataConfig = F(factory=SFTDataConfig)
    model: SFTModelConfig = F(factory=SFTModelConfig)
    optim: SFTOptimConfig = F(factory=SFTOptimConfig)
    trainer: SFTTrainerSection = F(factory=SFTTrainerSection)
