"""Every key of verl's PPO/GRPO trainer config, classified for a decoupled tandem run.

One YAML file in the shape of verl's `ppo_trainer.yaml` (the flat `_generated_ppo_trainer.yaml`)
serves both roles. A key in it is
  honoured   a field of a role's schema (ROLES below): not listed here;
  ALIAS      verl's spelling of a tandem key, which it sets (see protocol/config.py);
  WARN       accepted with one warning line saying why it does not apply to a decoupled run;
  SAME       accepted silently: its value asks for what tandem always does.
A rule with `need` refuses the values that ask for something tandem cannot do yet (`need(value)`
false), with its reason, whatever its kind. Patterns are dotted keys: `*` is one segment, `**` one
or more; a pattern also covers every key under it. The first matching rule wins, so specific
rules come before the subtrees that contain them.

    python -m protocol.verl_keys [FILE.yaml]    # classify every key of a file (default: verl's)
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
from collections import Counter
from typing import Any, Callable

# The role schemas that share one config file; each accepts the others' keys silently.
ROLES = ("trainer.config:TrainerConfig", "rollout.config:WorkerConfig",
         "rollout.config:ValidatorConfig")

ALIAS, WARN, SAME = "alias", "warn", "same"


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str
    kind: str
    reason: str = ""
    need: Callable[[Any], bool] | None = None  # values tandem can honour; others are refused
    to: str = ""  # ALIAS: the tandem key it sets while that key is unset ...
    replaces: Any = None  # ... or set to this verl placeholder

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
    return not v


def one_of(*ok) -> Callable[[Any], bool]:
    return lambda v: v is None or (v.lower() if isinstance(v, str) else v) in ok


def at_most(n) -> Callable[[Any], bool]:
    return lambda v: v is None or v <= n


def warn(reason: str, *patterns: str) -> list[Rule]:
    return [Rule(p, WARN, reason) for p in patterns]


def same(reason: str, need, *patterns: str) -> list[Rule]:
    return [Rule(p, SAME, reason, need) for p in patterns]


def alias(pattern: str, to: str, replaces=None) -> Rule:
    return Rule(pattern, ALIAS, f"verl's name for {to}", to=to, replaces=replaces)


AR, ACTOR, ROLLOUT = "actor_rollout_ref", "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
LAUNCHERS = ("GPU and node counts are the launchers' (torchrun --nproc_per_node, launch.submit "
             "--nodes / --gpus-per-node, one worker per GPU)")
NO_RAY = ("verl's own Ray workers: tandem's roles are their own processes (on a Ray cluster, "
          "Ray jobs: launch.submit --backend ray, docs/ray.md)")
FSDP = ("FSDP layout and memory options: tandem's trainer shards each decoder layer with FSDP2 over "
        "all ranks (fp32 master weights, bf16 compute on GPU); they change memory and speed, not results")
KERNELS = ("kernel and memory choices of verl's workers; tandem runs the HF model as is, "
           "with the same results")
VLLM_TUNING = ("vLLM scheduler/memory tuning that tandem's worker does not pass to the engine yet "
               "(speed and memory only)")
MULTIMODAL = "multimodal inputs: tandem is text-only and does not read these columns"
PROFILER = "verl's profiler hooks; profile a tandem process with torch.profiler or nsys around it"

RULES: list[Rule] = [
    *warn("verl's instantiation hint; tandem's schemas are its dataclasses", "**._target_"),
    *warn("Hydra composition: keys this file does not set take tandem's defaults", "defaults"),
    *warn("Hydra's own settings; tandem reads the file with OmegaConf", "hydra"),
    *warn(PROFILER, "**.profiler", "global_profiler"),
    # verl's critic keys that tandem's critic has no use for
    *warn("tandem's critic computes values inside its training micro-batches "
          "(critic.ppo_max_token_len_per_gpu / ppo_micro_batch_size_per_gpu)",
          "critic.forward_max_token_len_per_gpu", "critic.forward_micro_batch_size_per_gpu"),
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
    # parallelism and model features tandem does not have
    *same("tandem's trainer is FSDP2 (megatron is not supported)", one_of("fsdp", "fsdp2"),
          "**.strategy"),
    *same("sequence parallelism (Ulysses) is not supported yet", one_of(1),
          "**.ulysses_sequence_parallel_size"),
    *same("LoRA is not supported yet: tandem trains and publishes full weights", one_of(0),
          "**.lora_rank", "**.lora.rank"),
    *same("LoRA adapters are not supported yet", unset, "**.lora_adapter_path", "**.lora.adapter_path"),
    *warn("LoRA settings; LoRA is off (lora_rank=0)", "**.lora_alpha", "**.target_modules",
          "**.exclude_modules", "**.lora"),
    *same("quantization-aware training is not supported yet", off, "**.qat.enable"),
    *warn("quantization-aware training settings; QAT is off", "**.qat"),
    *same("multi-token prediction is not supported yet", off, "**.mtp.enable", "**.mtp.enable_train",
          "**.mtp.enable_rollout"),
    *warn("multi-token prediction settings; MTP is off", "**.mtp"),
    *warn(FSDP, "**.fsdp_config", "critic.fsdp"),
    # actor / critic loss and optimizer
    *same("other policy losses of verl's registry are not wired yet", one_of("vanilla"),
          f"{ACTOR}.policy_loss.loss_mode"),
    *warn("parameters of policy losses other than vanilla", f"{ACTOR}.policy_loss",
          f"{ACTOR}.tau_pos", f"{ACTOR}.tau_neg"),
    *same("global micro-batch sizes are deprecated in verl: give ppo_micro_batch_size_per_gpu",
          unset, "**.ppo_micro_batch_size", "**.log_prob_micro_batch_size",
          "critic.forward_micro_batch_size"),
    *same("a fixed loss scale is not supported (loss_agg_mode decides the normalisation)", unset,
          "**.loss_scale_factor"),
    *same("tandem's optimizer is torch's AdamW", one_of("adamw"), "**.optim.optimizer"),
    *same("tandem's optimizer is torch's AdamW", one_of("torch.optim"), "**.optim.optimizer_impl"),
    *same("tandem's cosine schedule is one half cycle", one_of(0.5), "**.optim.num_cycles"),
    *same("give the warmup as lr_warmup_steps_ratio", at_most(0), "**.optim.lr_warmup_steps"),
    *same("optimizer overrides are not supported", unset, "**.optim.override_optimizer_config"),
    *warn("verl fills it in at run time from trainer.total_training_steps",
          "**.optim.total_training_steps"),
    *warn("a detail of verl's scheduler step count", "**.optim.zero_indexed_step"),
    *warn(KERNELS, "**.use_torch_compile", "**.use_fused_kernels", "**.use_remove_padding",
          "**.entropy_from_logits_with_chunking", "**.entropy_from_logits_chunk_size",
          "**.entropy_checkpointing", "**.pad_to_length", "**.use_liger", "**.fused_kernel_options",
          "**.tiled_mlp", "**.use_prefix_grouper", "**.enable_activation_offload",
          f"{ACTOR}.calculate_sum_pi_squared"),
    *warn("tandem computes the entropy when entropy_coeff > 0", f"{ACTOR}.calculate_entropy"),
    *warn("verl copies rollout.n here; the group size is the workers' actor_rollout_ref.rollout.n",
          "**.rollout_n"),
    *warn(MULTIMODAL, f"{ACTOR}.freeze_vision_tower", "data.image_patch_size", "data.image_key",
          "data.video_key", "data.audio_key", "data.return_multi_modal_inputs",
          "data.mm_processor_kwargs"),
    *warn("the trainer seeds from trainer.seed", "**.data_loader_seed"),
    *warn("tandem always checkpoints model, optimizer and trainer state (trainer.save_freq, "
          "trainer.resume_mode)", "**.checkpoint"),
    *warn("the reference policy is the frozen initial actor, run by the trainer with the actor's "
          "micro-batching", f"{AR}.ref"),
    # model loading
    *same("custom model and dataset code is not loaded (trust_remote_code is off)", off,
          "**.trust_remote_code"),
    *same("workers use the tokenizer's own chat template", unset, "**.model.custom_chat_template"),
    *same("extra model libraries are not imported", unset, "**.model.external_lib"),
    *same("model config overrides are not applied", unset, "**.model.override_config"),
    *same("the config and tokenizer are read from model.path", unset, "**.model.hf_config_path",
          "**.model.tokenizer_path", "data.tokenizer"),
    *warn("a loading detail of verl (shared-memory model copies)", "**.use_shm"),
    *warn("tandem is decoupled: rollout workers and the trainer are always separate processes",
          f"{AR}.hybrid_engine"),
    *warn("trainer collectives time out after trainer.data_timeout_s + 600 s", f"{AR}.nccl_timeout"),
    # rollout
    *warn("each worker generates its batches in its own process", f"{ROLLOUT}.mode"),
    *warn(LAUNCHERS, f"{ROLLOUT}.nnodes", f"{ROLLOUT}.n_gpus_per_node", "trainer.nnodes",
          "trainer.n_gpus_per_node"),
    *same("top-k sampling is not supported by tandem's engines yet", one_of(-1, 0),
          f"{ROLLOUT}.top_k"),
    *warn("each worker seeds sampling and prompt order with worker.seed mixed with its id",
          f"{ROLLOUT}.seed", "data.seed"),
    *warn("deterministic vLLM kernels are not requested", f"{ROLLOUT}.full_determinism"),
    *same("ignore_eos is not supported", off, f"{ROLLOUT}.ignore_eos"),
    *same("greedy training rollouts make every response of a group alike", lambda v: v is None or bool(v),
          f"{ROLLOUT}.do_sample"),
    *warn(VLLM_TUNING, f"{ROLLOUT}.cudagraph_capture_sizes", f"{ROLLOUT}.max_num_batched_tokens",
          f"{ROLLOUT}.max_model_len", f"{ROLLOUT}.max_num_seqs", f"{ROLLOUT}.enable_chunked_prefill",
          f"{ROLLOUT}.enable_prefix_caching", f"{ROLLOUT}.scheduling_policy",
          f"{ROLLOUT}.disable_log_stats", f"{ROLLOUT}.skip_tokenizer_init",
          f"{ROLLOUT}.multi_stage_wake_up", f"{ROLLOUT}.layered_summon",
          f"{ROLLOUT}.moe_load_balance_metrics_interval"),
    *warn("workers keep their engine loaded: there is no training phase to free memory for",
          f"{ROLLOUT}.free_cache_engine"),
    *warn("workers load the weight versions the trainer publishes (weights/v<N>)",
          f"{ROLLOUT}.load_format", f"{ROLLOUT}.checkpoint_engine"),
    *warn("one engine per worker: start more workers for data parallelism",
          f"{ROLLOUT}.data_parallel_size"),
    *same("expert- and pipeline-parallel engines are not supported yet", one_of(1),
          f"{ROLLOUT}.expert_parallel_size", f"{ROLLOUT}.pipeline_model_parallel_size"),
    *same("workers record processed (temperature-scaled) logprobs, which the importance "
          "correction needs", one_of("processed_logprobs"), f"{ROLLOUT}.logprobs_mode"),
    *warn("the trainer, not the rollout, computes pi_old", f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
          f"{ROLLOUT}.log_prob_use_dynamic_bsz", f"{ROLLOUT}.log_prob_max_token_len_per_gpu"),
    *warn("workers always record the behaviour logprobs", f"{ROLLOUT}.calculate_log_probs"),
    *same("over-sampling is not supported", at_most(0), f"{ROLLOUT}.over_sample_rate"),
    *same("engine arguments are not passed to vLLM yet", unset, f"{ROLLOUT}.engine_kwargs"),
    *same("a rollout router is not supported", unset, f"{ROLLOUT}.router_config_path"),
    *same("multi-turn and tool rollouts are not supported yet", off, f"{ROLLOUT}.multi_turn.enable"),
    *warn("multi-turn settings; multi_turn is off", f"{ROLLOUT}.multi_turn"),
    *same("agent loops are not supported yet (single-turn generation)", one_of("single_turn_agent"),
          f"{ROLLOUT}.agent.default_agent_loop"),
    *same("agent loops are not supported yet (single-turn generation)", unset,
          f"{ROLLOUT}.agent.agent_loop_config_path", f"{ROLLOUT}.agent.custom_async_server"),
    *warn("agent-loop settings; generation is single-turn", f"{ROLLOUT}.agent"),
    *warn("rollout tracing is not wired; samples are in the experience shards", f"{ROLLOUT}.trace"),
    *same("MoE routing replay is not supported", off, f"{ROLLOUT}.enable_rollout_routing_replay"),
    *warn("workers report their metrics in workers/<id>.json", f"{ROLLOUT}.prometheus"),
    *same("quantized rollouts are not supported yet", unset, f"{ROLLOUT}.quantization",
          f"{ROLLOUT}.quantization_config_file"),
    *same("prefill/decode disaggregation is not supported", off, f"{ROLLOUT}.disaggregation.enabled"),
    *warn("prefill/decode disaggregation settings; it is off", f"{ROLLOUT}.disaggregation"),
    # data
    *same("a cap on the training set is not supported yet", at_most(-1), "data.train_max_samples"),
    *warn("validation reads all of data.val_files", "data.val_max_samples"),
    *same("rewards are chosen by each row's data_source", one_of("data_source"), "data.reward_fn_key"),
    *warn("workers generate actor_rollout_ref.rollout.prompts_per_batch prompts at a time",
          "data.gen_batch_size"),
    *same("tool calling is not supported yet", unset, "data.tool_config_path", "data.function_tool_path"),
    *warn("the format of verl's dataloader output; workers tokenize the chat prompt themselves",
          "data.return_raw_input_ids", "data.return_raw_chat", "data.return_full_prompt",
          "data.dataloader_num_workers", "data.validation_shuffle"),
    *warn("workers always skip prompts longer than data.max_prompt_length (counted in their log)",
          "data.filter_overlong_prompts", "data.filter_overlong_prompts_workers", "data.truncation"),
    *same("custom dataset classes are not supported yet", unset, "data.custom_cls"),
    *same("chat-template arguments are not passed yet", unset, "data.apply_chat_template_kwargs"),
    # rewards
    *same("model reward models are not supported yet: use custom_reward_function", off,
          "reward_model.enable", "reward.reward_model.enable"),
    *same("tandem scores each response alone, as verl's naive reward manager", one_of("naive"),
          "reward_model.reward_manager", "reward.reward_manager.name"),
    *same("custom reward managers are not supported: use custom_reward_function", unset,
          "reward.reward_manager.module.path"),
    *same("sandbox code-execution rewards are not supported yet", unset, "sandbox_fusion.url",
          "reward.sandbox_fusion.url"),
    *warn("reward-model and reward-loop settings; workers score in-process with "
          "custom_reward_function or verl's default_compute_score", "reward_model", "reward",
          "sandbox_fusion"),
    # algorithm
    Rule("algorithm.rollout_correction.rollout_is", WARN, "tandem always applies the token-level "
         "truncated importance weight (algorithm.rollout_is_threshold) against the behaviour "
         "logprobs; sequence-level weights are not supported", one_of("token")),
    *same("rejection sampling of rollouts is not supported yet", unset,
          "algorithm.rollout_correction.rollout_rs"),
    *same("tandem recomputes pi_old; bypass mode is not supported", off,
          "algorithm.rollout_correction.bypass_mode", "algorithm.rollout_correction.rollout_is_batch_normalize"),
    *same("the loss is verl's clipped PPO loss", one_of("ppo_clip"),
          "algorithm.rollout_correction.loss_type"),
    *warn("rejection sampling is off", "algorithm.rollout_correction.rollout_rs_threshold"),
    *same("dynamic sampling (DAPO filter_groups) is not supported yet", off,
          "algorithm.filter_groups.enable"),
    *same("preference-feedback PPO is not supported yet", off, "algorithm.use_pf_ppo"),
    *warn("filter_groups / pf_ppo settings; they are off", "algorithm.filter_groups",
          "algorithm.pf_ppo"),
    # trainer
    *warn("tandem does not rebalance sequence lengths across ranks (speed only)",
          "trainer.balance_batch"),
    *warn("workers cycle through the data; the run length is trainer.total_training_steps",
          "trainer.total_epochs"),
    *warn("experience shards stay in the run folder (buffer.retention)", "trainer.rollout_data_dir"),
    *warn("validation outputs are not dumped", "trainer.validation_data_dir",
          "trainer.log_val_generations"),
    *warn("checkpoints live in ROOT/checkpoints", "trainer.default_local_dir",
          "trainer.del_local_ckpt_after_load", "trainer.esi_redundant_time"),
    *same("checkpoints are written to ROOT/checkpoints only", unset, "trainer.default_hdfs_dir",
          "trainer.checkpoint_callback_class"),
    *warn("the critic is checkpointed with the actor (trainer.max_ckpt_to_keep)",
          "trainer.max_critic_ckpt_to_keep"),
    *same("validation-only runs are not supported yet", off, "trainer.val_only"),
    *warn(NO_RAY, "trainer.ray_wait_register_center_timeout", "ray_kwargs"),
    *warn("verl's trainer modes; tandem is itself decoupled and asynchronous, with "
          "trainer.max_staleness bounding off-policy samples (0: synchronous)", "trainer.use_v1",
          "trainer.v1"),
    # features of verl tandem does not have (refused when switched on)
    *same("distillation is not supported yet", off, "distillation.enabled"),
    *warn("distillation settings; it is off", "distillation"),
    *same("tandem's transport is buffer.transport", off, "transfer_queue.enable"),
    *warn("transfer-queue settings; tandem's transport is buffer.transport", "transfer_queue"),
    *warn("verl's rollout dump and replay; experience shards are kept per buffer.retention", "skip"),
]


@functools.lru_cache(maxsize=None)
def rule_for(key: str) -> Rule | None:
    return next((r for r in RULES if r.matches(key)), None)


def role_schemas() -> list[type]:
    """The role config classes (imported here, lazily: they import protocol.config)."""
    out = []
    for spec in ROLES:
        module, name = spec.split(":")
        out.append(getattr(importlib.import_module(module), name))
    return out


def classify(key: str, honoured: set[str]) -> str:
    """'honoured' (a field of a role schema), a rule's kind, or '' for a key in no schema. A rule
    with `need` also refuses some values, which only the value decides."""
    if key in honoured:
        return "honoured"
    rule = rule_for(key)
    return rule.kind if rule else ""


def report(path: str) -> int:
    """Print every leaf key of a config file with its class and reason, then the counts per
    class; 1 if any key is in no schema."""
    from protocol.fields import leaves, yaml_leaves
    honoured = {name for cls in role_schemas() for name, _, _ in leaves(cls)}
    keys = yaml_leaves(path)
    counts, refusable = Counter(), 0
    for key in keys:
        kind, rule = classify(key, honoured) or "UNKNOWN", rule_for(key)
        counts[kind] += 1
        why = ""
        if kind not in ("honoured", "UNKNOWN"):
            refusable += rule.need is not None
            why = f"  ({rule.reason}{'; other values refused' if rule.need else ''})"
        print(f"{kind:9s} {key}{why}")
    print("\n" + ", ".join(f"{c}: {n}" for c, n in counts.most_common()) + f"; total {len(keys)}")
    print(f"of which refused for the values tandem cannot honour: {refusable}")
    return 1 if counts["UNKNOWN"] else 0


def verl_config_path() -> str:
    """verl's flat reference config (every key of ppo_trainer.yaml), from the installed verl."""
    import verl
    return os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "_generated_ppo_trainer.yaml")


if __name__ == "__main__":
    sys.exit(report(sys.argv[1] if len(sys.argv) > 1 else verl_config_path()))
