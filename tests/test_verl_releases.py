"""verl's configs of every covered release (protocol/verl_releases/*.json) run unchanged: every key
is applied, ignored with the reason, or refused with the reason, none unknown. The config builds
of every release are fast (no process started); the few end-to-end runs start the real roles."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from conftest import REPO_ROOT, subprocess_env
from protocol import verl_keys
from protocol.config import ConfigError, load
from trainer.sft_config import SFTConfig

RELEASES = list(verl_keys.releases())
ROLES = verl_keys.role_schemas()
PPO = [(r, adv) for r in RELEASES for adv in ("grpo", "gae")]
SFT = [(r, shape) for r in RELEASES for shape in ("sft_trainer", "sft_trainer_engine")
       if shape in verl_keys.releases()[r]]


def _set(cfg: dict, key: str, value) -> None:
    *path, leaf = key.split(".")
    for part in path:
        cfg = cfg.setdefault(part, {})
    cfg[leaf] = value


def ppo_yaml(tmp_path, release: str, adv: str, model="/tiny/model", train="/tiny/train.parquet",
             val="/tiny/val.parquet") -> str:
    """The release's full PPO config, its model and data pointed at the tiny model's, the
    engine at the CPU one (verl's default is vLLM) and the advantage estimator chosen."""
    cfg = verl_keys.release_config(release, "ppo_trainer")
    for key, value in {"actor_rollout_ref.model.path": model, "data.train_files": [train],
                       "data.val_files": [val], "algorithm.adv_estimator": adv,
                       "actor_rollout_ref.rollout.name": "hf"}.items():
        _set(cfg, key, value)
    if "path" in cfg.get("critic", {}).get("model", {}):
        _set(cfg, "critic.model.path", model)
    if cfg.get("trainer", {}).get("device"):
        _set(cfg, "trainer.device", "auto")  # verl's cuda, on a CPU machine too
    path = tmp_path / f"ppo-{release}-{adv}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def sft_yaml(tmp_path, release: str, shape: str, model="/tiny/model", train="/tiny/sft.parquet",
             val="/tiny/sft_val.parquet") -> str:
    cfg = verl_keys.release_config(release, shape)
    _set(cfg, "model.path" if shape == "sft_trainer_engine" else "model.partial_pretrain", model)
    _set(cfg, "data.train_files", [train])
    _set(cfg, "data.val_files", [val])
    for key in ("prompt_key", "response_key"):  # verl's defaults name gsm8k's columns
        if key in cfg["data"]:
            _set(cfg, f"data.{key}", key.split("_")[0])
    if cfg.get("trainer", {}).get("device"):
        _set(cfg, "trainer.device", "auto")
    path = tmp_path / f"{shape}-{release}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def assert_all_treated(verdicts: dict, allowed=(verl_keys.APPLIED, verl_keys.IGNORED)) -> None:
    bad = {k: (t.verdict, t.reason) for k, t in verdicts.items() if t.verdict not in allowed}
    assert not bad, bad
    for key, t in verdicts.items():
        assert t.verdict == verl_keys.APPLIED or t.reason, key  # every ignored key says why


# --- fast: every release's configs build, every key treated -------------------------------------

@pytest.mark.parametrize("release,adv", PPO)
def test_release_ppo_config_builds_every_role(tmp_path, release, adv):
    path, verdicts = ppo_yaml(tmp_path, release, adv), {}
    built = {}
    for cls in ROLES:
        built[cls], lines = load(cls, {"root": "/run"}, path, verdicts)
        assert all(line.startswith("ignored ") or " is deprecated: read as " in line for line in lines), lines
        assert built[cls].actor_rollout_ref.model.path == "/tiny/model"
    assert_all_treated(verdicts)
    assert set(verdicts) == {"root", *verl_keys.releases()[release]["ppo_trainer"]}  # every key judged
    assert built[ROLES[0]].use_critic == (adv == "gae")


@pytest.mark.parametrize("release,shape", SFT)
def test_release_sft_config_builds(tmp_path, release, shape):
    path, verdicts = sft_yaml(tmp_path, release, shape), {}
    cfg, _ = load(SFTConfig, {}, path, verdicts)
    assert_all_treated(verdicts)
    assert cfg.model.partial_pretrain == "/tiny/model"
    assert cfg.data.train_files == ["/tiny/sft.parquet"]


def example_cases():
    for release, data in verl_keys.releases().items():
        for sft in (False, True):
            for script in verl_keys.example_keys(data, sft):
                yield pytest.param(release, script, sft, id=f"{release}:{script}")


def test_every_release_has_examples_and_configs():
    covered = {r for r, _, _ in (c.values for c in example_cases())}
    assert {"0.3", "0.4", "0.5", "0.6", "0.7"} <= covered
    assert {r for r, _ in PPO} == set(RELEASES) and len(RELEASES) >= 8


def _example(release: str, script: str, sft: bool, shell: bool = True) -> tuple[dict, dict]:
    """(the script's overrides parsed as the command line parses them, the flat config they
    apply to); without `shell`, less those whose value the shell sets ($VAR)."""
    data = verl_keys.releases()[release]
    shape = "ppo_trainer" if not sft else "sft_trainer" if "sft_trainer" in data else "sft_trainer_engine"
    overrides = {k: yaml.safe_load(v) if v else v for k, v in verl_keys.example_keys(data, sft)[script].items()
                 if shell or "$" not in v}
    return overrides, {**data[shape], **overrides}


@pytest.mark.parametrize("release", RELEASES)
def test_release_example_overrides_are_treated(release):
    """Every key=value of the release's example scripts, over its config: no key unknown, each
    not applied says why (fast: no config is built; the build is checked below)."""
    data = verl_keys.releases()[release]
    for sft in (False, True):
        for script in verl_keys.example_keys(data, sft):
            overrides, values = _example(release, script, sft)
            verdicts = verl_keys.treat_flat(overrides, values, sft)
            assert_all_treated(verdicts, (verl_keys.APPLIED, verl_keys.IGNORED, verl_keys.REFUSED))


def first_examples():
    """Per release: its first GRPO and first SFT script that runs unchanged and the first that
    is refused (the build agrees with the fast treatment both ways)."""
    for release, data in verl_keys.releases().items():
        for sft in (False, True):
            found = {}
            for script in verl_keys.example_keys(data, sft):
                overrides, values = _example(release, script, sft, shell=False)
                if not sft and values.get("algorithm.adv_estimator") != "grpo":
                    continue
                verdicts = verl_keys.treat_flat(overrides, values, sft)
                found.setdefault(any(t.verdict == verl_keys.REFUSED for t in verdicts.values()), script)
            for refused, script in sorted(found.items()):
                yield pytest.param(release, script, sft, refused, id=f"{release}:{script}")


PATHS = ("model.path", "partial_pretrain", "train_files", "val_files", "default_local_dir")


@pytest.mark.parametrize("release,script,sft,refused", list(first_examples()))
def test_release_example_builds_as_treated(tmp_path, release, script, sft, refused):
    overrides, values = _example(release, script, sft, shell=False)
    verdicts = verl_keys.treat_flat(overrides, values, sft)
    over = {k: v for k, v in overrides.items() if not k.endswith(PATHS)}  # the tiny model's
    data = verl_keys.releases()[release]
    if sft:
        shape = "sft_trainer" if "sft_trainer" in data else "sft_trainer_engine"
        cls, path = SFTConfig, sft_yaml(tmp_path, release, shape)
    else:
        cls, path, over = ROLES[0], ppo_yaml(tmp_path, release, "grpo"), {"root": "/run", **over}
    if refused:
        names = [k for k, t in verdicts.items() if t.verdict == verl_keys.REFUSED]
        with pytest.raises(ConfigError, match="not supported") as e:
            load(cls, over, path)
        assert str(e.value).startswith(tuple(f"{k}=" for k in names)), (str(e.value), names)
    else:
        load(cls, over, path)
