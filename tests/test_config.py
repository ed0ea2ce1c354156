"""protocol.config: building nested dataclass configs from YAML and dotted overrides, and the CLIs."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, launch_local, subprocess_env

from buffer.config import BufferConfig
from protocol import verl_keys
from protocol.config import (
    ConfigError,
    F,
    build,
    load,
    parse_cli,
    split_argv,
    to_dict,
    treatments,
    usage,
    yaml_leaves,
)
from protocol.verl_keys.__main__ import main as verl_keys_main
from rollout.config import ValidatorConfig, WorkerConfig
from trainer.config import TrainerConfig


# A small nested config of our own, independent of the product's sections.
@dataclasses.dataclass
class Inner:
    flush_interval: float = F(30.0, "seconds", gt=0)
    mode: str = F("fast", "how", choices=("fast", "slow"))
    tags: list[str] = F(doc="labels", factory=list)
    ratio: float = F(0.5, "a fraction", ge=0, le=1)


@dataclasses.dataclass
class Other:
    count: int = F(1, "things", ge=1)
    enabled: bool = F(True, "switch")


@dataclasses.dataclass
class Outer:
    name: str = F(doc="required name")
    count: int = F(2, "more things", ge=1, le=10)
    limit: int | None = F(None, "optional cap", ge=0)
    inner: Inner = F(factory=Inner)
    other: Other = F(factory=Other)


def test_defaults_and_required():
    cfg = build(Outer, {"name": "x"})
    assert cfg == Outer(name="x", count=2, limit=None, inner=Inner(), other=Other())
    assert to_dict(cfg)["inner"]["flush_interval"] == 30.0


def test_required_field_missing_is_named():
    with pytest.raises(ConfigError, match=r"^name: required"):
        build(Outer, {})


def test_dotted_overrides_are_coerced():
    cfg = build(
        Outer,
        {
            "name": "x",
            "inner.flush_interval": "2.5",
            "inner.mode": "slow",
            "other.count": "4",
            "other.enabled": "false",
            "limit": "7",
        },
    )
    assert cfg.inner.flush_interval == 2.5 and isinstance(cfg.inner.flush_interval, float)
    assert cfg.inner.mode == "slow"
    assert cfg.other.count == 4 and isinstance(cfg.other.count, int)
    assert cfg.other.enabled is False
    assert cfg.limit == 7
    assert build(Outer, {"name": "x", "limit": "none"}).limit is None


def test_unique_leaf_override():
    cfg = build(Outer, {"name": "x", "flush_interval": 3})
    assert cfg.inner.flush_interval == 3.0
    assert isinstance(cfg.inner.flush_interval, float)


def test_ambiguous_leaf_is_rejected_naming_candidates():
    # `count` is both a top-level leaf and other.count: exact match wins for the top level ...
    assert build(Outer, {"name": "x", "count": "5"}).count == 5
    # ... but a leaf name shared by two nested fields is ambiguous.
    with pytest.raises(ConfigError) as e:
        build(WorkerConfig, {"root": "/r", "data.train_files": "a.parquet", "path": "/m"})
    msg = str(e.value)
    assert "ambiguous" in msg
    assert "actor_rollout_ref.model.path" in msg and "custom_reward_function.path" in msg


def test_unknown_key_is_named_with_suggestions():
    with pytest.raises(ConfigError) as e:
        build(Outer, {"name": "x", "inner.flush_intervall": "3"})
    msg = str(e.value)
    assert "'inner.flush_intervall'" in msg
    assert "did you mean" in msg and "inner.flush_interval" in msg


def test_unknown_key_without_close_match():
    with pytest.raises(ConfigError) as e:
        build(Outer, {"name": "x", "zzzzzz": "3"})
    assert "'zzzzzz'" in str(e.value)
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize(
    "key,value,field",
    [
        ("count", "0", "count"),
        ("count", "11", "count"),
        ("inner.flush_interval", "0", "inner.flush_interval"),
        ("inner.ratio", "1.5", "inner.ratio"),
        ("inner.mode", "medium", "inner.mode"),
        ("limit", "-1", "limit"),
        ("other.count", "abc", "other.count"),
        ("other.enabled", "maybe", "other.enabled"),
    ],
)
def test_bad_values_name_the_dotted_field(key, value, field):
    with pytest.raises(ConfigError) as e:
        build(Outer, {"name": "x", key: value})
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_list_parsing():
    assert build(Outer, {"name": "x", "tags": "[a,b]"}).inner.tags == ["a", "b"]
    assert build(Outer, {"name": "x", "tags": "a,b,c"}).inner.tags == ["a", "b", "c"]
    assert build(Outer, {"name": "x", "tags": "solo"}).inner.tags == ["solo"]
    assert build(Outer, {"name": "x", "tags": ["p", "q"]}).inner.tags == ["p", "q"]


@dataclasses.dataclass
class WithMapping:
    kwargs: dict[str, float] = F(doc="engine arguments", factory=dict)
    pair: tuple[float, float] = F(doc="two numbers", factory=lambda: (0.9, 0.99))


def test_mapping_fields_take_whole_values_and_entries():
    cfg = build(WithMapping, {"kwargs": "{a: 1}", "kwargs.b": "2", "pair": "[0.5, 0.6]"})
    assert cfg.kwargs == {"a": 1.0, "b": 2.0} and list(cfg.pair) == [0.5, 0.6]
    with pytest.raises(ConfigError, match=r"^kwargs: expected dict\[str, float\]"):
        build(WithMapping, {"kwargs.c": "x"})


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "name: from-yaml\n"
        "count: 3\n"
        "inner:\n  mode: slow\n  tags: [u, v]\n  flush_interval: 9\n"
        "other:\n  enabled: false\n"
    )
    cfg = build(Outer, yaml_file=path)
    assert cfg.name == "from-yaml" and cfg.count == 3
    assert cfg.inner.mode == "slow" and cfg.inner.tags == ["u", "v"]
    assert cfg.other.enabled is False
    assert cfg.inner.flush_interval == 9.0
    # overrides win over the file
    cfg = build(Outer, {"count": "4", "inner.flush_interval": "1.5"}, yaml_file=path)
    assert cfg.count == 4 and cfg.inner.flush_interval == 1.5 and cfg.name == "from-yaml"


def test_yaml_uses_full_names(tmp_path):
    # A file is shared by roles and by verl, so the last-part short form is for the command line only.
    path = tmp_path / "cfg.yaml"
    path.write_text("name: x\nenabled: false\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'enabled'.*did you mean other\.enabled"):
        build(Outer, yaml_file=path)


def test_yaml_errors(tmp_path):
    bad_key = tmp_path / "bad_key.yaml"
    bad_key.write_text("name: x\ninner:\n  flush_intervl: 3\n")
    with pytest.raises(ConfigError, match="inner.flush_intervl"):
        build(Outer, yaml_file=bad_key)
    bad_value = tmp_path / "bad_value.yaml"
    bad_value.write_text("name: x\ninner:\n  ratio: 2\n")
    with pytest.raises(ConfigError, match=r"^inner\.ratio:"):
        build(Outer, yaml_file=bad_value)
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        build(Outer, yaml_file=not_mapping)
    with pytest.raises(ConfigError, match="cannot read"):
        build(Outer, yaml_file=tmp_path / "missing.yaml")


# --- the product's own config sections ---------------------------------------------------------


def test_buffer_config_overrides():
    cfg = build(BufferConfig, {"flush_interval": "3", "flush_samples": "8", "discovery": "poll"})
    assert (cfg.flush_interval, cfg.flush_samples, cfg.discovery) == (3.0, 8, "poll")
    with pytest.raises(ConfigError, match=r"^discovery:"):
        build(BufferConfig, {"discovery": "inotify"})
    with pytest.raises(ConfigError, match=r"^flush_samples:"):
        build(BufferConfig, {"flush_samples": "0"})


TRAINER_REQ = {"root": "/run", "actor_rollout_ref.model.path": "/model"}


def test_trainer_config_dotted_and_leaf_overrides():
    cfg = build(
        TrainerConfig,
        {
            **TRAINER_REQ,
            "trainer.total_training_steps": "7",
            "flush_interval": "3",
            "buffer.flush_samples": "64",
            "algorithm.norm_adv_by_std_in_grpo": "false",
            "actor_rollout_ref.actor.optim.betas": "[0.5, 0.75]",
        },
    )
    assert cfg.trainer.total_training_steps == 7
    assert cfg.buffer.flush_interval == 3.0
    assert cfg.buffer.flush_samples == 64
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.5, 0.75]
    assert cfg.actor_rollout_ref.model.path == "/model"


def test_trainer_config_required_fields_named():
    with pytest.raises(ConfigError, match=r"^root: required"):
        build(TrainerConfig, {"actor_rollout_ref.model.path": "/m"})
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.path: required"):
        build(TrainerConfig, {"root": "/r"})


@pytest.mark.parametrize(
    "key,value",
    [
        ("trainer.total_training_steps", "0"),
        ("trainer.max_staleness", "-1"),
        ("buffer.flush_interval", "0"),
        ("actor_rollout_ref.actor.clip_ratio", "1.5"),
        ("actor_rollout_ref.actor.loss_agg_mode", "sum"),
        ("data.train_batch_size", "x"),
    ],
)
def test_trainer_config_bounds_name_field(key, value):
    with pytest.raises(ConfigError) as e:
        build(TrainerConfig, {**TRAINER_REQ, key: value})
    assert str(e.value).startswith(key + ":"), str(e.value)


def test_trainer_config_cross_field_check():
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.optim.betas"):
        build(TrainerConfig, {**TRAINER_REQ, "betas": "[0.9]"})


def test_trainer_unknown_key_suggests():
    with pytest.raises(ConfigError) as e:
        build(TrainerConfig, {**TRAINER_REQ, "trainer.total_trainig_steps": "3"})
    assert "'trainer.total_trainig_steps'" in str(e.value)
    assert "trainer.total_training_steps" in str(e.value).split("did you mean", 1)[1]


def test_worker_config_lists_and_check():
    cfg = build(
        WorkerConfig,
        {
            "root": "/r",
            "data.train_files": "[a.parquet,b.parquet]",
            "actor_rollout_ref.rollout.n": "4",
            "worker.id": "w-1",
        },
    )
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.custom_reward_function.path is None
    with pytest.raises(ConfigError, match=r"^data\.train_files"):
        build(WorkerConfig, {"root": "/r"})
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.top_p:"):
        build(WorkerConfig, {"root": "/r", "train_files": "a", "actor_rollout_ref.rollout.top_p": "1.01"})


@pytest.mark.parametrize("text", ["3.5", "true"])
def test_int_field_rejects_non_integer_string(text):
    with pytest.raises(ConfigError, match=r"^flush_samples:"):
        build(BufferConfig, {"flush_samples": text})


def test_int_field_rejects_non_integer_float():
    with pytest.raises(ConfigError, match=r"^flush_samples:"):
        build(BufferConfig, {"flush_samples": 3.5})


def test_split_argv_forms():
    overrides, yaml_file, wants_help = split_argv(["a.b=1", "--c.d=2", "--e", "3", "--config", "f.yaml"])
    assert overrides == {"a.b": "1", "c.d": "2", "e": "3"}
    assert yaml_file == "f.yaml" and wants_help is False
    assert split_argv(["x=1", "--help"])[2] is True
    with pytest.raises(ConfigError, match="'lonely'"):
        split_argv(["lonely"])
    with pytest.raises(ConfigError, match="'--dangling'"):
        split_argv(["--dangling"])


def test_parse_cli_exit_codes(capsys):
    cfg = parse_cli(BufferConfig, ["--flush_interval", "4", "flush_samples=9"], "prog", "desc")
    assert (cfg.flush_interval, cfg.flush_samples) == (4.0, 9)
    with pytest.raises(SystemExit) as e:
        parse_cli(BufferConfig, ["flush_interval=-1"], "prog", "desc")
    assert e.value.code == 2
    assert "flush_interval" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_cli(BufferConfig, ["-h"], "prog", "desc")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: prog") and "poll_interval" in out


def test_usage_lists_every_leaf_with_bounds():
    text = usage(Outer, "p", "d")
    for name in (
        "name",
        "count",
        "limit",
        "inner.flush_interval",
        "inner.mode",
        "inner.tags",
        "inner.ratio",
        "other.count",
        "other.enabled",
    ):
        assert f"\n  {name} (" in text
    assert "REQUIRED" in text and ">=1" in text and "<=10" in text and "one of fast|slow" in text


# --- verl configs: one file for both roles ------------------------------------------------------

VERL_YAML = REPO_ROOT / "tests" / "data" / "verl_grpo.yaml"
ROLES = [TrainerConfig, WorkerConfig, ValidatorConfig]
# The fixture's keys that do not apply to a decoupled run: each gets exactly one warning line.
FIXTURE_WARNED = {
    "data.return_raw_chat",
    "data.filter_overlong_prompts",
    "data.truncation",
    "data.dataloader_num_workers",
    "actor_rollout_ref.hybrid_engine",
    "actor_rollout_ref.actor.fsdp_config.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params",
    "actor_rollout_ref.ref.fsdp_config.param_offload",
    "critic.model.fsdp_config.param_offload",
    "actor_rollout_ref.actor.checkpoint.save_contents",
    "actor_rollout_ref.actor.checkpoint.load_contents",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.mode",
    "actor_rollout_ref.rollout.max_num_batched_tokens",
    "actor_rollout_ref.rollout.free_cache_engine",
    "actor_rollout_ref.rollout.load_format",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "algorithm.rollout_correction.rollout_is",
    "trainer.total_epochs",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.default_local_dir",
    # sections the GRPO fixture does not use: ignored whatever their values (verl's own values
    # here would be accepted silently)
    "critic.strategy",
    "reward_model.reward_manager",
}


def warned_keys(lines) -> collections.Counter:
    """Keys named by 'ignored K1, K2: why' lines (the reason may contain ': ' too)."""
    keys = collections.Counter()
    for line in lines:
        head = line.removeprefix("config: ").partition(": ")[0]
        assert head.startswith("ignored "), line
        keys.update(head.removeprefix("ignored ").split(", "))
    return keys


def test_verl_fixture_builds_every_role_with_one_warning_per_key():
    for cls in ROLES:
        cfg, warnings = load(cls, {"root": "/run"}, VERL_YAML)
        keys = warned_keys(warnings)
        assert set(keys) == FIXTURE_WARNED, set(keys) ^ FIXTURE_WARNED
        assert set(keys.values()) == {1}
        if cls is not ValidatorConfig:  # tandem's own section in the same file
            assert cfg.buffer.flush_samples == 16


def test_verl_fixture_values_reach_each_role():
    t, _ = load(TrainerConfig, {"root": "/run"}, VERL_YAML)
    assert t.data.train_batch_size == 4 and t.actor_rollout_ref.actor.optim.lr == 1e-3
    assert t.trainer.experiment_name == "grpo_n4"  # interpolates the worker's rollout.n
    assert t.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 8192  # from an ignored key
    assert t.trainer.max_ckpt_to_keep == 2  # verl's trainer.max_actor_ckpt_to_keep
    assert t.trainer.save_freq == -1 and t.trainer.total_training_steps == 3
    assert t.actor_rollout_ref.actor.use_kl_loss is True
    w, _ = load(WorkerConfig, {"root": "/run"}, VERL_YAML)
    assert w.data.train_files == ["~/data/gsm8k/train.parquet"]  # verl's single path: a list
    assert (w.actor_rollout_ref.rollout.n, w.data.max_response_length) == (4, 3)
    assert w.actor_rollout_ref.rollout.name == "hf"
    v, _ = load(ValidatorConfig, {"root": "/run"}, VERL_YAML)
    assert v.data.val_files == w.data.train_files  # ${data.train_files}
    assert (v.actor_rollout_ref.rollout.val_kwargs.do_sample, v.actor_rollout_ref.rollout.val_kwargs.n) == (False, 1)


def test_command_line_override_is_seen_by_interpolations():
    t, _ = load(TrainerConfig, {"root": "/run", "actor_rollout_ref.rollout.n": "8"}, VERL_YAML)
    assert t.trainer.experiment_name == "grpo_n8"


def test_every_key_of_verls_own_config_is_classified_and_both_roles_build_from_it():
    path = verl_keys.verl_config_path()
    keys = yaml_leaves(path)
    assert len(keys) > 500  # verl's full reference config, not a stub
    over = {"root": "/run", "algorithm.adv_estimator": "grpo", "actor_rollout_ref.rollout.name": "vllm"}
    verdicts = treatments(ROLES, path, over)
    unclassified = [k for k in keys if verdicts[k].verdict == verl_keys.UNKNOWN]
    assert not unclassified, unclassified
    for cls in ROLES:
        cfg, warnings = load(cls, over, path)
        assert warnings and set(warned_keys(warnings).values()) == {1}
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2  # verl's default, honoured


@pytest.mark.parametrize(
    "key,value,why",
    [
        ("actor_rollout_ref.model.lora_adapter_path", "/adapter", "saved LoRA adapter"),
        ("actor_rollout_ref.model.lora.rank", "8", "Megatron LoRA"),
        ("actor_rollout_ref.actor.strategy", "megatron", "megatron"),
        ("reward.reward_model.enable", "true", "reward.reward_model"),
        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "2", "sequence parallel"),
        ("actor_rollout_ref.rollout.multi_turn.enable", "true", "multi-turn"),
        ("algorithm.filter_groups.enable", "true", "dynamic sampling"),
        ("actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space", "4", "engine arguments"),
        ("actor_rollout_ref.rollout.top_k", "50", "top-k"),
    ],
)
def test_settings_tandem_cannot_honour_are_refused_with_the_reason(key, value, why):
    for cls in ROLES:
        with pytest.raises(ConfigError) as e:
            load(cls, {"root": "/run", key: value}, VERL_YAML)
        assert str(e.value).startswith(f"{key}=") and why in str(e.value), str(e.value)


def test_refusal_from_the_file_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        VERL_YAML.read_text().replace("ulysses_sequence_parallel_size: 1", "ulysses_sequence_parallel_size: 2")
    )
    with pytest.raises(
        ConfigError, match=rf"ulysses_sequence_parallel_size=2 \(--config {path}\): not supported: sequence"
    ):
        load(TrainerConfig, {"root": "/run"}, path)


def test_verl_lora_keys_are_applied_to_actor_and_critic(tmp_path):
    """verl's FSDP LoRA keys (issue 27) from the file and the command line; bad values name the field."""
    path = tmp_path / "c.yaml"
    path.write_text(VERL_YAML.read_text().replace("lora_rank: 0", "lora_rank: 16"))
    over = {"root": "/run", "critic.model.lora_rank": "8", "actor_rollout_ref.model.target_modules": "[q_proj,v_proj]"}
    cfg, _ = load(TrainerConfig, over, path)
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (16, 16, ["q_proj", "v_proj"])
    assert (cfg.critic.model.lora_rank, cfg.critic.model.target_modules) == (8, "all-linear")
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.lora_rank: must be >= 0"):
        load(TrainerConfig, {"root": "/run", "actor_rollout_ref.model.lora_rank": "-1"}, VERL_YAML)
    with pytest.raises(ConfigError, match="critic.model.target_modules: lm_head cannot get an adapter"):
        load(TrainerConfig, {**over, "critic.model.target_modules": "[lm_head]"}, path)
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.lora_dropout: must be <= 0.9"):
        load(TrainerConfig, {"root": "/run", "actor_rollout_ref.model.lora_dropout": "1.0"}, VERL_YAML)


def test_a_reward_model_is_accepted_with_its_folder_and_refused_without():
    """Issue 28: reward_model.enable with verl's keys reaches the worker (its reward servers);
    without reward_model.model.path the field is named."""
    over = {"root": "/run", "reward_model.enable": "true", "reward_model.model.path": "/rm"}
    over |= {"reward_model.micro_batch_size_per_gpu": "4", "reward_model.max_length": "512"}
    for cls in ROLES:
        cfg, _ = load(cls, over, VERL_YAML)
    w, _ = load(WorkerConfig, over, VERL_YAML)
    assert w.reward_model.enable and w.reward_model.model.path == "/rm" and w.reward_model.rows() == 4
    assert w.reward_model.max_length == 512
    with pytest.raises(ConfigError, match="^reward_model.model.path: required"):
        load(WorkerConfig, {"root": "/run", "reward_model.enable": "true"}, VERL_YAML)


@pytest.mark.parametrize(
    "key,value",
    [
        ("actor_rollout_ref.model.lora_rank", "0"),
        ("actor_rollout_ref.actor.strategy", "fsdp2"),
        ("reward_model.enable", "false"),
        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "1"),
        ("actor_rollout_ref.rollout.top_k", "-1"),
    ],
)
def test_unsupported_features_left_off_are_accepted_silently(key, value):
    _, warnings = load(WorkerConfig, {"root": "/run", "train_files": "a", key: value})
    assert warnings == []


def test_other_roles_keys_are_accepted_silently():
    _, warnings = load(
        TrainerConfig,
        {
            "root": "/r",
            "actor_rollout_ref.model.path": "/m",
            "actor_rollout_ref.rollout.n": "4",
            "worker.id": "w0",
            "data.train_files": "[a]",
        },
    )
    assert warnings == []
    _, warnings = load(
        WorkerConfig,
        {"root": "/r", "train_files": "a", "trainer.total_training_steps": "3", "data.train_batch_size": "4"},
    )
    assert warnings == []


def test_a_plain_schema_is_strict():
    # Only the role schemas share a file with verl; any other schema accepts its own keys only.
    with pytest.raises(ConfigError, match="unknown config key 'trainer.nnodes'"):
        build(Outer, {"name": "x", "trainer.nnodes": "1"})


def test_interpolations_relative_and_unresolvable(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "data:\n  max_prompt_length: 16\n  max_response_length: ${.max_prompt_length}\n"
        "  train_files: [a.parquet]\n"
        "trainer:\n  default_local_dir: ${no.such.key}\n"
    )  # ignored: never resolved
    cfg, _ = load(WorkerConfig, {"root": "/r"}, path)
    assert cfg.data.max_response_length == 16
    path.write_text("data:\n  train_files: [a.parquet]\n  max_prompt_length: ${no.such.key}\n")
    with pytest.raises(ConfigError, match=r"^data\.max_prompt_length: cannot resolve"):
        load(WorkerConfig, {"root": "/r"}, path)


def test_verl_key_typo_suggests_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  tokenizr: null\n")
    with pytest.raises(
        ConfigError, match=r"unknown config key 'data.tokenizr' \(--config .*did you mean data\.tokenizer"
    ):
        load(TrainerConfig, {"root": "/r", "actor_rollout_ref.model.path": "/m"}, path)


@pytest.mark.parametrize(
    "text,message",
    [
        ("trainer:\n  total_training_steps: many\n", r"^trainer\.total_training_steps: expected int, got 'many'"),
        (
            "actor_rollout_ref:\n  actor:\n    optim:\n      lr: .inf\n",
            r"^actor_rollout_ref\.actor\.optim\.lr: must be a finite",
        ),
        (
            "actor_rollout_ref:\n  actor:\n    optim:\n      lr: .nan\n",
            r"^actor_rollout_ref\.actor\.optim\.lr: must be a finite",
        ),
        ("actor_rollout_ref:\n  actor:\n    clip_ratio: 2\n", r"^actor_rollout_ref\.actor\.clip_ratio: must be <= 1"),
        ("trainer:\n  logger: 3\n", r"^trainer\.logger: expected"),
    ],
)
def test_bad_values_in_the_file_name_the_field(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load(TrainerConfig, {"root": "/r", "actor_rollout_ref.model.path": "/m"}, path)


def test_non_finite_floats_refused_on_the_command_line():
    with pytest.raises(ConfigError, match=r"^flush_interval: must be a finite number, got inf"):
        build(BufferConfig, {"flush_interval": "inf"})


def test_null_means_the_default(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "trainer:\n  total_training_steps: null\nactor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: null\n"
    )
    cfg, _ = load(TrainerConfig, {"root": "/r", "actor_rollout_ref.model.path": "/m"}, path)
    assert cfg.trainer.total_training_steps == 100
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 32


def test_verl_spellings_set_tandem_keys():
    base = {"root": "/r", "actor_rollout_ref.model.path": "/m"}
    cfg, _ = load(
        TrainerConfig,
        {
            **base,
            "actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine",
            "algorithm.rollout_correction.rollout_is_threshold": "5",
        },
    )
    assert cfg.actor_rollout_ref.actor.optim.warmup_style == "cosine"
    assert cfg.algorithm.rollout_is_threshold == 5.0
    cfg, _ = load(
        TrainerConfig, {**base, "trainer.resume_mode": "resume_path", "trainer.resume_from_path": "/ckpt/step_3"}
    )
    assert cfg.trainer.resume_mode == "/ckpt/step_3"
    # Both spellings given: tandem's key wins and one line says so.
    cfg, warnings = load(
        TrainerConfig,
        {**base, "actor_rollout_ref.actor.grad_clip": "1.0", "actor_rollout_ref.actor.optim.clip_grad": "0.5"},
    )
    assert cfg.actor_rollout_ref.actor.grad_clip == 1.0
    assert warnings == [
        "ignored actor_rollout_ref.actor.optim.clip_grad=0.5: actor_rollout_ref.actor.grad_clip=1.0 is set too and wins"
    ]


def test_warnings_are_printed_by_rank_0_only(capsys, monkeypatch):
    over = {"root": "/r", "train_files": "a", "actor_rollout_ref.hybrid_engine": "true"}
    build(WorkerConfig, over)
    assert capsys.readouterr().err == (
        "config: ignored actor_rollout_ref.hybrid_engine: tandem is "
        "decoupled: rollout workers and the trainer are always "
        "separate processes\n"
    )
    monkeypatch.setenv("RANK", "1")
    build(WorkerConfig, over)
    assert capsys.readouterr().err == ""


def test_verl_keys_report_counts_every_class(capsys):
    assert verl_keys_main([str(VERL_YAML)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "verl keys are all in verl 0.6, 0.7" in out[0], out[0]  # the fixture: 0.6 and later
    for kind in (verl_keys.APPLIED, verl_keys.IGNORED):
        assert f"{kind}: " in out[-1], out[-1]


def test_pool_validates_the_workers_config_and_passes_it_on():
    from launch.pool import parse

    # The worker resolves a short key (rollout.n's `n` is ambiguous beside val_kwargs.n).
    cfg, worker_args = parse(["root=/r", "pool.id=p", "--config", str(VERL_YAML), "--prompts_per_batch", "2"])
    assert cfg.pool.id == "p"
    assert worker_args == ["--config", str(VERL_YAML), "prompts_per_batch=2"]
    with pytest.raises(ConfigError, match="lora_adapter_path='/a'"):
        parse(["root=/r", "--config", str(VERL_YAML), "actor_rollout_ref.model.lora_adapter_path=/a"])


# --- launch.local with a config ----------------------------------------------------------------


def local_args(**kw):
    base = dict(
        config=str(VERL_YAML),
        model=None,
        data=None,
        steps=None,
        task="copy",
        digits=3,
        trainer=[],
        worker=[],
        val_data=None,
        test_freq=None,
        validator=[],
    )
    return argparse.Namespace(**{**base, **kw})


def test_launch_local_takes_inputs_from_the_config_and_the_recipe_yields_to_it(tmp_path):
    from buffer.run import setup_trainer_run
    from launch import local

    run = setup_trainer_run(str(tmp_path / "run"))
    config = local.from_config(local_args(), run)
    assert config[local.MODEL] == "~/models/Qwen2-7B-Instruct" and config[local.STEPS] == 3
    with pytest.raises(SystemExit, match=r"actor_rollout_ref.model.path in --config .*not found"):
        local.prepare(run, local_args(), config)
    trainer_recipe, worker_recipe = local.recipe(config, local_args())
    assert "data.train_batch_size=16" not in trainer_recipe  # the config sets 4
    assert "trainer.max_staleness=4" in trainer_recipe  # the config leaves it to the recipe
    assert not any(
        a.startswith(("actor_rollout_ref.rollout.n=", "buffer.flush_samples=", "data.max_response_length="))
        for a in worker_recipe
    )
    assert "buffer.max_backlog_samples=256" in worker_recipe


def test_launch_local_with_a_verl_config_runs_end_to_end(tmp_path):
    from rollout import builtin_task

    builtin_task.write_model(tmp_path / "model")
    builtin_task.write_parquet(tmp_path / "train.parquet", builtin_task.make_rows(200, 3))
    root = tmp_path / "run"
    proc = subprocess.run(
        launch_local(
            "--config",
            str(VERL_YAML),
            "--root",
            str(root),
            "--model",
            str(tmp_path / "model"),
            "--data",
            str(tmp_path / "train.parquet"),
            "--timeout",
            "500",
            "--nproc",
            "2",  # rank 0 alone prints the warnings
        ),
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # the config's trainer.total_training_steps
    # train_batch_size 4 groups of rollout.n 4: the config's, not the built-in recipe's 16 x 16
    assert {r["samples/step"] for r in rows} == {16}
    assert max(r["response_length/mean"] for r in rows) <= 3  # data.max_response_length
    printed = [line for line in proc.stderr.splitlines() if line.startswith("config: ")]
    assert warned_keys(printed) == collections.Counter(FIXTURE_WARNED)
    for log in ("trainer", "worker-w0", "worker-w1"):  # the trainer's 2 ranks: rank 0 prints
        lines = [
            line for line in (root / "logs" / f"{log}.log").read_text().splitlines() if line.startswith("config: ")
        ]
        assert warned_keys(lines) == collections.Counter(FIXTURE_WARNED), log


# --- the entry points, as subprocesses ---------------------------------------------------------

CLI_RUNS = {
    "worker_help": ["-m", "rollout.worker", "--help"],
    "trainer_help": ["-m", "trainer.main", "--help"],
    "trainer_bad_steps": [
        "-m",
        "trainer.main",
        "root=/x",
        "trainer.total_training_steps=0",
        "actor_rollout_ref.model.path=/m",
    ],
    "trainer_brief": ["-m", "trainer.main", "root=/x", "trainer.total_training_steps=0"],
    "trainer_verl_lora": [
        "-m",
        "trainer.main",
        "--config",
        "tests/data/verl_grpo.yaml",
        "root=/x",
        "actor_rollout_ref.model.lora_adapter_path=/a",
    ],
    "worker_verl_inf": [
        "-m",
        "rollout.worker",
        "--config",
        "tests/data/verl_grpo.yaml",
        "root=/x",
        "--actor_rollout_ref.rollout.top_p",
        "inf",
    ],
}


@pytest.fixture(scope="module")
def cli_results():
    """Start every CLI run at once (each imports torch: seconds), then collect them all."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO_ROOT,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in CLI_RUNS.items()
    }
    results = {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=120)
            results[name] = (p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return results


def test_worker_help(cli_results):
    rc, out, err = cli_results["worker_help"]
    assert rc == 0, err
    assert out.startswith("usage: python -m rollout.worker")
    assert "actor_rollout_ref.rollout.n (int, default 8" in out
    assert "buffer.flush_interval" in out and "data.train_files" in out


def test_trainer_help(cli_results):
    rc, out, err = cli_results["trainer_help"]
    assert rc == 0, err
    assert out.startswith("usage: python -m trainer.main")
    assert "trainer.total_training_steps (int, default 100; >=1)" in out
    assert "actor_rollout_ref.model.path" in out


def test_trainer_bad_value_exits_2_naming_field(cli_results):
    rc, out, err = cli_results["trainer_bad_steps"]
    assert rc == 2, (out, err)
    assert "config error" in err
    assert "trainer.total_training_steps" in err
    assert "Traceback" not in err


def test_trainer_missing_required_exits_2(cli_results):
    # Without the model path the required-field check fires before bounds are validated,
    # so this command line names the missing actor_rollout_ref.model.path.
    rc, out, err = cli_results["trainer_brief"]
    assert rc == 2, (out, err)
    assert "actor_rollout_ref.model.path: required" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "run,words",
    [
        ("trainer_verl_lora", ["actor_rollout_ref.model.lora_adapter_path='/a'", "saved LoRA adapter"]),
        ("worker_verl_inf", ["actor_rollout_ref.rollout.top_p: must be a finite number"]),
    ],
)
def test_verl_config_errors_exit_2_naming_the_key(cli_results, run, words):
    rc, out, err = cli_results[run]
    assert rc == 2, (out, err)
    assert all(w in err for w in words), err
    assert "Traceback" not in err
