"""Configuration of the trainer (`python -m trainer.main`). Names follow verl's."""

from __future__ import annotations

import dataclasses

from buffer.config import BufferConfig
from protocol.config import ConfigError, F
from protocol.sections import DataConfig, LoraFields, ModelConfig


def device_problem(pref: str) -> str | None:
    """Why trainer.device=`pref` cannot be used on this machine, if it cannot (verl's configs
    say cuda; on a CPU machine that would end in a CUDA traceback)."""
    if pref != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return (
            "trainer.device=cuda: no CUDA GPU is visible here (torch.cuda.is_available() is "
            "false); use trainer.device=auto or cpu"
        )
    return None


def check_betas(betas: list[float], setting: str) -> None:
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ConfigError(f"{setting}: two values in [0, 1), got {betas}")


@dataclasses.dataclass
class OptimConfig:
    lr: float = F(1e-6, "AdamW learning rate", gt=0)
    weight_decay: float = F(0.01, "AdamW weight decay", ge=0)
    betas: list[float] = F(doc="AdamW betas", factory=lambda: [0.9, 0.999])
    lr_warmup_steps_ratio: float = F(0.0, "fraction of total steps with linear warmup", ge=0, le=1)
    warmup_style: str = F("constant", "after warmup: 'constant' or 'cosine' decay", choices=("constant", "cosine"))
    min_lr_ratio: float = F(0.0, "cosine floor as a fraction of lr", ge=0, le=1)

    def check(self) -> None:
        check_betas(self.betas, "optim.betas")


LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclasses.dataclass
class ActorConfig:
    optim: OptimConfig = F(factory=OptimConfig)
    ppo_mini_batch_size: int | None = F(
        None,
        "prompt groups per optimizer step, counted in "
        "prompts as in verl (each brings rollout.n samples); "
        "data.train_batch_size must be a multiple. None: "
        "data.train_batch_size (one optimizer step per epoch)",
        ge=1,
    )
    ppo_epochs: int = F(1, "passes over each trainer step's batch", ge=1)
    shuffle: bool = F(False, "reshuffle each rank's samples into mini-batches at every epoch")
    clip_ratio: float = F(0.2, "PPO clip epsilon (both sides unless clip_ratio_low/high are set)", gt=0, le=1)
    clip_ratio_low: float | None = F(None, "ratio clipped below at 1 - clip_ratio_low (None: clip_ratio)", gt=0, le=1)
    clip_ratio_high: float | None = F(None, "ratio clipped above at 1 + clip_ratio_high (None: clip_ratio)", gt=0)
    clip_ratio_c: float = F(
        3.0, "dual-clip PPO: for negative advantages the loss is capped at clip_ratio_c * |A| (Ye et al. 2020)", gt=1
    )
    loss_agg_mode: str = F("token-mean", "verl loss aggregation", choices=LOSS_AGG_MODES)
    ppo_micro_batch_size_per_gpu: int = F(32, "samples per forward/backward on each rank", ge=1)
    use_dynamic_bsz: bool = F(False, "micro-batches by token budget instead of sample count")
    ppo_max_token_len_per_gpu: int = F(
        16384,
        "with use_dynamic_bsz: tokens (prompt+response) per micro-batch on each rank: real tokens when "
        "packed (actor_rollout_ref.model.use_remove_padding), rows x longest row when padded",
        ge=1,
    )
    use_kl_loss: bool = F(False, "add a KL loss against the frozen initial model (reference)")
    kl_loss_coef: float = F(0.001, "weight of the KL loss", ge=0)
    kl_loss_type: str = F(
        "low_var_kl", "verl kl_penalty type", choices=("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
    )
    entropy_coeff: float = F(0.0, "weight of the entropy bonus (subtracted from the loss)", ge=0)
    grad_clip: float = F(1.0, "max global gradient norm", gt=0)
    old_log_prob_from_update: bool = F(
        True,
        "tandem: when a step's update is one mini-batch and one epoch (and no dropout, no KL in the "
        "reward), take pi_old from the update's own forward, detached, instead of a separate pass: "
        "every forward then runs at the starting weights, so the values are the same; one forward "
        "less per step (20-24% of an H200 step, benchmarks/README.md). false: always a separate pass",
    )


@dataclasses.dataclass
class ActorRefConfig:
    model: ModelConfig = F(factory=ModelConfig)
    actor: ActorConfig = F(factory=ActorConfig)


@dataclasses.dataclass
class KLControlConfig:
    type: str = F(
        "fixed",
        "coefficient of the KL penalty in the reward: 'fixed' or 'adaptive' "
        "(Ziegler et al. 2019: moves kl_coef towards target_kl over horizon samples)",
        choices=("fixed", "adaptive"),
    )
    kl_coef: float = F(0.001, "(initial) coefficient of the KL penalty in the reward", ge=0)
    horizon: int = F(10000, "adaptive: samples over which the coefficient adapts", gt=0)
    target_kl: float = F(0.1, "adaptive: KL per token the coefficient steers to", gt=0)


ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gae")


@dataclasses.dataclass
class AlgorithmConfig:
    adv_estimator: str = F(
        "grpo", "advantage estimator from verl's registry (gae trains a critic, see critic.*)", choices=ADV_ESTIMATORS
    )
    norm_adv_by_std_in_grpo: bool = F(True, "divide by the group std (False: Dr.GRPO)")
    gamma: float = F(1.0, "discount per token (gae, reinforce_plus_plus)", ge=0, le=1)
    lam: float = F(1.0, "GAE lambda", ge=0, le=1)
    use_kl_in_reward: bool = F(
        False,
        "subtract kl_ctrl's coefficient x KL(pi_old || reference) "
        "from each token's reward (builds the reference model)",
    )
    kl_penalty: str = F(
        "kl", "KL estimator of the in-reward penalty", choices=("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
    )
    kl_ctrl: KLControlConfig = F(factory=KLControlConfig)
    rollout_is_threshold: float = F(
        2.0, "cap C of the truncated importance weight min(pi_old/mu, C) that corrects for stale samples", gt=0
    )


@dataclasses.dataclass
class TrainerSection:
    total_training_steps: int = F(
        100,
        "trainer steps to run (each: data.train_batch_size groups, one optimizer step per mini-batch and epoch)",
        ge=1,
    )
    publish_freq: int = F(1, "publish a weight version every this many steps", ge=1)
    compile_layers: bool = F(
        False,
        "tandem: torch.compile each decoder layer of the actor, reference and critic (dynamic shapes, "
        "before sharding) and the logprob blocks' log-softmax over the vocabulary, to fuse the "
        "element-wise work (RMSNorm, rotary, SwiGLU, casts, softmax: ~45% of a 1.5B step's GPU time, "
        "benchmarks/README.md); the first steps pay the compile",
    )
    checkpoint_every: int = F(
        1,
        "tandem: with enable_gradient_checkpointing (actor, critic), only every k-th decoder layer "
        "recomputes its forward in backward and the others keep their activations: k = 2 halves "
        "the recomputed forward (a quarter of a checkpointed step's matrix work: 2N of 8N FLOPs "
        "per token) for about half the activation memory back (torchtitan's per-layer selective "
        "checkpointing). 1: every layer",
        ge=1,
        le=1000,
    )
    keep_versions: int = F(3, "weight versions kept on disk (plus the versions a kept delta is built on)", ge=1)
    publish_full_freq: int = F(
        1,
        "publish every this many weight versions full (a snapshot) and the ones between as exact "
        "deltas against the version before (the changed values only, checked by the sha256 of "
        "the rebuilt files; buffer/weights/delta.py); a reader that lost a delta's base gets a "
        "snapshot on demand. 1: every version full (no deltas)",
        ge=1,
        le=1000,
    )
    publish_dtype: str = F(
        "auto",
        "dtype of published weights: auto (bfloat16 on GPU, float32 on CPU), float32 or bfloat16",
        choices=("auto", "float32", "bfloat16"),
    )
    max_staleness: int = F(
        4,
        "drop samples generated by weights more than this many versions "
        "older than the trainer's newest published version. 0: synchronous "
        "rollouts, the on-policy baseline: workers sample each batch with the "
        "newest version only, exactly the groups the trainer takes with it "
        "(claimed among the workers), then wait for the next version",
        ge=0,
    )
    max_nonfinite_steps: int = F(
        3,
        "stop after this many steps in a row were skipped for a "
        "non-finite loss or gradient (each one is skipped, counted in "
        "actor/skipped_steps, and logged)",
        ge=1,
    )
    data_timeout_s: float = F(900.0, "seconds to wait for a batch of experience before failing", gt=0)
    test_freq: int = F(
        -1,
        "validate the weights every this many steps and at the last step: "
        "the trainer publishes such a version, keeps it until "
        "`python -m rollout.validate` has evaluated it on data.val_files, and logs "
        "val-core/<data_source>/reward/mean@1 when the result arrives, without "
        "waiting for it (0 or -1: no validation)",
        ge=-1,
    )
    val_before_train: bool = F(
        True, "with test_freq > 0: also validate the initial weights (on resume: the restored ones)"
    )
    val_timeout_s: float = F(
        600.0,
        "after the last step, seconds to wait for validation results still pending before finishing without them",
        ge=0,
    )
    save_freq: int = F(
        10,
        "save a checkpoint every this many steps (0 or -1: never; a run "
        "killed before its first checkpoint starts again from step 0)",
        ge=-1,
    )
    resume_mode: str = F(
        "auto",
        "'auto': resume from the newest complete checkpoint in the run "
        "folder if there is one; 'disable': never; or a checkpoint folder path",
    )
    max_ckpt_to_keep: int = F(2, "checkpoints kept on disk", ge=1)
    seed: int = F(0, "torch seed")
    critic_warmup: int = F(
        0, "the actor is updated from this step on (counted from 1, as verl); before it only the critic trains", ge=0
    )
    log_sample_ids: bool = F(
        False,
        "add the ids of the samples each step trained on to its "
        "metrics line (for audits of exactly-once consumption; verbose)",
    )
    logger: list[str] = F(
        doc="metrics backends as in verl: console, tensorboard, wandb, swanlab, "
        "mlflow (metrics.jsonl is always written)",
        factory=lambda: ["console"],
    )
    project_name: str = F("tandem", "project name for the tracking backends")
    experiment_name: str = F("run", "experiment name for the tracking backends")
    device: str = F("auto", "auto|cpu|cuda", choices=("auto", "cpu", "cuda"))


@dataclasses.dataclass
class CriticOptimConfig(OptimConfig):
    lr: float = F(1e-5, "AdamW learning rate of the critic", gt=0)


@dataclasses.dataclass
class CriticModelConfig(LoraFields):
    """`critic.model.*`; with lora_rank > 0 the value head (`score`) trains in full beside the
    adapters: it is new, randomly initialised, and has no frozen weights to adapt."""

    path: str | None = F(
        None, "HF model folder the value model starts from (a value head is added); None: actor_rollout_ref.model.path"
    )
    enable_gradient_checkpointing: bool = F(False, "recompute activations in backward")
    use_remove_padding: bool | None = F(None, "pack micro-batches (None: actor_rollout_ref.model.use_remove_padding)")

    def check(self) -> None:
        self.check_lora("critic.model")


@dataclasses.dataclass
class CriticConfig:
    """The value model for GAE. Fields left None take the actor's value, as verl interpolates."""

    enable: bool | None = F(None, "train a critic; None: exactly when algorithm.adv_estimator=gae")
    model: CriticModelConfig = F(factory=CriticModelConfig)
    optim: CriticOptimConfig = F(factory=CriticOptimConfig)
    ppo_mini_batch_size: int | None = F(None, "prompt groups per critic optimizer step (None: the actor's)", ge=1)
    ppo_epochs: int | None = F(None, "critic passes per batch (None: the actor's)", ge=1)
    shuffle: bool | None = F(None, "reshuffle per epoch (None: the actor's)")
    ppo_micro_batch_size_per_gpu: int | None = F(
        None, "samples per forward/backward on each rank (None: the actor's)", ge=1
    )
    use_dynamic_bsz: bool | None = F(None, "micro-batches by token budget (None: the actor's)")
    ppo_max_token_len_per_gpu: int = F(32768, "with use_dynamic_bsz: tokens per micro-batch", ge=1)
    cliprange_value: float = F(0.5, "new values are clipped to old value +- this", gt=0)
    loss_agg_mode: str | None = F(None, "aggregation of the value loss (None: the actor's)", choices=LOSS_AGG_MODES)
    grad_clip: float = F(1.0, "max global gradient norm of the critic", gt=0)


@dataclasses.dataclass
class TrainerConfig:
    root: str = F(doc="run folder shared with the rollout workers")
    data: DataConfig = F(factory=DataConfig)
    actor_rollout_ref: ActorRefConfig = F(factory=ActorRefConfig)
    algorithm: AlgorithmConfig = F(factory=AlgorithmConfig)
    trainer: TrainerSection = F(factory=TrainerSection)
    buffer: BufferConfig = F(factory=BufferConfig)
    critic: CriticConfig = F(factory=CriticConfig)
    REQUIRED = ("actor_rollout_ref.model.path",)  # shared sections' keys this role must be given

    def check(self) -> None:
        """Cross-section rules, and the critic's None fields taken from the actor (verl's
        `${oc.select:actor_rollout_ref.actor.X}` defaults)."""
        actor, critic = self.actor_rollout_ref.actor, self.critic
        if actor.ppo_mini_batch_size is None:
            actor.ppo_mini_batch_size = self.data.train_batch_size
        for name in (
            "ppo_mini_batch_size",
            "ppo_epochs",
            "shuffle",
            "ppo_micro_batch_size_per_gpu",
            "use_dynamic_bsz",
            "loss_agg_mode",
        ):
            if getattr(critic, name) is None:
                setattr(critic, name, getattr(actor, name))
        if critic.model.use_remove_padding is None:
            critic.model.use_remove_padding = self.actor_rollout_ref.model.use_remove_padding
        if critic.model.path is None:
            critic.model.path = self.actor_rollout_ref.model.path
        for key, mini in (
            ("actor_rollout_ref.actor", actor.ppo_mini_batch_size),
            ("critic", critic.ppo_mini_batch_size),
        ):
            if self.data.train_batch_size % mini:
                raise ConfigError(
                    f"{key}.ppo_mini_batch_size={mini} must divide "
                    f"data.train_batch_size={self.data.train_batch_size} (both "
                    "count prompt groups)"
                )
        if self.algorithm.adv_estimator == "gae" and critic.enable is False:
            raise ConfigError("algorithm.adv_estimator=gae needs the critic; critic.enable=false")

    @property
    def use_critic(self) -> bool:
        """verl's rule: critic.enable if set, else exactly for GAE."""
        return self.critic.enable if self.critic.enable is not None else self.algorithm.adv_estimator == "gae"
