"""LoRA on the trainer (issue 27): adapter-only weight versions that PEFT loads onto the base,
the frozen base as the KL reference, adapter checkpoints that resume, launch.export's merged and
adapter-only folders."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REORDER_REL_BOUND, launch_local, run_folder, trainer_proc
from safetensors.torch import load_file

from buffer.layout import RunLayout
from buffer.weights.fs import WeightStore
from protocol.weights import ADAPTER_CONFIG, ADAPTER_WEIGHTS, base_checksum

LORA = (
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.1",
)
# The same fp32 model through two code paths (the trainer's packed, sharded forward gathered
# into a published adapter vs PeftModel's plain forward; PEFT's merged weights vs base + B @ A):
# only the order of float32 sums differs, ~1e-6 relative on logits of size ~1; 1e-4 leaves room
# and still fails an adapter that lost or mis-scaled one tensor (differences of order 0.1, below).
LOGITS_ATOL = 1e-4


def _train(experience, name, *extra, steps=2, nproc=2):
    root = run_folder(experience, name)
    p = trainer_proc(root, experience / "model", nproc, *LORA, *extra, steps=steps)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]
    return root, out


def _rows(root):
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def _version_dir(root, version):
    return Path(RunLayout(str(root)).version_dir(version))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[3, 4, 5, 6, 13, 3, 4, 5], [7, 8, 13, 7, 8, 0, 0, 0]])


def _peft(base_dir, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


@pytest.fixture(scope="module")
def lora_run(experience):
    """2 ranks, 2 steps with LoRA and the KL loss, a checkpoint at step 2."""
    return _train(experience, "lora", "trainer.save_freq=2")


def test_versions_are_the_adapter_alone_and_peft_loads_them_onto_the_base(experience, lora_run):
    root, out = lora_run
    model = experience / "model"
    store = WeightStore(str(root))
    versions = store.versions()
    assert versions == [0, 1, 2], versions
    last = store.manifest(versions[-1])
    assert last.adapter == {
        "base": base_checksum(model),
        "rank": 4,
        "alpha": 8.0,
        "target_modules": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
    }, last.adapter
    assert last.delta is None
    folder = _version_dir(root, versions[-1])
    names = {f.name for f in last.files}
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= names and not any(n.startswith("model") for n in names), names
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    assert all(k.startswith("base_model.model.model.layers.") and ".lora_" in k for k in tensors), list(tensors)[:3]
    base_bytes = (model / "model.safetensors").stat().st_size
    rows = _rows(root)
    assert all(r["weights/adapter"] == 1.0 and 0 < r["weights/bytes"] < base_bytes for r in rows), rows[-1]
    assert "the reference is the base (adapter disabled)" in out

    # The published adapter on the base: what the trainer trained. Version 0 is the base (B = 0);
    # the last moved away from it, and the KL loss against the reference grew from 0.
    base = _logits(_peft(model, _version_dir(root, 0)).get_base_model(), IDS)
    v0 = _logits(_peft(model, _version_dir(root, 0)), IDS)
    v2 = _logits(_peft(model, folder), IDS)
    assert torch.allclose(v0, base, atol=LOGITS_ATOL)
    assert (v2 - base).abs().max() > 100 * LOGITS_ATOL
    assert rows[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at start
    assert rows[-1]["actor/kl_loss"] > 1e-6


def _export(ckpt, out, *extra):
    return subprocess.run(
        [sys.executable, "-m", "launch.export", "--checkpoint", str(ckpt), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_export_adapter_only_and_merged_match_the_published_adapter(experience, lora_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from launch import export

    root, _ = lora_run
    model = experience / "model"
    ckpt = root / "checkpoints" / "step_00000002"
    assert _export(ckpt, tmp_path / "adapter", "--adapter-only").returncode == 0
    published = load_file(str(_version_dir(root, 2) / ADAPTER_WEIGHTS))
    exported = load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS))
    assert exported.keys() == published.keys()
    assert all(torch.equal(exported[k], published[k]) for k in published)  # the same fp32 values
    done = _export(ckpt, tmp_path / "merged")
    assert done.returncode == 0, done.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any("lora" in k for k in merged.state_dict())
    adapted = _logits(_peft(model, tmp_path / "adapter"), IDS)
    assert torch.allclose(_logits(merged, IDS), adapted, atol=LOGITS_ATOL)
    # full weights have no adapter to export alone
    full = tmp_path / "full-ckpt"
    full.mkdir()
    (full / "trainer_state.json").write_text(json.dumps({"model_path": str(model), "step": 1}))
    capsys.readouterr()
    refused = export.main(["--checkpoint", str(full), "--out", str(tmp_path / "nope"), "--adapter-only"])
    err = capsys.readouterr().err  # in this process: the refusal comes before any checkpoint is read
    assert refused == 1 and "no LoRA adapter" in err, err


@pytest.fixture(scope="module")
def padded_run(experience):
    """lora_run's settings with padded micro-batches, 4 steps uninterrupted: its step 2 against
    lora_run's (packed vs padded), its step 4 against lora_run resumed (one trainer run for both
    tests)."""
    return _train(experience, "lora-padded", "actor_rollout_ref.model.use_remove_padding=false", steps=4)


def test_adapter_checkpoint_resumes_to_the_uninterrupted_adapter(experience, lora_run, padded_run):
    """Stopped after step 2 (its checkpoint), resumed on one rank to step 4, against 4 steps
    uninterrupted (padded micro-batches: packing only reorders float sums, as one rank instead
    of two does): the adapter and Adam's moments came back (tests/conftest.py's
    REORDER_REL_BOUND: a lost optimizer state moves every element far beyond it)."""
    whole, _ = padded_run
    root, _ = lora_run
    resumed = root.parent / "lora-resumed"
    import shutil

    shutil.copytree(root, resumed)
    p = trainer_proc(resumed, experience / "model", 1, *LORA, steps=4)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]
    assert "resumed from" in out
    a = load_file(str(_version_dir(whole, 4) / ADAPTER_WEIGHTS))
    store = WeightStore(str(resumed))
    b = load_file(str(_version_dir(resumed, store.versions()[-1]) / ADAPTER_WEIGHTS))
    moved = sum((a[k] ** 2).sum().item() for k in a if "lora_B" in k) ** 0.5  # B starts at 0
    differ = sum(((a[k] - b[k]) ** 2).sum().item() for k in a) ** 0.5
    print(f"resumed vs uninterrupted adapter: differ / moved = {differ / moved:.1e}")
    # measured: differ / moved = 1.5e-7 (2 ranks then 1, float order only)
    assert moved > 1e-3 and differ < REORDER_REL_BOUND * moved, (moved, differ)


def test_resume_refuses_other_lora_settings(experience, lora_run):
    """lora_run's checkpoint against a run with lora_rank=8: refused before anything loads,
    naming the setting. In this process, through the same checkpoint.load that trainer.main
    calls with its own lora_state (trainer/main.py's resume): that main passes its real
    settings is proven by the resume test above, which a resume comparing against anything
    else (e.g. no adapter) would refuse; one trainer launch (~40 s of imports) less."""
    from protocol.sections import ALL_LINEAR
    from trainer import checkpoint, lora

    root, _ = lora_run
    ckpt = str(root / "checkpoints" / "step_00000002")
    other = checkpoint.lora_state(lora.LoraSpec(8, 8.0, ALL_LINEAR), base_checksum(experience / "model"))
    with pytest.raises(ValueError) as refused:
        checkpoint.load(None, None, ckpt, None, other)  # refused before the model is touched
    msg = str(refused.value)
    assert "saved with lora=" in msg and "actor_rollout_ref.model.lora_rank" in msg, msg


def test_lora_sft_lowers_validation_loss_and_writes_merged_folders(tmp_path):
    """trainer.sft with model.lora_rank: the adapter alone trains (base frozen), the held-out
    loss falls, and the HF folder it writes is the merged model, loadable as a plain base."""
    from transformers import AutoModelForCausalLM

    from rollout import builtin_task, preprocess

    paths = {(k, s): str(tmp_path / f"{k}_{s}.parquet") for k in preprocess.KINDS for s in preprocess.SPLITS}
    builtin_task.write_sft_and_rl(paths, num=240)
    builtin_task.write_model(tmp_path / "model")
    out = tmp_path / "out"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "trainer.sft",
            f"data.train_files=[{paths[('sft', 'train')]}]",
            f"data.val_files=[{paths[('sft', 'val')]}]",
            f"model.partial_pretrain={tmp_path / 'model'}",
            f"trainer.default_local_dir={out}",
            "model.lora_rank=8",
            "model.lora_alpha=16",
            "data.train_batch_size=8",
            "trainer.total_training_steps=24",
            "optim.lr=1e-2",
            "optim.lr_scheduler=constant",
            "optim.warmup_steps_ratio=0",
            "model.enable_gradient_checkpointing=false",
            "data.max_length=16",
            "data.max_token_len_per_gpu=16",
            "trainer.test_freq=4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(__import__("os").environ, OMP_NUM_THREADS="1"),
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    val = [r["val/loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "val/loss" in r]
    print("LoRA SFT val/loss", val)
    # Measured 2.267 at step 4 -> 2.040 at step 24, falling at every check after step 8. With
    # no adapter update (a base frozen and an optimizer without the adapters) every check gives
    # the same loss exactly; 0.1 is under half the measured fall.
    assert len(val) == 6 and val[-1] < val[0] - 0.1, val
    merged = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).state_dict()
    base = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert not any("lora" in k for k in merged)
    assert base.keys() <= merged.keys()
    assert max((merged[k] - base[k]).abs().max().item() for k in base) > 1e-3  # the adapter is in it
    assert all(torch.equal(merged[k], base[k]) for k in base if "norm" in k or "embed" in k)  # frozen, no adapter


def test_benchmark_script_runs_on_cpu_with_the_tiny_shape(tmp_path):
    """benchmarks/lora_bench.sh's wiring (the GPU run is the lead's): every mode trains and
    publishes, an adapter version is the adapter's bytes and a full one the model's."""
    from conftest import REPO_ROOT

    proc = subprocess.run(
        ["bash", "benchmarks/lora_bench.sh", str(tmp_path / "out"), "--tiny", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
        env=dict(__import__("os").environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "lora_bench.json").read_text())["results"]
    assert [r["lora_rank"] for r in results] == [0, 16, 64]
    full, r16, r64 = results
    assert all(r["tokens_per_s"] > 0 and r["publish_s"] > 0 for r in results)
    assert full["trainable_params"] == full["params"] and r64["trainable_params"] == 4 * r16["trainable_params"]
    # bf16/fp32 adapter bytes: 4 bytes per trainable parameter on CPU, plus headers
    assert r16["version_bytes"] < r64["version_bytes"] and r16["version_bytes"] >= 4 * r16["trainable_params"]


def test_packed_and_padded_micro_batches_train_the_same_adapter(lora_run, padded_run):
    """use_remove_padding (packed rows, the chunked logprobs through the PeftModel) against
    padded micro-batches: the same adapter after 2 steps but for float summation order."""
    root, _ = lora_run
    padded, _ = padded_run
    a = load_file(str(_version_dir(root, 2) / ADAPTER_WEIGHTS))
    b = load_file(str(_version_dir(padded, 2) / ADAPTER_WEIGHTS))
    moved = sum((a[k] ** 2).sum().item() for k in a if "lora_B" in k) ** 0.5  # B starts at 0
    differ = sum(((a[k] - b[k]) ** 2).sum().item() for k in a) ** 0.5
    assert moved > 1e-3 and differ < REORDER_REL_BOUND * moved, (moved, differ)


def test_critic_with_lora_trains_adapters_and_its_value_head(experience):
    """GAE with critic.model.lora_rank: the critic's checkpoint holds its adapters and its value
    head (score) only, and the head moved: it is new and trains in full."""
    import torch.distributed.checkpoint as dcp

    root, _ = _train(
        experience,
        "lora-critic",
        "algorithm.adv_estimator=gae",
        "critic.optim.lr=1e-2",
        "critic.model.lora_rank=4",
        "trainer.save_freq=2",
        nproc=1,  # what is checked (the checkpoint's keys, the head's gradient) needs no second rank
    )
    rows = _rows(root)
    assert all(r["critic/grad_norm"] > 0 for r in rows)
    ckpt = root / "checkpoints" / "step_00000002"
    keys = [k.removeprefix("critic.") for k in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata]
    critic = [k for k in keys if k.startswith("base_model.")]
    assert critic and all(".lora_" in k or ".score." in k for k in critic), critic[:5]
    assert any(".score." in k for k in critic)
    assert json.loads((ckpt / "trainer_state.json").read_text())["critic_lora"]["rank"] == 4


@pytest.mark.slow
def test_lora_rl_learns_the_builtin_task_from_a_warmed_base(tmp_path):
    """launch.local end to end with LoRA (trainer, a worker applying each adapter version to the
    base): reward of the last 10 steps >= 0.5 and >= 3x the first 10.

    The base is warmed by 70 SFT steps on a neighbouring task (answer each digit + 1 mod 5), so
    RL on the copy task starts near 0. On the random-init tiny model LoRA cannot learn (measured
    0.17 -> 0.26): the final norm and the tied embeddings stay frozen, so the output distribution
    cannot sharpen (entropy stayed at ~2.27 nats, near uniform over the 10 digits); after SFT
    the base has the scale, and the adapters only have to remap the digits. Mod 5: every answer
    digit of the copy task (0-4) is one the warm base emits; with digit + 1 (answers 1-5) it
    never samples a 0, and RL stalled at 0.48 (inputs 0 and 4 never answered right). 70 SFT
    steps, not 100: after 100 the base is so sure (train loss 0.016) that RL stopped exploring
    at 0.6; after 40 (loss 0.45) greedy answers were all right after RL but samples too spread
    (0.59). Synchronous rollouts (max_staleness=0), two optimizer steps per trainer step at lr
    3e-3 (rank 16, alpha 32), warmed up over the first 9 steps: the reward rises within 10
    steps at full lr, and the first 10 steps' mean would measure the learning, not the start
    (0.26 without warmup). Measured over 60 steps, seeds 0/1/2 (trainer, SFT and worker):
    0.105/0.097/0.098 -> 0.753/0.742/0.843 (100 steps without warmup: 0.914); at lr 6e-3 it
    rose, then collapsed. 50 steps (seed 0, warmup now 7.5 steps): 0.141 -> 0.648, the reward
    past 0.5 from step 20 on and flat at ~0.6 from step 25, so the last 10 steps sit well inside
    the plateau (0.648 vs the 0.5 bound; 4.6x the first 10 vs 3x). Synchronous rollouts make a
    run the same every time on one machine (the worker samples exactly the trainer's groups,
    seeded)."""
    from rollout import preprocess

    shifted = [(q, "".join(str((int(c) + 1) % 5) for c in q)) for q, _ in builtin_task_qa()]
    data = tmp_path / "shift"
    data.mkdir()
    paths = {(k, s): str(data / f"{k}_{s}.parquet") for k in preprocess.KINDS for s in preprocess.SPLITS}
    preprocess.write_splits(shifted, paths, "tandem/copy", "digits", 0.2, 0)
    root = tmp_path / "run"
    # fmt: off
    args = [
        "--root", str(root), "--steps", "50", "--nproc", "1", "--workers", "1", "--test-freq", "0",
        "--sft-steps", "70",
        "--sft", f"data.train_files=[{paths[('sft', 'train')]}]",
        "--sft", f"data.val_files=[{paths[('sft', 'val')]}]",
        "--trainer", "trainer.max_staleness=0",
        "--trainer", "actor_rollout_ref.model.lora_rank=16",
        "--trainer", "actor_rollout_ref.model.lora_alpha=32",
        "--trainer", "actor_rollout_ref.actor.optim.lr=3e-3",
        "--trainer", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.15",
        "--trainer", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    ]
    # fmt: on
    from conftest import REPO_ROOT

    out = subprocess.run(
        launch_local(*args),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO_ROOT,
        env=dict(__import__("os").environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rewards = [r["reward/mean"] for r in _rows(root) if "reward/mean" in r]
    assert len(rewards) == 50, len(rewards)
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"LoRA RL reward: first 10 steps {first:.3f} -> last 10 steps {last:.3f}", [round(r, 2) for r in rewards])
    store = WeightStore(str(root))
    assert store.manifest(store.versions()[-1]).adapter is not None  # adapter versions all along
    assert last >= 0.5 and last >= 3 * first, (first, last)


def builtin_task_qa():
    from rollout import builtin_task

    return builtin_task.make_qa(2000, 3)


def test_adapter_dropout_is_on_for_updates_only(tmp_path):
    """lora_dropout: lora.dropout(model, False) (pi_old, reference, values, validation) gives the
    same logits pass after pass whatever the model's train/eval mode; on (updates), it does not."""
    from transformers import AutoModelForCausalLM

    from rollout import builtin_task
    from trainer import lora

    builtin_task.write_model(tmp_path / "m")
    model = lora.apply(
        AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32),
        lora.LoraSpec(4, 8, "all-linear", (), 0.5),
    )
    with torch.no_grad():
        for p in model.parameters():
            if "lora_B" in getattr(p, "_name", "") or p.requires_grad:
                p.add_(0.1)  # B != 0: the adapter's input (where dropout acts) reaches the output
    model.train()
    with lora.dropout(model, False):
        assert torch.equal(_logits(model, IDS), _logits(model, IDS))
    with lora.dropout(model, True):
        assert not torch.equal(_logits(model, IDS), _logits(model, IDS))
    assert all(m.training for n, m in model.named_modules() if n.endswith("lora_dropout.default"))  # restored
