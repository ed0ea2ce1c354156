"""verl's configs of every covered release (protocol/verl_releases/*.json) run unchanged: every key
is applied, ignored with the reason, or refused with the reason, none unknown. The config builds
of every release are fast (no process started); the few end-to-end runs start the real roles."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from conftest import REPO_ROOT, launch_local, subprocess_env

from buffer.run import setup_trainer_run
from protocol import verl_keys
from protocol.config import ConfigError, load
from protocol.verl_keys.__main__ import main as verl_keys_main
from trainer.sft_config import SFTConfig

RELEASES = list(verl_keys.releases())
ROLES = verl_keys.role_schemas()
PPO = [(r, adv) for r in RELEASES for adv in ("grpo", "gae")]
SFT = [
    (r, shape) for r in RELEASES for shape in ("sft_trainer", "sft_trainer_engine") if shape in verl_keys.releases()[r]
]


def _set(cfg: dict, key: str, value) -> None:
    *path, leaf = key.split(".")
    for part in path:
        cfg = cfg.setdefault(part, {})
    cfg[leaf] = value


def ppo_yaml(
    tmp_path, release: str, adv: str, model="/tiny/model", train="/tiny/train.parquet", val="/tiny/val.parquet"
) -> str:
    """The release's full PPO config, its model and data pointed at the tiny model's, the
    engine at the CPU one (verl's default is vLLM) and the advantage estimator chosen."""
    cfg = verl_keys.release_config(release, "ppo_trainer")
    for key, value in {
        "actor_rollout_ref.model.path": model,
        "data.train_files": [train],
        "data.val_files": [val],
        "algorithm.adv_estimator": adv,
        "actor_rollout_ref.rollout.name": "hf",
    }.items():
        _set(cfg, key, value)
    if "path" in cfg.get("critic", {}).get("model", {}):
        _set(cfg, "critic.model.path", model)
    if cfg.get("trainer", {}).get("device"):
        _set(cfg, "trainer.device", "auto")  # verl's cuda, on a CPU machine too
    path = tmp_path / f"ppo-{release}-{adv}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def sft_yaml(
    tmp_path, release: str, shape: str, model="/tiny/model", train="/tiny/sft.parquet", val="/tiny/sft_val.parquet"
) -> str:
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
    overrides = {
        k: yaml.safe_load(v) if v else v
        for k, v in verl_keys.example_keys(data, sft)[script].items()
        if shell or "$" not in v
    }
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


# --- the defects found with verl's configs (each in-process: no process started) -------------


def local_args(tmp_path, config: str, **kw):
    import argparse

    base = dict(
        config=config,
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
        sft=[],
        sft_config=None,
        sft_steps=0,
    )
    return argparse.Namespace(**{**base, **kw})


def test_launch_local_takes_verls_single_path_val_files_as_one_file(tmp_path):
    from buffer.run import setup_trainer_run
    from launch import local

    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train_files: /d/train.parquet\n  val_files: /d/test.parquet\ntrainer:\n  test_freq: 5\n")
    args = local_args(tmp_path, str(path))
    run = setup_trainer_run(str(tmp_path / "run"))
    config = local.from_config(args, run)
    assert config[local.VAL_FILES] == ["/d/test.parquet"]  # not its characters
    args.steps, args.test_freq = 3, 5
    _, _, validator = local.role_args(run, args, "/m", None, config, config[local.VAL_FILES])
    assert "data.val_files=[/d/test.parquet]" in validator


def test_launch_local_names_the_field_of_a_wrong_type_in_the_file(tmp_path):
    from buffer.run import setup_trainer_run
    from launch import local

    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  test_freq: five\n")
    with pytest.raises(
        SystemExit,
        match=r"trainer\.test_freq in --config .*c\.yaml: expected an "
        r"integer, got 'five'",
    ):
        local.from_config(local_args(tmp_path, str(path)), setup_trainer_run(str(tmp_path / "run")))


def _check_config_error(capsys, *role_argv) -> str:
    from launch import local

    with pytest.raises(SystemExit) as e:
        local.check_config(*role_argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_trainer_device_cuda_without_a_gpu_is_one_line(capsys):
    from trainer.main import init_distributed

    err = _check_config_error(
        capsys,
        ["root=/r", "actor_rollout_ref.model.path=/m", "trainer.device=cuda"],
        ["root=/r", "data.train_files=[a]"],
        None,
    )
    assert "trainer.device=cuda: no CUDA GPU is visible here" in err
    with pytest.raises(SystemExit) as e:  # the trainer and trainer.sft themselves, before CUDA
        init_distributed("cuda", 10)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().startswith("config error: trainer.device=cuda: no CUDA GPU")


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_engine_without_vllm_is_refused_at_start(tmp_path, capsys):
    from rollout import worker

    worker_argv = ["root=/r", "data.train_files=[a]", "actor_rollout_ref.rollout.name=vllm"]
    err = _check_config_error(capsys, ["root=/r", "actor_rollout_ref.model.path=/m"], worker_argv, None)
    assert "actor_rollout_ref.rollout.name=vllm: vLLM is not installed" in err
    # the worker itself, before it waits for the trainer's first weight version
    assert worker.main([f"root={tmp_path}", "data.train_files=[a]", "actor_rollout_ref.rollout.name=vllm"]) == 2
    assert "vLLM is not installed" in capsys.readouterr().err
    assert not (tmp_path / "workers").exists()


def test_verl_keys_help_and_a_file_of_an_old_release(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        verl_keys_main(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m protocol.verl_keys")
    assert verl_keys_main([ppo_yaml(tmp_path, "0.3", "grpo")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "verl keys are all in verl 0.3" in out[0], out[0]
    assert any(line.startswith("ignored  critic.model.tokenizer_path  (the critic is not used") for line in out)
    assert verl_keys_main([sft_yaml(tmp_path, "0.3", "sft_trainer")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "a verl SFT config" in out[0] and "0.3" in out[0], out[0]
    assert any(line.startswith("ignored  data.micro_batch_size  (deprecated") for line in out)


BASE = {"root": "/r", "actor_rollout_ref.model.path": "/m"}


def test_deprecated_spellings_map_as_verl_mapped_them(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # verl divides the global size by the GPU count
    cfg, lines = load(
        ROLES[0],
        {
            **BASE,
            "actor_rollout_ref.actor.ppo_micro_batch_size": "64",
            "trainer.remove_previous_ckpt_in_save": "true",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size": "8",
        },
    )
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 32
    assert cfg.trainer.max_ckpt_to_keep == 1
    assert (
        "actor_rollout_ref.actor.ppo_micro_batch_size is deprecated: read as "
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32, as verl does" in lines
    )
    assert any(
        line.startswith("ignored actor_rollout_ref.rollout.log_prob_micro_batch_size: deprecated spelling")
        for line in lines
    ), lines


@pytest.mark.parametrize(
    "unused,used,key,value",
    [
        (
            {"algorithm.adv_estimator": "grpo"},
            {"algorithm.adv_estimator": "gae"},
            "critic.model.tokenizer_path",
            "/another/tokenizer",
        ),
        ({"algorithm.adv_estimator": "grpo"}, {"critic.enable": "true"}, "critic.strategy", "megatron"),
        ({"reward_model.enable": "false"}, {"reward_model.enable": "true"}, "reward_model.strategy", "megatron"),
    ],
)
def test_a_section_the_config_does_not_use_never_refuses(unused, used, key, value):
    for cls in ROLES:
        _, lines = load(cls, {**BASE, "data.train_files": "[a]", "data.val_files": "[a]", **unused, key: value})
        assert any(
            line.startswith(f"ignored {key}: ") and ("is not used" in line or "is false" in line) for line in lines
        ), lines
    with pytest.raises(ConfigError, match=rf"^({key}|reward_model.enable)=.*not supported"):
        load(ROLES[0], {**BASE, **used, key: value})


def test_the_critic_may_name_the_actors_tokenizer():
    # verl's default for every release: critic.model.tokenizer_path: ${actor_rollout_ref.model.path}
    cfg, _ = load(
        ROLES[0],
        {**BASE, "algorithm.adv_estimator": "gae", "critic.model.tokenizer_path": "${actor_rollout_ref.model.path}"},
    )
    assert cfg.use_critic


# --- a few real runs: one per config shape, tiny steps -----------------------------------------

TINY = {
    "data.train_batch_size": 4,
    "data.max_response_length": 3,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
    "actor_rollout_ref.rollout.n": 4,
    "trainer.logger": ["console"],
}  # verl's default adds wandb, which needs an account
TINY_SFT = {"data.train_batch_size": 16, "data.max_length": 8, "trainer.logger": ["console"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The built-in tiny model and task, as SFT and RL parquets."""
    from rollout import builtin_task

    out = tmp_path_factory.mktemp("tiny")
    builtin_task.write_model(out / "model")
    paths = {(k, s): str(out / f"{k}_{s}.parquet") for k in ("sft", "rl") for s in ("train", "val")}
    builtin_task.write_sft_and_rl(paths, num=200)
    return out


def _with(path: str, values: dict) -> str:
    cfg = yaml.safe_load(open(path))
    for key, value in values.items():
        _set(cfg, key, value)
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def tiny_ppo(tmp_path, tiny, release, adv) -> str:
    return _with(
        ppo_yaml(
            tmp_path, release, adv, str(tiny / "model"), str(tiny / "rl_train.parquet"), str(tiny / "rl_val.parquet")
        ),
        TINY,
    )


def tiny_sft(tmp_path, tiny, release: str, shape: str) -> str:
    paths = (str(tiny / "model"), str(tiny / "sft_train.parquet"), str(tiny / "sft_val.parquet"))
    return _with(sft_yaml(tmp_path, release, shape, *paths), TINY_SFT)


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path).read().splitlines()]


# (PPO release and estimator, SFT release and shape): the oldest and the newest of each shape
E2E = [("0.3", "grpo", "0.3", "sft_trainer"), ("0.9", "gae", "0.9", "sft_trainer_engine")]


@pytest.mark.parametrize("release,adv,sft_release,shape", E2E, ids=[f"{r}-{a}+{s}" for r, a, _, s in E2E])
def test_release_configs_run_through_launch_local(tmp_path, tiny, release, adv, sft_release, shape):
    """The release's PPO config and its SFT config, as they are but for the tiny model, its
    data and tiny sizes: SFT warm start, then RL, through `launch.local --config`."""
    ppo = tiny_ppo(tmp_path, tiny, release, adv)
    sft = tiny_sft(tmp_path, tiny, sft_release, shape)
    root = tmp_path / "run"
    proc = subprocess.run(
        launch_local(
            "--root",
            str(root),
            "--config",
            ppo,
            "--sft-config",
            sft,
            "--sft-steps",
            "2",
            "--steps",
            "2",
            "--workers",
            "1",
            "--nproc",
            "1",
            "--timeout",
            "400",
        ),
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "unknown config key" not in proc.stderr and "config error" not in proc.stderr
    assert [r["step"] for r in _rows(root / "sft" / "metrics.jsonl")] == [1, 2]
    rows = _rows(root / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and {r["samples/step"] for r in rows} == {16}
    assert all(("critic/vf_loss" in r) == (adv == "gae") for r in rows)


# --- every release through the roles' entry points, in this process: one step each -----------
# The roles' main() with the arguments a user (or launch.local) gives them, in the pytest process
# so that no interpreter starts and imports torch again (~10 s a process): the trainer in a
# thread as rank 0 of a 1-rank gloo job (torchrun's environment, set here), the worker in the
# main thread (it installs its signal handlers) with worker.max_batches=1, exactly one step's
# groups, so it ends by itself whatever the trainer does.

ONE_STEP = ["actor_rollout_ref.rollout.prompts_per_batch=4", "worker.max_batches=1", "buffer.flush_interval=1"]
# the trainer: left without experience it fails, not hangs; it looks for shards every 0.1 s
BOUNDED = ["trainer.data_timeout_s=120", "buffer.poll_interval=0.1"]
ROLE_TIMEOUT_S = 240  # 1 step of the tiny model takes ~2 s; the rest is margin for a loaded box


def _as_rank0(monkeypatch) -> None:
    from conftest import free_port

    for key, value in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    ).items():
        monkeypatch.setenv(key, value)


def sft_here(monkeypatch, argv: list[str]) -> None:
    from trainer import sft

    _as_rank0(monkeypatch)
    assert sft.main(argv) == 0


def rl_here(monkeypatch, trainer_argv: list[str], worker_argv: list[str]) -> None:
    """trainer.main and rollout.worker, each with its own arguments, to the end of the run."""
    import signal
    import threading

    import torch

    from rollout import worker
    from trainer import main as trainer

    _as_rank0(monkeypatch)
    result: dict = {}

    def run_trainer():
        try:
            result["code"] = trainer.main([*trainer_argv, *BOUNDED])
        except BaseException as e:  # SystemExit too: reported by the test, not lost in the thread
            result["error"] = e

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    threads = torch.get_num_threads()
    thread = threading.Thread(target=run_trainer, name="trainer", daemon=True)
    thread.start()
    try:
        assert worker.main([*worker_argv, *ONE_STEP, "worker.weights_timeout_s=120"]) == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        thread.join(ROLE_TIMEOUT_S)
        torch.set_num_threads(threads)
    assert not thread.is_alive(), f"the trainer did not finish within {ROLE_TIMEOUT_S} s"
    if "error" in result:
        raise result["error"]
    assert result["code"] == 0


def assert_one_step(root, adv: str) -> None:
    [row] = _rows(root / "metrics.jsonl")
    assert row["step"] == 1 and row["samples/step"] == 16
    assert ("critic/vf_loss" in row) == ("perf/mfu/critic" in row) == (adv == "gae")
    assert row["perf/mfu/actor"] > 0 and row.get("perf/mfu/critic", 1) > 0  # verl knows the CPU's peak
    # timing_s/gen: the worker's one batch, as it timed its generation, plus one reward; the
    # trainer waited for it from before the worker saw v0 until its shard was flushed
    [beat] = setup_trainer_run(str(root)).heartbeats.all()
    assert beat["generate_s"] < row["timing_s/gen"] < row["time/wait_s"]


@pytest.mark.parametrize("release", RELEASES)
def test_release_configs_run_through_the_roles(tmp_path, tiny, monkeypatch, capsys, release):
    """The release's GRPO config and its SFT config as launch.local would run them (its own
    arguments for every role: SFT 1 step, then RL 1 step from the SFT model); its GAE config and
    its other SFT shape by hand (--config plus the run's own keys). No key unknown."""
    from launch import local

    shapes = [shape for _, shape in SFT if _ == release]
    args = local.parse_args(
        [
            *("--root", str(tmp_path / "local"), "--config", tiny_ppo(tmp_path, tiny, release, "grpo")),
            *("--sft-config", tiny_sft(tmp_path, tiny, release, shapes[0]), "--sft-steps", "1", "--steps", "1"),
            *("--workers", "1", "--nproc", "1"),
        ]
    )
    plan = local.plan(args)  # every role's config built, as launch.local does before starting any
    assert plan.sft is not None
    sft_here(monkeypatch, plan.sft)
    model = setup_trainer_run(plan.run.files.sft_dir).files.hf_model
    trainer_args, worker_args, validator_args = local.role_args(plan.run, args, model, plan.data, plan.config, plan.val)
    assert validator_args is None  # the release's trainer.test_freq: -1
    rl_here(monkeypatch, trainer_args, local.worker_command(0, worker_args))
    assert_one_step(tmp_path / "local", "grpo")

    root = tmp_path / "by_hand"
    common = ["--config", tiny_ppo(tmp_path, tiny, release, "gae"), f"root={root}", "trainer.total_training_steps=1"]
    rl_here(monkeypatch, common, [*common, "worker.id=w0"])
    assert_one_step(root, "gae")
    for shape in shapes[1:]:
        sft_dir = tmp_path / f"sft-{shape}"
        sft_here(
            monkeypatch,
            [
                *("--config", tiny_sft(tmp_path, tiny, release, shape)),
                *(f"trainer.default_local_dir={sft_dir}", "trainer.total_training_steps=1"),
            ],
        )
        assert [r["step"] for r in _rows(sft_dir / "metrics.jsonl")] == [1]
    out = capsys.readouterr()
    assert "unknown config key" not in out.out + out.err and "config: ignored critic." in out.err
