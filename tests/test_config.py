"""protocol.config: building nested dataclass configs from YAML and dotted overrides, and the CLIs."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from buffer.config import BufferConfig
from conftest import REPO_ROOT, subprocess_env
from protocol.config import ConfigError, F, build, parse_cli, split_argv, to_dict, usage
from rollout.config import WorkerConfig
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
    cfg = build(Outer, {"name": "x", "inner.flush_interval": "2.5", "inner.mode": "slow",
                        "other.count": "4", "other.enabled": "false", "limit": "7"})
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


@pytest.mark.parametrize("key,value,field", [
    ("count", "0", "count"),
    ("count", "11", "count"),
    ("inner.flush_interval", "0", "inner.flush_interval"),
    ("inner.ratio", "1.5", "inner.ratio"),
    ("inner.mode", "medium", "inner.mode"),
    ("limit", "-1", "limit"),
    ("other.count", "abc", "other.count"),
    ("other.enabled", "maybe", "other.enabled"),
])
def test_bad_values_name_the_dotted_field(key, value, field):
    with pytest.raises(ConfigError) as e:
        build(Outer, {"name": "x", key: value})
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_list_parsing():
    assert build(Outer, {"name": "x", "tags": "[a,b]"}).inner.tags == ["a", "b"]
    assert build(Outer, {"name": "x", "tags": "a,b,c"}).inner.tags == ["a", "b", "c"]
    assert build(Outer, {"name": "x", "tags": "solo"}).inner.tags == ["solo"]
    assert build(Outer, {"name": "x", "tags": ["p", "q"]}).inner.tags == ["p", "q"]


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("name: from-yaml\n"
                    "count: 3\n"
                    "inner:\n  mode: slow\n  tags: [u, v]\n"
                    "enabled: false\n"          # a unique leaf name also works in YAML
                    "flush_interval: 9\n")
    cfg = build(Outer, yaml_file=path)
    assert cfg.name == "from-yaml" and cfg.count == 3
    assert cfg.inner.mode == "slow" and cfg.inner.tags == ["u", "v"]
    assert cfg.other.enabled is False
    assert cfg.inner.flush_interval == 9.0
    # overrides win over the file
    cfg = build(Outer, {"count": "4", "inner.flush_interval": "1.5"}, yaml_file=path)
    assert cfg.count == 4 and cfg.inner.flush_interval == 1.5 and cfg.name == "from-yaml"


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
    cfg = build(TrainerConfig, {**TRAINER_REQ, "trainer.total_training_steps": "7",
                                "flush_interval": "3", "buffer.flush_samples": "64",
                                "algorithm.norm_adv_by_std_in_grpo": "false",
                                "actor_rollout_ref.actor.optim.betas": "[0.5, 0.75]"})
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


@pytest.mark.parametrize("key,value", [
    ("trainer.total_training_steps", "0"),
    ("trainer.max_staleness", "-1"),
    ("buffer.flush_interval", "0"),
    ("actor_rollout_ref.actor.clip_ratio", "1.5"),
    ("actor_rollout_ref.actor.loss_agg_mode", "sum"),
    ("data.train_batch_size", "x"),
])
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
    cfg = build(WorkerConfig, {"root": "/r", "data.train_files": "[a.parquet,b.parquet]",
                               "actor_rollout_ref.rollout.n": "4", "worker.id": "w-1"})
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.custom_reward_function.path is None
    with pytest.raises(ConfigError, match=r"^data\.train_files"):
        build(WorkerConfig, {"root": "/r"})
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.top_p:"):
        build(WorkerConfig, {"root": "/r", "train_files": "a",
                             "actor_rollout_ref.rollout.top_p": "1.01"})


@pytest.mark.parametrize("text", ["3.5", "true"])
def test_int_field_rejects_non_integer_string(text):
    with pytest.raises(ConfigError, match=r"^flush_samples:"):
        build(BufferConfig, {"flush_samples": text})


def test_int_field_rejects_non_integer_float():
    with pytest.raises(ConfigError, match=r"^flush_samples:"):
        build(BufferConfig, {"flush_samples": 3.5})


def test_split_argv_forms():
    overrides, yaml_file, wants_help = split_argv(
        ["a.b=1", "--c.d=2", "--e", "3", "--config", "f.yaml"])
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
    for name in ("name", "count", "limit", "inner.flush_interval", "inner.mode", "inner.tags",
                 "inner.ratio", "other.count", "other.enabled"):
        assert f"\n  {name} (" in text
    assert "REQUIRED" in text and ">=1" in text and "<=10" in text and "one of fast|slow" in text


# --- the entry points, as subprocesses ---------------------------------------------------------

CLI_RUNS = {
    "worker_help": ["-m", "rollout.worker", "--help"],
    "trainer_help": ["-m", "trainer.main", "--help"],
    "trainer_bad_steps": ["-m", "trainer.main", "root=/x", "trainer.total_training_steps=0",
                          "actor_rollout_ref.model.path=/m"],
    "trainer_brief": ["-m", "trainer.main", "root=/x", "trainer.total_training_steps=0"],
}


@pytest.fixture(scope="module")
def cli_results():
    """Start every CLI run at once (each imports torch: seconds), then collect them all."""
    procs = {name: subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, env=subprocess_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in CLI_RUNS.items()}
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
