"""Adapter-only (LoRA) weight versions on the rollout side (issue 27), with the real tiny model:
the worker applies each version to its base in place through PEFT and samples with the
trainer's policy; a version for another base is refused loudly (log, heartbeat, exit 2,
launch.status), never sampled from; adapter versions travel over the network store as they are."""

import json
import subprocess
import sys
import time

import pytest
import torch
from conftest import fetch_at_once, free_port, subprocess_env
from lora_helpers import make_adapter, publish_adapter, trainer_logprobs

from buffer.config import BufferConfig
from buffer.run import setup_trainer_run
from buffer.weights.fs import WeightStore
from protocol.config import build
from protocol.weights import base_checksum
from rollout import builtin_task
from rollout.config import WorkerConfig
from rollout.versions import Refused
from rollout.worker import RolloutWorker

TEMPERATURE = 0.9
# The worker's logprobs come from PEFT's LoRA layers in cached decoding (transformers' generate,
# float32), the trainer's from a full forward of the same float32 PEFT model through
# trainer/algo.py: the same maths in another order of sums. |logprob| <= ~4 here, float32 rounding
# ~1e-6 relative: measured <= 4.8e-7 (two ulps); 1e-4 leaves 200x for other CPUs' kernels. The other adapters
# (and the bare base) differ by > 0.05 on these tokens (asserted), so 1e-4 tells them apart.
LOGPROB_ATOL = 1e-4
APART = 100 * LOGPROB_ATOL


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_models")
    builtin_task.write_model(d / "base", seed=0)
    builtin_task.write_model(d / "other_base", seed=1)
    builtin_task.write_parquet(d / "t.parquet", builtin_task.make_rows(40, 3))
    return d


def _cfg(root, models, **extra):
    args = {
        "root": str(root),
        "train_files": f"[{models / 't.parquet'}]",
        "worker.id": "w0",
        "max_response_length": "6",
        "actor_rollout_ref.rollout.n": "3",
        "prompts_per_batch": "4",
        "actor_rollout_ref.rollout.temperature": str(TEMPERATURE),
        "actor_rollout_ref.model.path": str(models / "base"),
        **extra,
    }
    return build(WorkerConfig, args)


def _check_policy(batch, model, others):
    """Every sampled token's behaviour logprob is `model`'s (the trainer's function), and not
    any of `others`'."""
    apart = 0.0
    for prompt, group in zip(batch.prompts, batch.groups):
        for c in group:
            mine = trainer_logprobs(model, prompt.token_ids, c.token_ids, TEMPERATURE)
            assert c.logprobs == pytest.approx(mine, abs=LOGPROB_ATOL)
            for other in others:
                theirs = trainer_logprobs(other, prompt.token_ids, c.token_ids, TEMPERATURE)
                apart = max(apart, max(abs(a - b) for a, b in zip(mine, theirs)))
    assert apart > APART, f"the policies differ by {apart:.2e} only: the test proves nothing"


def test_worker_samples_each_adapter_version_as_the_trainer_computes_it(tmp_path, models):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(models / "base").eval()
    a = make_adapter(models / "base", tmp_path / "a", seed=1)
    b = make_adapter(models / "base", tmp_path / "b", seed=2)
    store = WeightStore(str(tmp_path / "run"))
    publish_adapter(store, tmp_path / "a", models / "base", 0)
    worker = RolloutWorker(_cfg(tmp_path / "run", models))
    assert worker.start() and worker.version == 0
    assert worker.engine.adapter == "v0" and set(worker.engine.model.peft_config) == {"v0"}
    _check_policy(worker.generate_batch(), a, [base, b])

    store.publish_full_freq = 4  # deltas on: an adapter version is published as it is all the same
    publish_adapter(store, tmp_path / "b", models / "base", 1)
    assert worker.maybe_reload() and worker.version == 1
    assert set(worker.engine.model.peft_config) == {"v1"}  # the old adapter is dropped
    _check_policy(worker.generate_batch(), b, [base, a])
    assert worker.reloads == 1 and worker.last_reload["version"] == 1
    assert worker.store.manifest(1).delta is None  # an adapter version is never a delta


def test_an_adapter_for_another_base_is_refused_before_anything_loads(tmp_path, models):
    make_adapter(models / "other_base", tmp_path / "a", seed=1)
    store = WeightStore(str(tmp_path / "run"))
    publish_adapter(store, tmp_path / "a", models / "other_base", 0)
    worker = RolloutWorker(_cfg(tmp_path / "run", models))
    with pytest.raises(Refused) as e:
        worker.start()
    mine, theirs = base_checksum(models / "base"), base_checksum(models / "other_base")
    assert mine in str(e.value) and theirs in str(e.value)
    assert e.value.details | {"reason": None} == {
        "reason": None,
        "version": 0,
        "version_base": theirs,
        "worker_base": mine,
        "model_path": str(models / "base"),
    }
    assert worker.engine is None  # no engine was built: nothing sampled

    # without a base folder at all (model.path unset) the refusal says what is missing
    worker = RolloutWorker(_cfg(tmp_path / "run", models, **{"actor_rollout_ref.model.path": ""}))
    with pytest.raises(Refused, match="actor_rollout_ref.model.path is not set"):
        worker.start()


def test_a_run_that_switches_from_adapters_to_full_weights_is_refused(tmp_path, models):
    make_adapter(models / "base", tmp_path / "a", seed=1)
    store = WeightStore(str(tmp_path / "run"))
    publish_adapter(store, tmp_path / "a", models / "base", 0)
    worker = RolloutWorker(_cfg(tmp_path / "run", models))
    assert worker.start()
    store.publish_hf_folder(models / "base", 1, 1, keep=4)
    with pytest.raises(Refused, match="weight version 1 is full weights but this run's earlier versions were adapter"):
        worker.maybe_reload()
    assert worker.version == 0 and set(worker.engine.model.peft_config) == {"v0"}  # nothing loaded


def _wait(what, cond, proc, timeout_s=300):
    deadline, note = time.monotonic() + timeout_s, time.monotonic()
    while not cond():
        assert proc.poll() is None or what.startswith("exit"), f"the worker exited {proc.returncode} before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        if time.monotonic() - note > 30:
            print(f"still waiting for {what}", flush=True)
            note = time.monotonic()
        time.sleep(0.1)


def test_a_worker_process_refuses_a_mismatched_base_exits_2_and_status_shows_refused(tmp_path, models):
    """A real worker process runs on adapter v0 of its base; v1 is an adapter of another base:
    the worker refuses it (log and heartbeat name both checksums), exits 2 (what launch.local
    never restarts: launch/local.py REFUSED), and launch.status shows it REFUSED."""
    root = tmp_path / "run"
    make_adapter(models / "base", tmp_path / "a", seed=1)
    make_adapter(models / "other_base", tmp_path / "b", seed=2)
    store = WeightStore(str(root))
    publish_adapter(store, tmp_path / "a", models / "base", 0)
    beat_path = root / "workers" / "w0.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout.worker",
            f"root={root}",
            f"data.train_files=[{models / 't.parquet'}]",
            "worker.id=w0",
            f"actor_rollout_ref.model.path={models / 'base'}",
            "data.max_response_length=6",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.prompts_per_batch=2",
            "buffer.flush_samples=4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    )
    try:
        _wait(
            "a batch on v0",
            lambda: beat_path.exists() and json.loads(beat_path.read_text()).get("batches", 0) >= 1,
            proc,
        )
        publish_adapter(store, tmp_path / "b", models / "other_base", 1)
        out, _ = proc.communicate(timeout=180)  # it refuses at its next reload, a batch later
    finally:
        if proc.poll() is None:
            proc.kill()
    mine, theirs = base_checksum(models / "base"), base_checksum(models / "other_base")
    assert proc.returncode == 2, out[-3000:]
    assert "refused: weight version 1 is an adapter for the base with checksum " + theirs in out, out[-3000:]
    assert mine in out
    beat = json.loads(beat_path.read_text())
    assert beat["state"] == "stopped" and beat["weight_version"] == 0
    assert beat["refused"]["version_base"] == theirs and beat["refused"]["worker_base"] == mine
    assert beat["versions_loaded"] == [0]  # v1 never loaded

    status = subprocess.run(
        [sys.executable, "-m", "launch.status", str(root), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    [w0] = json.loads(status.stdout)["workers"]
    assert w0["state"] == "REFUSED" and theirs in w0["refused"]["reason"], w0
    text = subprocess.run(
        [sys.executable, "-m", "launch.status", str(root), "--once"],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    ).stdout
    assert "REFUSED" in text and theirs in text.replace("\n", ""), text


def test_adapter_versions_over_the_network_store(tmp_path, models):
    """The trainer's run service and weight service (real gRPC on loopback) serve adapter
    versions; the worker fetches each into its own cache, verifies it and applies it."""
    port = free_port()
    (tmp_path / "token").write_text("lora-token")
    grpc = {
        "transport": "grpc",
        "grpc_bind": f"127.0.0.1:{port}",
        "grpc_address": f"127.0.0.1:{port}",
        "grpc_token_file": str(tmp_path / "token"),
        "grpc_timeout_s": 10,
        "weights_peer_host": "127.0.0.1",
    }
    trainer_root = tmp_path / "trainer"
    trainer = setup_trainer_run(str(trainer_root))
    trainer.state.ensure_run_id()
    server = trainer.serve(BufferConfig(**grpc))
    a = make_adapter(models / "base", tmp_path / "a", seed=1)
    b = make_adapter(models / "base", tmp_path / "b", seed=2)
    store = WeightStore(str(trainer_root))
    publish_adapter(store, tmp_path / "a", models / "base", 0)
    worker = RolloutWorker(_cfg(tmp_path / "w0", models, **{f"buffer.{k}": str(v) for k, v in grpc.items()}))
    try:
        assert worker.start() and worker.version == 0
        _check_policy(worker.generate_batch(), a, [b])
        publish_adapter(store, tmp_path / "b", models / "base", 1)
        deadline = time.monotonic() + 120
        while not worker.maybe_reload():  # the background fetch brings v1; generating goes on meanwhile
            assert time.monotonic() < deadline, "v1 did not arrive over the network within 120 s"
            time.sleep(0.1)
        cached = tmp_path / "w0" / "weights"
        assert (cached / "v000001" / "adapter_model.safetensors").exists(), sorted(p.name for p in cached.iterdir())
        assert set(worker.engine.model.peft_config) == {"v1"}
        _check_policy(worker.generate_batch(), b, [a])
    finally:
        worker.store.close()
        server.stop()


def test_adapter_versions_fan_out_between_peers(tmp_path):
    """Two workers fetch an adapter version at once from a trainer whose uplink is slow: chunks
    flow between the workers' peer servers, both copies verify, and the engine applies them."""

    from buffer.weights.net_client import WeightFetcher
    from rollout.engine import HFEngine

    builtin_task.write_model(tmp_path / "base", seed=0, hidden=256)  # rank 16: an adapter of 18 chunks of 64 KiB
    make_adapter(tmp_path / "base", tmp_path / "a", seed=1, rank=16)
    port = free_port()
    (tmp_path / "token").write_text("lora-token")
    cfg = BufferConfig(
        transport="grpc",
        grpc_bind=f"127.0.0.1:{port}",
        grpc_address=f"127.0.0.1:{port}",
        grpc_token_file=str(tmp_path / "token"),
        weights_chunk_kb=64,
        weights_peer_host="127.0.0.1",
        weights_peer_refresh_s=0.2,
        weights_upload_mb_s=0.5,  # the trainer's uplink: ~3 s per copy, time for peers to help
    )
    trainer = setup_trainer_run(str(tmp_path / "trainer"))
    trainer.state.ensure_run_id()
    server = trainer.serve(cfg)
    store = WeightStore(str(tmp_path / "trainer"))
    manifest = publish_adapter(store, tmp_path / "a", tmp_path / "base", 0)
    fetchers = [WeightFetcher(cfg.grpc_address, "lora-token", cfg, f"w{i}") for i in range(2)]
    try:
        dests = fetch_at_once(fetchers, 0, tmp_path)
        stats = [f.stats[0] for f in fetchers]
        assert stats[0].chunks >= 8, stats[0].chunks  # enough chunks for a peer to serve some
        assert sum(s.from_peers for s in stats) > 0, stats
        for i in range(2):
            engine = HFEngine(str(tmp_path / "base"))
            assert engine.load_adapter(dests[i], 0) == len(manifest.tensors)
    finally:
        for f in fetchers:
            f.close()
        server.stop()


def test_the_validator_measures_adapter_versions_and_refuses_another_base(tmp_path, models):
    """The validator answers requests for adapter versions on its base (the adapter applied: its
    greedy answers are the adapter's), and refuses one of another base: exits through Refused,
    its last heartbeat stopped with the reason, so the trainer stops waiting for results."""
    from rollout.config import ValidatorConfig
    from rollout.engine import SamplingSettings
    from rollout.validate import Validator

    a = make_adapter(models / "base", tmp_path / "a", seed=1)
    make_adapter(models / "other_base", tmp_path / "b", seed=2)
    root = tmp_path / "run"
    store = WeightStore(str(root))
    publish_adapter(store, tmp_path / "a", models / "base", 0)
    store.validation.request(0, 0)
    cfg = build(
        ValidatorConfig,
        {
            "root": str(root),
            "data.val_files": f"[{models / 't.parquet'}]",
            "data.max_response_length": "3",
            "actor_rollout_ref.model.path": str(models / "base"),
        },
    )
    validator = Validator(cfg)
    assert validator.start() and validator.answer_next()
    assert not store.validation.result(0).skipped
    prompt = validator.prompts[0].token_ids
    [[greedy]] = validator.engine.generate([prompt], SamplingSettings(1, 0.0, 1.0, 3, 0))
    with torch.no_grad():  # the trainer's PEFT model, greedy: the same tokens
        expected = a.generate(input_ids=torch.tensor([prompt]), max_new_tokens=3, do_sample=False)
    assert greedy.token_ids == expected[0, len(prompt) :].tolist()[: len(greedy.token_ids)]

    publish_adapter(store, tmp_path / "b", models / "other_base", 1)
    store.validation.request(1, 1)
    with pytest.raises(Refused, match=base_checksum(models / "other_base")):
        validator.run()
    beat = store.validation.beat()
    assert beat["state"] == "stopped" and beat["refused"]["worker_base"] == base_checksum(models / "base")


def test_launch_local_gives_the_workers_and_the_validator_their_base(tmp_path):
    """launch.local hands actor_rollout_ref.model.path to every role: an adapter-only version
    needs the base on the workers' and the validator's side."""
    from launch import local

    builtin_task.write_model(tmp_path / "m")
    run = setup_trainer_run(str(tmp_path / "run"))
    args = local.parse_args(["--root", run.root, "--model", str(tmp_path / "m")])
    trainer, worker, validator = local.role_args(run, args, str(tmp_path / "m"), None, {}, ["/d/val.parquet"])
    for role in (trainer, worker, validator):
        assert f"actor_rollout_ref.model.path={tmp_path / 'm'}" in role, role
