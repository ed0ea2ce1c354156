"""Every key of verl's PPO/GRPO and SFT trainer configs, over its releases, classified for tandem.

The keys are those of every verl minor release (protocol/verl_releases/<release>.json, extracted
from verl's history by scripts/extract_verl_keys.py: the full PPO trainer config, the SFT trainer
config in its old and new shapes, and the overrides of the release's example scripts). One YAML
file in the shape of verl's `ppo_trainer.yaml` serves the RL roles (ROLES); an SFT file in the
shape of `sft_trainer.yaml` or `sft_trainer_engine.yaml` serves `trainer.sft`. A key in it is
  applied    a field of a role's schema, or an ALIAS: verl's spelling of one (a deprecated spelling
             says so in one line, and is converted as verl converted it);
  ignored    WARN: one line saying why it does not apply to a decoupled run; SAME: its value asks
             for what tandem always does; a key of a section the config does not use (SECTIONS:
             the critic without GAE, the reward model when it is off) is ignored whatever its value;
  refused    a rule's `need(value)` is false: honouring the value would change what is trained,
             and tandem cannot (yet); the reason is given;
  unknown    in no schema and no rule: refused, with a "did you mean".
Patterns are dotted keys: `*` is one segment, `**` one or more; a pattern also covers every key
under it. The first matching rule wins, so specific rules come before the subtrees that contain them.

    python -m protocol.verl_keys [--sft] [FILE.yaml]   # which releases a file matches, how each key is treated

(the command is protocol/verl_keys/__main__.py: it builds configs with protocol/config.py, which
imports this module)
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib
import json
import os
from collections.abc import Callable
from typing import Any

# The role schemas that share one config file; each accepts the others' keys silently.
ROLES = ("trainer.config:TrainerConfig", "rollout.config:WorkerConfig", "rollout.config:ValidatorConfig")
SFT_ROLE = "trainer.sft_config:SFTConfig"

ALIAS, WARN, SAME = "alias", "warn", "same"
APPLIED, IGNORED, REFUSED, UNKNOWN = "applied", "ignored", "refused", "unknown"


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str
    kind: str
    reason: str = ""
    need: Callable[[Any], bool] | None = None  # values tandem can honour; others are refused
    to: str = ""  # ALIAS: the tandem key it sets while that key is unset ...
    replaces: Any = None  # ... or set to this verl placeholder
    convert: Callable[[Any], Any] | None = None  # ALIAS: the value it sets, from its own
    or_equal: str = ""  # a value equal to this key's is honoured too (what tandem does anyway)

    def matches(self, key: str) -> bool:
        return _match(self.pattern.split("."), key.split("."))


def _match(pattern: list[str], key: list[str]) -> bool:
    """True when `pattern` matches `key` or a prefix of it."""
    if not pattern:
        return True
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match(rest, key[i:]) for i in range(1, len(key) + 1))
    return bool(key) and head in ("*", key[0]) and _match(rest, key[1:])


# --- what a value must be for tandem to honour it -----------------------------------------------
def unset(v) -> bool:
    return v is None or v in ("", {}, [])


def off(v) -> bool:
    return not v or (isinstance(v, str) and v.strip().lower() in ("false", "0", "none", "null"))


def one_of(*ok) -> Callable[[Any], bool]:
    return lambda v: v is None or (v.lower() if isinstance(v, str) else v) in ok


def at_most(n) -> Callable[[Any], bool]:
    return lambda v: v is None or v <= n


def warn(reason: str, *patterns: str) -> list[Rule]:
    return [Rule(p, WARN, reason) for p in patterns]


def same(reason: str, need, *patterns: str, or_equal: str = "") -> list[Rule]:
    return [Rule(p, SAME, reason, need, or_equal=or_equal) for p in patterns]


def alias(pattern: str, to: str, replaces=None) -> Rule:
    return Rule(pattern, ALIAS, f"verl's name for {to}", to=to, replaces=replaces)


def world_size() -> int:
    """The trainer's ranks (torchrun's WORLD_SIZE; 1 outside torchrun)."""
    return max(1, int(os.environ.get("WORLD_SIZE", "1")))


def per_gpu(v):
    """verl's conversion of a deprecated global micro-batch size: divided by the GPU count."""
    return None if v is None else max(1, int(v) // world_size())


def deprecated(pattern: str, to: str, how: str, convert: Callable[[Any], Any] | None = None) -> Rule:
    """A spelling verl deprecated but still honoured: it sets `to` as verl set it (`how`)."""
    return Rule(pattern, ALIAS, f"deprecated in verl, which sets {to} from it ({how})", to=to, convert=convert)


AR, ACTOR, ROLLOUT = "actor_rollout_ref", "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
LAUNCHERS = (
    "GPU and node counts are the launchers' (torchrun --nproc_per_node, launch.submit "
    "--nodes / --gpus-per-node, one worker per GPU)"
)
NO_RAY = (
    "verl's own Ray workers: tandem's roles are their own processes (on a Ray cluster, "
    "Ray jobs: launch.submit --backend ray, docs/ray.md)"
)
FSDP = (
    "FSDP layout and memory options: tandem's trainer shards each decoder layer with FSDP2 over "
    "all ranks (fp32 master weights, bf16 compute on GPU); they change memory and speed, not results"
)
KERNELS = "kernel and memory choices of verl's workers; tandem runs the HF model as is, with the same results"
VLLM_TUNING = (
    "vLLM scheduler/memory tuning that tandem's worker does not pass to the engine yet (speed and memory only)"
)
MEGATRON_LORA = (
    "verl's Megatron LoRA settings (model.lora.*); tandem's FSDP LoRA reads the FSDP keys: "
    "lora_rank, lora_alpha, target_modules, exclude_modules of the model section"
)
LORA_ADAPTER = (
    "starting from a saved LoRA adapter is not supported yet: adapters start at zero (lora_rank > 0 "
    "trains new ones); merge a saved one into the base (python -m launch.export) and give that as the model path"
)
MULTIMODAL = "multimodal inputs: tandem is text-only and does not read these columns"
PROFILER = "verl's profiler hooks; profile a tandem process with torch.profiler or nsys around it"

RULES: list[Rule] = [
    *warn("verl's instantiation hint; tandem's schemas are its dataclasses", "**._target_"),
    *warn("Hydra composition: keys this file does not set take tandem's defaults", "defaults"),
    *warn("Hydra's own settings; tandem reads the file with OmegaConf", "hydra"),
    *warn(
        PROFILER,
        "**.profiler",
        "global_profiler",
        "trainer.npu_profile",
        "trainer.profile_steps",
        "trainer.controller_nsight_options",
        "trainer.worker_nsight_options",
    ),
    *same("tandem's trainer is FSDP2 (megatron is not supported)", unset, "**.megatron"),
    # verl's critic keys that tandem's critic has no use for
    *warn(
        "tandem's critic computes values inside its training micro-batches "
        "(critic.ppo_max_token_len_per_gpu / ppo_micro_batch_size_per_gpu)",
        "critic.forward_max_token_len_per_gpu",
        "critic.forward_micro_batch_size_per_gpu",
    ),
    # verl's spellings of tandem keys
    alias(f"{ACTOR}.optim.clip_grad", f"{ACTOR}.grad_clip"),
    alias(f"{ACTOR}.optim.lr_scheduler_type", f"{ACTOR}.optim.warmup_style"),
    alias("critic.optim.lr_scheduler_type", "critic.optim.warmup_style"),
    alias("critic.optim.clip_grad", "critic.grad_clip"),
    alias("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_is_threshold"),
    alias(f"{ROLLOUT}.prompt_length", "data.max_prompt_length"),
    alias(f"{ROLLOUT}.response_length", "data.max_response_length"),
    alias("trainer.max_actor_ckpt_to_keep", "trainer.max_ckpt_to_keep"),
    # as in verl, resume_from_path counts only with resume_mode=resume_path
    alias("trainer.resume_from_path", "trainer.resume_mode", replaces="resume_path"),
    alias("reward.custom_reward_function.path", "custom_reward_function.path"),
    alias("reward.custom_reward_function.name", "custom_reward_function.name"),
    alias(f"{ACTOR}.optim.lr_decay_style", f"{ACTOR}.optim.warmup_style"),
    # deprecated spellings, mapped as verl mapped them
    deprecated(
        f"{ACTOR}.ppo_micro_batch_size",
        f"{ACTOR}.ppo_micro_batch_size_per_gpu",
        "divided by the number of GPUs",
        per_gpu,
    ),
    deprecated(
        "critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu", "divided by the number of GPUs", per_gpu
    ),
    deprecated(
        "trainer.remove_previous_ckpt_in_save",
        "trainer.max_ckpt_to_keep",
        "true keeps 1 checkpoint",
        lambda v: 1 if v is True or str(v).lower() == "true" else None,
    ),
    *warn(
        "deprecated spelling of log_prob_micro_batch_size_per_gpu (verl divides it by the number "
        "of GPUs), which does not apply: the trainer, not the rollout, computes pi_old",
        f"{ROLLOUT}.log_prob_micro_batch_size",
    ),
    *warn(
        "deprecated spelling of forward_micro_batch_size_per_gpu, which does not apply: tandem's "
        "critic computes values inside its training micro-batches",
        "critic.forward_micro_batch_size",
    ),
    *warn("deprecated and read by no verl release since 0.3", "trainer.resume_path"),
    # parallelism and model features tandem does not have
    *same("tandem's trainer is FSDP2 (megatron is not supported)", one_of("fsdp", "fsdp2"), "**.strategy"),
    *same(
        "tandem's trainer is FSDP2 (verl's dp engine; megatron is not supported)",
        one_of("dp", "fsdp", "fsdp2"),
        "model_engine",
    ),
    *same(
        "sequence parallelism (Ulysses) is not supported yet: every rank runs whole rows, packed into "
        "micro-batches of at most ppo_max_token_len_per_gpu tokens; for long rows set "
        "actor_rollout_ref.model.enable_gradient_checkpointing=true and a smaller token budget",
        one_of(1),
        "**.ulysses_sequence_parallel_size",
    ),
    # LoRA: actor_rollout_ref.model.lora_rank / lora_alpha / target_modules / exclude_modules and
    # critic.model.* are fields (protocol/sections.py LoraFields); these rules cover the rest
    *same(
        "LoRA is trained on the actor and the critic only (actor_rollout_ref.model.lora_rank, critic.model.lora_rank)",
        one_of(0),
        "**.lora_rank",
    ),
    *same(MEGATRON_LORA, one_of(0), "**.lora.rank"),
    *same(LORA_ADAPTER, unset, "**.lora_adapter_path", "**.lora.adapter_path"),
    *warn("LoRA settings of a model tandem does not train with LoRA", "**.lora_alpha", "**.target_modules"),
    *warn("LoRA settings of a model tandem does not train with LoRA", "**.exclude_modules"),
    *warn(MEGATRON_LORA, "**.lora"),
    *same("quantization-aware training is not supported yet", off, "**.qat.enable"),
    *warn("quantization-aware training settings; QAT is off", "**.qat"),
    *same(
        "multi-token prediction is not supported yet",
        off,
        "**.mtp.enable",
        "**.mtp.enable_train",
        "**.mtp.enable_rollout",
    ),
    *warn("multi-token prediction settings; MTP is off", "**.mtp"),
    *warn(FSDP, "**.fsdp_config", "critic.fsdp"),
    # actor / critic loss and optimizer
    *same(
        "other policy losses of verl's registry are not wired yet", one_of("vanilla"), f"{ACTOR}.policy_loss.loss_mode"
    ),
    *warn(
        "parameters of policy losses other than vanilla", f"{ACTOR}.policy_loss", f"{ACTOR}.tau_pos", f"{ACTOR}.tau_neg"
    ),
    *same(
        "a fixed loss scale is not supported (loss_agg_mode decides the normalisation)", unset, "**.loss_scale_factor"
    ),
    *same("tandem's optimizer is torch's AdamW", one_of("adamw"), "**.optim.optimizer"),
    *same("tandem's optimizer is torch's AdamW", one_of("torch.optim"), "**.optim.optimizer_impl"),
    *same("tandem's cosine schedule is one half cycle", one_of(0.5), "**.optim.num_cycles"),
    *same("give the warmup as lr_warmup_steps_ratio", at_most(0), "**.optim.lr_warmup_steps"),
    *same("optimizer overrides are not supported", unset, "**.optim.override_optimizer_config"),
    *warn("verl fills it in at run time from trainer.total_training_steps", "**.optim.total_training_steps"),
    *warn("a detail of verl's scheduler step count", "**.optim.zero_indexed_step"),
    *warn(
        KERNELS,
        "**.use_torch_compile",
        "**.use_fused_kernels",
        # verl's actor/ref copies of actor_rollout_ref.model.use_remove_padding (a field)
        "**.use_remove_padding",
        "**.entropy_from_logits_with_chunking",
        "**.entropy_from_logits_chunk_size",
        "**.entropy_checkpointing",
        "**.pad_to_length",
        "**.use_liger",
        "**.fused_kernel_options",
        "**.tiled_mlp",
        "**.use_prefix_grouper",
        "**.enable_activation_offload",
        f"{ACTOR}.calculate_sum_pi_squared",
        f"{ACTOR}.sum_pi_squared_checkpointing",
    ),
    *same("MoE router replay is not supported", one_of("disabled"), f"{ACTOR}.router_replay.mode"),
    *warn("MoE router replay settings; it is disabled", f"{ACTOR}.router_replay"),
    *warn("tandem computes the entropy when entropy_coeff > 0", f"{ACTOR}.calculate_entropy"),
    *warn("verl copies rollout.n here; the group size is the workers' actor_rollout_ref.rollout.n", "**.rollout_n"),
    *warn(
        MULTIMODAL,
        f"{ACTOR}.freeze_vision_tower",
        "data.image_patch_size",
        "data.image_key",
        "data.video_key",
        "data.audio_key",
        "data.return_multi_modal_inputs",
        "data.mm_processor_kwargs",
    ),
    *warn("the trainer seeds from trainer.seed", "**.data_loader_seed"),
    *warn(
        "tandem always checkpoints model, optimizer and trainer state (trainer.save_freq, trainer.resume_mode)",
        "**.checkpoint",
    ),
    *warn(
        "the reference policy is the frozen initial actor, run by the trainer with the actor's micro-batching",
        f"{AR}.ref",
    ),
    # model loading
    *same("custom model and dataset code is not loaded (trust_remote_code is off)", off, "**.trust_remote_code"),
    *same("workers use the tokenizer's own chat template", unset, "**.model.custom_chat_template"),
    *same("extra model libraries are not imported", unset, "**.model.external_lib"),
    *same("model config overrides are not applied", unset, "**.model.override_config"),
    # the tokens are the actor's: the critic scores them with the actor's tokenizer too
    *same(
        "the tokenizer is read from actor_rollout_ref.model.path",
        unset,
        "**.model.tokenizer_path",
        "data.tokenizer",
        or_equal=f"{AR}.model.path",
    ),
    *same("the config is read from model.path", unset, "**.model.hf_config_path"),
    *warn("a loading detail of verl (shared-memory model copies)", "**.use_shm"),
    *warn("tandem is decoupled: rollout workers and the trainer are always separate processes", f"{AR}.hybrid_engine"),
    *warn("trainer collectives time out after trainer.data_timeout_s + 600 s", f"{AR}.nccl_timeout"),
    # rollout
    *warn("each worker generates its batches in its own process", f"{ROLLOUT}.mode"),
    *warn(LAUNCHERS, f"{ROLLOUT}.nnodes", f"{ROLLOUT}.n_gpus_per_node", "trainer.nnodes", "trainer.n_gpus_per_node"),
    *same("top-k sampling is not supported by tandem's engines yet", one_of(-1, 0), f"{ROLLOUT}.top_k"),
    *warn(
        "each worker seeds sampling and prompt order with worker.seed mixed with its id", f"{ROLLOUT}.seed", "data.seed"
    ),
    *warn("deterministic vLLM kernels are not requested", f"{ROLLOUT}.full_determinism"),
    *same("ignore_eos is not supported", off, f"{ROLLOUT}.ignore_eos"),
    *same(
        "greedy training rollouts make every response of a group alike",
        lambda v: v is None or bool(v),
        f"{ROLLOUT}.do_sample",
    ),
    *warn(
        VLLM_TUNING,
        f"{ROLLOUT}.cudagraph_capture_sizes",
        f"{ROLLOUT}.max_num_batched_tokens",
        f"{ROLLOUT}.max_model_len",
        f"{ROLLOUT}.max_num_seqs",
        f"{ROLLOUT}.enable_chunked_prefill",
        f"{ROLLOUT}.enable_prefix_caching",
        f"{ROLLOUT}.scheduling_policy",
        f"{ROLLOUT}.disable_log_stats",
        f"{ROLLOUT}.skip_tokenizer_init",
        f"{ROLLOUT}.multi_stage_wake_up",
        f"{ROLLOUT}.layered_summon",
        f"{ROLLOUT}.moe_load_balance_metrics_interval",
    ),
    *warn(
        "workers keep their engine loaded: there is no training phase to free memory for",
        f"{ROLLOUT}.free_cache_engine",
    ),
    *warn(
        "workers load the weight versions the trainer publishes (weights/v<N>)",
        f"{ROLLOUT}.load_format",
        f"{ROLLOUT}.checkpoint_engine",
        f"{ROLLOUT}.update_weights_bucket_megabytes",
    ),
    *same("FIRE sampling is not supported", off, f"{ROLLOUT}.use_fire_sampling"),
    *same("replaying dumped rollouts is not supported: workers generate every sample", off, f"{ROLLOUT}.skip_rollout"),
    *warn("rollout replay is off", f"{ROLLOUT}.skip_dump_dir"),
    *warn("one engine per worker: start more workers for data parallelism", f"{ROLLOUT}.data_parallel_size"),
    *same(
        "expert- and pipeline-parallel engines are not supported yet",
        one_of(1),
        f"{ROLLOUT}.expert_parallel_size",
        f"{ROLLOUT}.pipeline_model_parallel_size",
    ),
    *same(
        "workers record processed (temperature-scaled) logprobs, which the importance correction needs",
        one_of("processed_logprobs"),
        f"{ROLLOUT}.logprobs_mode",
    ),
    *warn(
        "the trainer, not the rollout, computes pi_old",
        f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
        f"{ROLLOUT}.log_prob_use_dynamic_bsz",
        f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
    ),
    *warn("workers always record the behaviour logprobs", f"{ROLLOUT}.calculate_log_probs"),
    *same("over-sampling is not supported", at_most(0), f"{ROLLOUT}.over_sample_rate"),
    *warn(MULTIMODAL, f"{ROLLOUT}.engine_kwargs.*.disable_mm_preprocessor_cache"),
    *same("engine arguments are not passed to vLLM yet", unset, f"{ROLLOUT}.engine_kwargs"),
    *same("a rollout router is not supported", unset, f"{ROLLOUT}.router_config_path"),
    *same("multi-turn and tool rollouts are not supported yet", off, f"{ROLLOUT}.multi_turn.enable"),
    *warn("multi-turn settings; multi_turn is off", f"{ROLLOUT}.multi_turn"),
    *same(
        "agent loops are not supported yet (single-turn generation)",
        one_of("single_turn_agent"),
        f"{ROLLOUT}.agent.default_agent_loop",
    ),
    *same(
        "agent loops are not supported yet (single-turn generation)",
        unset,
        f"{ROLLOUT}.agent.agent_loop_config_path",
        f"{ROLLOUT}.agent.custom_async_server",
    ),
    *warn("agent-loop settings; generation is single-turn", f"{ROLLOUT}.agent"),
    *warn("rollout tracing is not wired; samples are in the experience shards", f"{ROLLOUT}.trace"),
    *same("MoE routing replay is not supported", off, f"{ROLLOUT}.enable_rollout_routing_replay"),
    *warn("workers report their metrics in workers/<id>.json", f"{ROLLOUT}.prometheus"),
    *same(
        "quantized rollouts are not supported yet",
        unset,
        f"{ROLLOUT}.quantization",
        f"{ROLLOUT}.quantization_config_file",
    ),
    *same("prefill/decode disaggregation is not supported", off, f"{ROLLOUT}.disaggregation.enabled"),
    *warn("prefill/decode disaggregation settings; it is off", f"{ROLLOUT}.disaggregation"),
    # data
    *same("a cap on the training set is not supported yet", at_most(-1), "data.train_max_samples"),
    *warn("validation reads all of data.val_files", "data.val_max_samples"),
    *same("rewards are chosen by each row's data_source", one_of("data_source"), "data.reward_fn_key"),
    *warn("workers generate actor_rollout_ref.rollout.prompts_per_batch prompts at a time", "data.gen_batch_size"),
    *same("tool calling is not supported yet", unset, "data.tool_config_path", "data.function_tool_path"),
    *warn(
        "the format of verl's dataloader output; workers tokenize the chat prompt themselves",
        "data.return_raw_input_ids",
        "data.return_raw_chat",
        "data.return_full_prompt",
        "data.dataloader_num_workers",
        "data.validation_shuffle",
    ),
    *warn(
        "workers always skip prompts longer than data.max_prompt_length (counted in their log)",
        "data.filter_overlong_prompts",
        "data.filter_overlong_prompts_workers",
        "data.truncation",
    ),
    *same("custom dataset classes are not supported yet", unset, "data.custom_cls"),
    *same("dynamic data generation is not supported yet", unset, "data.datagen.path"),
    *same(
        "custom samplers (curricula) are not supported yet: workers shuffle with worker.seed",
        unset,
        "data.sampler.class_path",
    ),
    *warn("datagen / sampler settings; they are off", "data.datagen", "data.sampler"),
    *same("chat-template arguments are not passed yet", unset, "data.apply_chat_template_kwargs"),
    # rewards
    # reward_model.enable, model.path, micro_batch_size_per_gpu, max_length and
    # forward_max_token_len_per_gpu are the worker's fields (rollout/config.py: reward servers)
    *same(
        "verl 0.9's reward.reward_model (a reward model behind a rollout engine) is not supported: "
        "set reward_model.enable and reward_model.model.path (a sequence classifier on reward servers)",
        off,
        "reward.reward_model.enable",
    ),
    *warn(
        "workers send the text the policy's tokenizer decodes; the reward servers always re-tokenise "
        "it with the reward model's own tokenizer and chat template (verl's switch of templates, always on)",
        "reward_model.model.input_tokenizer",
    ),
    deprecated(
        "reward_model.micro_batch_size",
        "reward_model.micro_batch_size_per_gpu",
        "divided by the GPU count",
        per_gpu,
    ),
    *same(
        "reward servers run the HF model on one GPU each (no Megatron)",
        one_of("fsdp", "fsdp2"),
        "reward_model.strategy",
    ),
    *same("sequence parallelism is not supported yet", one_of(1), "reward_model.ulysses_sequence_parallel_size"),
    *warn(
        "reward servers always micro-batch by rows (micro_batch_size_per_gpu) and padded tokens "
        "(forward_max_token_len_per_gpu)",
        "reward_model.use_dynamic_bsz",
    ),
    *warn(
        "workers score a batch in their own thread while the engine generates the next one",
        "reward_model.launch_reward_fn_async",
    ),
    *warn(
        "reward servers are processes of their own: launch.local --reward-model, launch.submit reward --nodes",
        "reward_model.nnodes",
        "reward_model.n_gpus_per_node",
        "reward_model.num_workers",
        "reward_model.enable_resource_pool",
    ),
    *warn(KERNELS, "reward_model.model.use_remove_padding", "reward_model.model.use_fused_kernels"),
    *warn(FSDP, "reward_model.model.fsdp_config"),
    *same(
        "generative reward models (a rollout engine) are not supported: the reward model is a sequence classifier",
        unset,
        "reward_model.rollout.name",
    ),
    *warn("rollout settings of a generative reward model; the reward model is a classifier", "reward_model.rollout"),
    *same(
        "reward loops are not supported: workers send each group to the reward servers",
        unset,
        "reward_model.reward_loop_module_path",
        "reward_model.reward_loop_class_name",
    ),
    *same("sandbox code-execution rewards are not supported yet", unset, "reward_model.sandbox_fusion.url"),
    *same(
        "tandem scores each response alone, as verl's naive reward manager",
        one_of("naive"),
        "reward_model.reward_manager",
        "reward.reward_manager.name",
    ),
    *same(
        "custom reward managers are not supported: use custom_reward_function",
        unset,
        "reward.reward_manager.module.path",
        "reward_manager.module.path",
    ),
    *same("tandem scores each response alone, as verl's naive reward manager", one_of("naive"), "reward_manager.name"),
    *warn("reward-manager settings; tandem scores as verl's naive reward manager", "reward_manager"),
    *same(
        "sandbox code-execution rewards are not supported yet", unset, "sandbox_fusion.url", "reward.sandbox_fusion.url"
    ),
    *warn(
        "reward-model and reward-loop settings; workers score with custom_reward_function or "
        "verl's default_compute_score, and with reward_model.enable on the reward servers",
        "reward_model",
        "reward",
        "sandbox_fusion",
    ),
    # algorithm
    Rule(
        "algorithm.rollout_correction.rollout_is",
        WARN,
        "tandem always applies the token-level "
        "truncated importance weight (algorithm.rollout_is_threshold) against the behaviour "
        "logprobs; sequence-level weights are not supported",
        one_of("token"),
    ),
    *same("rejection sampling of rollouts is not supported yet", unset, "algorithm.rollout_correction.rollout_rs"),
    *same(
        "tandem recomputes pi_old; bypass mode is not supported",
        off,
        "algorithm.rollout_correction.bypass_mode",
        "algorithm.rollout_correction.rollout_is_batch_normalize",
    ),
    *same("the loss is verl's clipped PPO loss", one_of("ppo_clip"), "algorithm.rollout_correction.loss_type"),
    *same(
        "token veto (rejecting samples with a tiny token ratio) is not supported yet",
        unset,
        "algorithm.rollout_correction.rollout_token_veto_threshold",
    ),
    *same(
        "tandem recomputes pi_old and trains with the clipped PPO loss",
        off,
        "algorithm.rollout_correction.use_policy_gradient",
    ),
    *warn(
        "rejection sampling is off",
        "algorithm.rollout_correction.rollout_rs_threshold",
        "algorithm.rollout_correction.rollout_rs_threshold_lower",
    ),
    *same("dynamic sampling (DAPO filter_groups) is not supported yet", off, "algorithm.filter_groups.enable"),
    *same("preference-feedback PPO is not supported yet", off, "algorithm.use_pf_ppo"),
    *warn("filter_groups / pf_ppo settings; they are off", "algorithm.filter_groups", "algorithm.pf_ppo"),
    # trainer
    *warn("tandem does not rebalance sequence lengths across ranks (speed only)", "trainer.balance_batch"),
    *warn("workers cycle through the data; the run length is trainer.total_training_steps", "trainer.total_epochs"),
    *warn("experience shards stay in the run folder (buffer.retention)", "trainer.rollout_data_dir"),
    *warn(
        "validation outputs are not dumped or logged",
        "trainer.validation_data_dir",
        "trainer.log_val_generations",
        "trainer.val_generations_to_log_to_wandb",
    ),
    *warn("verl's choice of worker implementation; tandem has its own", "trainer.use_legacy_worker_impl"),
    *warn(
        "checkpoints live in ROOT/checkpoints",
        "trainer.default_local_dir",
        "trainer.del_local_ckpt_after_load",
        "trainer.esi_redundant_time",
    ),
    *warn(
        "checkpoints are written to ROOT/checkpoints only (copy them elsewhere yourself)",
        "trainer.default_hdfs_dir",
        "trainer.checkpoint_callback_class",
    ),
    *warn("the critic is checkpointed with the actor (trainer.max_ckpt_to_keep)", "trainer.max_critic_ckpt_to_keep"),
    *same("validation-only runs are not supported yet", off, "trainer.val_only"),
    *warn(NO_RAY, "trainer.ray_wait_register_center_timeout", "ray_kwargs", "ray_init"),
    *warn(
        "verl's trainer modes; tandem is itself decoupled and asynchronous, with "
        "trainer.max_staleness bounding off-policy samples (0: synchronous)",
        "trainer.use_v1",
        "trainer.v1",
    ),
    # features of verl tandem does not have (refused when switched on)
    *same("distillation is not supported yet", off, "distillation.enabled"),
    *warn("distillation settings; it is off", "distillation"),
    *same("tandem's transport is buffer.transport", off, "transfer_queue.enable"),
    *warn("transfer-queue settings; tandem's transport is buffer.transport", "transfer_queue"),
    *warn("verl's rollout dump and replay; experience shards are kept per buffer.retention", "skip"),
]


SFT_MODEL_WARN = (
    "FSDP layout, memory and kernel options of verl's SFT trainer; tandem's SFT shards "
    "each decoder layer with FSDP2 and runs the HF model as is (memory and speed only)"
)

# verl's SFT configs: sft_trainer.yaml (fsdp_sft_trainer) and sft_trainer_engine.yaml (sft_trainer)
SFT_RULES: list[Rule] = [
    *warn("verl's instantiation hint; tandem's schemas are its dataclasses", "**._target_"),
    *warn("Hydra composition: keys this file does not set take tandem's defaults", "defaults"),
    *warn("Hydra's own settings; tandem reads the file with OmegaConf", "hydra"),
    *warn(PROFILER, "profiler", "trainer.profile_interval"),
    # the new shape's names (sft_trainer_engine.yaml) of tandem's keys
    alias("model.path", "model.partial_pretrain"),
    alias("data.messages_key", "data.multiturn.messages_key"),
    alias("optim.lr_warmup_steps_ratio", "optim.warmup_steps_ratio"),
    alias("optim.lr_scheduler_type", "optim.lr_scheduler"),
    alias("optim.warmup_style", "optim.lr_scheduler"),
    *warn("deprecated: verl's SFT trainer reads data.micro_batch_size_per_gpu only", "data.micro_batch_size"),
    *warn(
        "deprecated: verl's SFT trainer does not read it (trainer.resume_mode / resume_from_path resume)",
        "trainer.resume_path",
    ),
    # parallelism and model features tandem's SFT does not have
    *same("tandem's SFT is FSDP2 (megatron is not supported)", one_of("fsdp", "fsdp2"), "**.strategy"),
    *same(
        "sequence parallelism (Ulysses) is not supported yet",
        one_of(1),
        "**.ulysses_sequence_parallel_size",
        "ulysses_sequence_parallel_size",
    ),
    # LoRA: model.lora_rank / lora_alpha / target_modules / exclude_modules are fields
    *same(MEGATRON_LORA, one_of(0), "model.lora.rank"),
    *same(LORA_ADAPTER, unset, "model.lora_adapter_path", "model.lora.adapter_path"),
    *warn(MEGATRON_LORA, "model.lora"),
    *same("quantization-aware training is not supported yet", off, "engine.qat.enable"),
    *warn("quantization-aware training settings; QAT is off", "engine.qat"),
    *same("multi-token prediction is not supported yet", off, "model.mtp.enable", "model.mtp.enable_train"),
    *warn("multi-token prediction settings; MTP is off", "model.mtp"),
    *warn(
        SFT_MODEL_WARN,
        "model.fsdp_config",
        "engine",
        "model.use_liger",
        "model.use_remove_padding",
        "model.use_fused_kernels",
        "model.fused_kernel_options",
        "model.enable_activation_offload",
        "model.tiled_mlp",
        "use_remove_padding",
        "model.use_shm",
        "data.use_shm",
    ),
    # model and data loading
    *same("extra model libraries are not imported", unset, "model.external_lib"),
    *same("model config overrides are not applied", unset, "model.override_config"),
    *same("the tokenizer's own chat template is used", unset, "model.custom_chat_template", "data.chat_template"),
    *same(
        "the config and tokenizer are read from model.partial_pretrain",
        unset,
        "model.hf_config_path",
        "model.tokenizer_path",
        or_equal="model.partial_pretrain",
    ),
    *same("chat-template arguments are not passed yet", unset, "data.apply_chat_template_kwargs"),
    *same("custom dataset classes are not supported yet", unset, "data.custom_cls"),
    *same("a cap on the training set is not supported yet", at_most(-1), "data.train_max_samples"),
    *warn("validation reads all of data.val_files", "data.val_max_samples"),
    *warn(
        "tool schemas and thinking switches are not passed to the chat template; rows are "
        "rendered with the tokenizer's defaults",
        "data.tools_key",
        "data.multiturn.tools_key",
        "data.enable_thinking_key",
        "data.multiturn.enable_thinking_key",
        "data.enable_thinking_default",
    ),
    *warn("tandem tokenizes each turn with the whole conversation's template", "data.ignore_input_ids_mismatch"),
    *warn("tandem packs sequences without padding whatever the mode (the same loss)", "data.pad_mode"),
    *warn(
        "tandem's loss is already the mean over every response token of the step on all ranks", "data.balance_dp_token"
    ),
    *warn("the data is read in the training process", "data.num_workers"),
    # optimizer
    *same("tandem's optimizer is torch's AdamW", one_of("adamw"), "optim.optimizer"),
    *same("tandem's optimizer is torch's AdamW", one_of("torch.optim"), "optim.optimizer_impl"),
    *same("tandem's cosine schedule is one half cycle", one_of(0.5), "optim.num_cycles"),
    *same("give the warmup as warmup_steps_ratio", at_most(0), "optim.lr_warmup_steps"),
    *same("optimizer overrides are not supported", unset, "optim.override_optimizer_config"),
    *warn("verl fills it in at run time from the step count", "optim.total_training_steps"),
    *warn("a detail of verl's scheduler step count", "optim.zero_indexed_step"),
    # trainer
    *warn(
        "checkpoints and HF folders are written to trainer.default_local_dir only (copy them elsewhere yourself)",
        "trainer.default_hdfs_dir",
    ),
    *warn(
        "tandem always checkpoints model, optimizer and trainer state (trainer.save_freq, trainer.resume_mode)",
        "checkpoint",
        "trainer.checkpoint",
    ),
    *warn(LAUNCHERS, "trainer.nnodes", "trainer.n_gpus_per_node"),
    *warn("tandem splits each step's sequences over the ranks by tokens already", "trainer.balance_batch"),
]


@dataclasses.dataclass(frozen=True)
class Section:
    """A section a config may leave unused: then its keys are ignored whatever their values."""

    prefix: str
    used: Callable[[Callable[[str], Any]], bool]  # from the config's resolved values
    why: str
    switch: str = ""  # the key that turns it on: always treated by its own rule


def critic_used(get) -> bool:
    """verl's rule: critic.enable if set, else exactly for GAE."""
    enable = get("critic.enable")
    return bool(enable) if enable is not None else get("algorithm.adv_estimator") == "gae"


SECTIONS = (
    Section(
        "critic",
        critic_used,
        "the critic is not used (algorithm.adv_estimator is not gae and critic.enable is not true)",
    ),
    Section(
        "reward_model",
        lambda get: not off(get("reward_model.enable")),
        "reward_model.enable is false",
        "reward_model.enable",
    ),
    Section(
        "reward.reward_model",
        lambda get: not off(get("reward.reward_model.enable")),
        "reward.reward_model.enable is false",
        "reward.reward_model.enable",
    ),
)


@functools.cache
def rule_for(key: str, sft: bool = False) -> Rule | None:
    return next((r for r in (SFT_RULES if sft else RULES) if r.matches(key)), None)


def rules_of(cls) -> tuple[list[Rule], bool] | None:
    """(the rules, whether SFT's) for a schema that reads verl's files; None for any other."""
    if cls in role_schemas():
        return RULES, False
    return (SFT_RULES, True) if cls is _load(SFT_ROLE) else None


def _load(spec: str) -> type:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def role_schemas() -> list[type]:
    """The role config classes (imported here, lazily: they import protocol.config)."""
    return [_load(spec) for spec in ROLES]


@dataclasses.dataclass(frozen=True)
class Treatment:
    verdict: str  # APPLIED, IGNORED, REFUSED or UNKNOWN
    reason: str = ""
    rule: Rule | None = None
    value: Any = None
    quiet: bool = False  # ignored without a line: the value asks for what tandem does anyway


def _honours(rule: Rule, value, get) -> bool:
    try:
        if rule.need is None or rule.need(value):
            return True
    except TypeError:  # e.g. a string where a number is compared
        pass
    return bool(rule.or_equal) and value == get(rule.or_equal)


def treat(key: str, value: Callable[[], Any], get: Callable[[str], Any], sft: bool = False) -> Treatment:
    """How a key of no own field is treated. `value()` resolves its value and `get(k)` another
    key's, only when the rule needs them (an ignored key's interpolations are never resolved)."""
    rule = rule_for(key, sft)
    if rule is None:
        return Treatment(UNKNOWN)
    for section in () if sft else SECTIONS:
        if key != section.switch and _match(section.prefix.split("."), key.split(".")) and not section.used(get):
            return Treatment(IGNORED, section.why, rule)
    v = value() if rule.need or rule.kind == ALIAS else None
    if not _honours(rule, v, get):
        return Treatment(REFUSED, rule.reason, rule, v)
    if rule.kind == ALIAS:
        return Treatment(APPLIED, rule.reason, rule, v)
    return Treatment(IGNORED, rule.reason, rule, v, quiet=rule.kind == SAME)


# --- verl's releases (protocol/verl_releases/*.json) ---------------------------------------------
RELEASES_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "verl_releases")
SHAPES = ("ppo_trainer", "sft_trainer", "sft_trainer_engine")


@functools.cache
def releases() -> dict[str, dict]:
    """Each covered verl minor release's config keys (release -> data), oldest first."""
    out = {}
    for path in glob.glob(os.path.join(RELEASES_DIR, "*.json")):
        with open(path) as f:
            data = json.load(f)
        out[data["release"]] = data
    return dict(sorted(out.items(), key=lambda kv: [int(p) if p.isdigit() else -1 for p in kv[0].split(".")]))


def example_keys(data: dict, sft: bool) -> dict[str, dict[str, str]]:
    """A release's example scripts (path -> overrides) for the RL or the SFT entry point."""
    return {path: e["overrides"] for path, e in data["examples"].items() if ("sft" in e["entry"]) == sft}


def release_keys(release: str, sft: bool) -> set[str]:
    """A release's keys: its config's (both SFT shapes for SFT) and its examples' overrides."""
    data = releases()[release]
    known = {k for shape in (SHAPES[1:] if sft else SHAPES[:1]) for k in data.get(shape, {})}
    return known | {k for over in example_keys(data, sft).values() for k in over}


def matching_releases(keys: set[str], sft: bool) -> tuple[set[str], list[str]]:
    """(the keys of some verl release, the releases that have every one of them; when none
    has, the closest ones)."""
    per = {r: release_keys(r, sft) for r in releases()}
    verl = {k for k in keys if any(k in known for known in per.values())}
    scores = {r: len(verl & known) for r, known in per.items()}
    best = max(scores.values(), default=0)
    return verl, [r for r, n in scores.items() if n == best]


@functools.cache
def _fields(sft: bool) -> frozenset[str]:
    from protocol.fields import leaves

    return frozenset(n for cls in ([_load(SFT_ROLE)] if sft else role_schemas()) for n, _, _ in leaves(cls))


def treat_flat(keys, values: dict[str, Any], sft: bool = False) -> dict[str, Treatment]:
    """The treatment of `keys` given a flat mapping of values (a release's config with a
    script's overrides), without building a config: fields are applied, other keys treated by
    their rule. A value only the shell knows ('$VAR') is judged by its rule alone."""
    fields = _fields(sft)
    out = {}
    for key in keys:
        if key in fields or any(key.startswith(f + ".") for f in fields):
            out[key] = Treatment(APPLIED)
            continue
        value = values.get(key)
        if isinstance(value, str) and "$" in value:
            rule = rule_for(key, sft)
            out[key] = (
                Treatment(UNKNOWN)
                if rule is None
                else Treatment(
                    APPLIED if rule.kind == ALIAS else IGNORED,
                    f"{rule.reason}{'; some values are refused' if rule.need else ''} (value set by the shell)",
                    rule,
                )
            )
            continue
        out[key] = treat(key, functools.partial(values.get, key), values.get, sft)
    return out


def release_config(release: str, shape: str) -> dict:
    """A release's config of one shape as the nested mapping of its YAML file."""
    out: dict = {}
    for key, value in releases()[release][shape].items():
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def verl_config_path() -> str:
    """verl's flat reference config (every key of ppo_trainer.yaml), from the installed verl."""
    import verl

    return os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "_generated_ppo_trainer.yaml")
