"""Issue 14's experiment: a model learns the GSM8K-format task (rollout/tasks/arith.py) through
vLLM workers, synchronous against decoupled. One step per command, each under 10 minutes on a
2xH200 machine, each resuming from the files the previous one left in RES:

    python -m benchmarks.learn_gpu build RES            # task, tokenizer, 'gpu' model   (~1 min)
    python -m benchmarks.learn_gpu sft RES              # SFT on GPU 0, pick the start    (~5 min)
    python -m benchmarks.learn_gpu rl RES MODE          # MODE: sync, s1, s2 or s4        (<9.5 min)
    python -m benchmarks.learn_gpu plot RES             # PNGs + summary table            (secs)

On machines that do not keep RES between steps: `sft ... --export DIR` writes the RL start
(bf16, ~55 MB as 15 MiB tar parts) and the SFT measurements; `rl ... --import DIR` takes them
(the task's parquets are rebuilt from their seed) and `--export DIR2` writes the run's metrics,
heartbeats and logs; `plot RES --import DIR2` unpacks those and plots. `sft` and `rl` build what
they need when it is missing, so `build` is only needed to look at the task first.

RES/data/        {sft,rl}_{train,val}.parquet (rollout.tasks.arith: 50k problems, 1000 held out)
RES/model/       the random-init Qwen2 ('gpu': hidden 512, 8 layers, ~27M parameters) + tokenizer
RES/sft/         trainer.sft's output: weights/v<step>/ every --save-every steps, metrics.jsonl,
                 accuracy.json (greedy held-out accuracy of each saved step)
RES/start        link to the saved SFT step whose accuracy is nearest --target: the RL start
                 (partial accuracy, so RL has room to improve it and groups have reward variance)
RES/rl-MODE/     a launch.local run: 1 trainer rank on GPU 0, one vLLM worker on GPU 1 (on GPU 0
                 at --worker-memory of it when one GPU is visible, --placement), the
                 validator (transformers engine, greedy, held-out split) on GPU 0, every
                 --test-freq steps
RES/plots/       benchmarks/plot_learning.py over every RES/rl-*

Modes: s1, s2, s4 set trainer.max_staleness to 1, 2, 4 (and the workers' backlog to
staleness + 1 batches, so that the bound, not the backlog, limits how far ahead they run); sync
passes the settings of $TANDEM_SYNC_SETTING to the trainer (default `trainer.max_staleness=0`)
and those of $TANDEM_SYNC_WORKER_SETTING to the workers (default none), space-separated. Every
mode trains the same number of steps on the same batch, so the same number of samples.

`--cpu` runs every step on this machine's CPU with the 'tiny' model and a small recipe, to check
the wiring end to end (tests/test_arith_task.py does).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from buffer.layout import RunLayout  # noqa: E402
from rollout.tasks import arith  # noqa: E402

MODES = {"sync": None, "s1": 1, "s2": 2, "s4": 4}
# Per target: task rows, model size, SFT and RL recipes. GPU numbers are first guesses sized
# from the model (27M parameters, ~60-token responses): the lead balances t_gen and t_train
# with --batch / --n after a first run (plot_learning's table prints both).
PROFILES = {
    # sft_token_budget: without flash-attn, sdpa attends over a packed micro-batch's whole
    # block-diagonal mask (T x T), so T stays at 8k. timeout: launch.local's, from the start of
    # its processes (vLLM's ~1-2 min start included), leaving time to stop them within 10 min.
    "gpu": dict(
        rows=50000,
        val_fraction=0.02,
        size="gpu",
        # 300: the LR decays over --steps, so the RL start (the save nearest --target) must come
        # from the middle of the schedule; a 200-step SFT ended at held-out 0.337 with its LR at
        # 0 and RL from it did not move (2026-12-02), 300 steps give 0.54-0.56 at step 200
        sft_steps=300,
        sft_batch=256,
        sft_lr=1e-3,
        save_every=100,
        sft_token_budget=8192,
        rl_steps=100,
        batch=64,
        n=8,
        lr=2e-5,
        test_freq=10,
        micro_token_budget=32768,
        timeout=540,  # the first RL call of a fresh machine took 153 s to its first step
        eval_batch=512,
    ),
    "cpu": dict(
        rows=600,
        # 12 held-out problems: the greedy evaluations (SFT's 2 saves, the validator's 3
        # rounds) dominate this profile's time; 30 took 9 s of CPU each, 8 took 1 s
        val_fraction=0.02,
        size="tiny",
        sft_steps=4,
        sft_batch=16,
        sft_lr=3e-3,
        save_every=2,
        sft_token_budget=2048,
        rl_steps=3,
        batch=4,
        n=4,
        lr=1e-3,
        test_freq=2,
        micro_token_budget=4096,
        timeout=600,
        eval_batch=64,
    ),
}


def _paths(res: Path) -> dict[tuple[str, str], str]:
    return {(k, s): str(res / "data" / f"{k}_{s}.parquet") for k in ("sft", "rl") for s in ("train", "val")}


def _need(path: Path, step: str) -> None:
    if not path.exists():
        raise SystemExit(f"learn_gpu: {path} is missing: run the '{step}' step first")


def _run(cmd: list[str], gpus: str | None, log: Path | None = None) -> None:
    """Run a command to completion (its output to `log` too); stop on failure, naming it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    print("learn_gpu: $ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    with open(log, "ab") if log else open(os.devnull, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        for line in proc.stdout:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            out.write(line)
    if proc.wait() != 0:
        raise SystemExit(f"learn_gpu: exit code {proc.returncode} from {cmd[:6]}" + (f"; log {log}" if log else ""))


# --- (a) build --------------------------------------------------------------------------------
def build(res: Path, prof: dict, model: bool = True) -> None:
    """The task's parquets and (with `model`) the initial model, each unless already there:
    both are seeded, so a step on a fresh machine rebuilds the same ones."""
    if not Path(_paths(res)["rl", "val"]).exists():
        counts = arith.write_task(_paths(res), prof["rows"], val_fraction=prof["val_fraction"])
        print(f"learn_gpu build: {counts['train']} train / {counts['val']} held-out problems in {res / 'data'}")
    if model and not (res / "model").exists():
        arith.write_model(res / "model", prof["size"])
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(res / "model")
        print(
            f"learn_gpu build: model {res / 'model'} ({prof['size']}: hidden "
            f"{config.hidden_size}, {config.num_hidden_layers} layers, vocab {config.vocab_size})"
        )


# --- handing files to the next step on another machine ---------------------------------------
PART_BYTES = 15 * 2**20  # the device tool returns files of at most 16 MiB


def export_files(out: Path, name: str, members: dict[str, Path]) -> None:
    """`members` (archive name -> file) as one tar cut into out/name.tar.NN parts."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for arcname, path in members.items():
            tar.add(path, arcname=arcname)
    data = buf.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(data), PART_BYTES):
        (out / f"{name}.tar.{i // PART_BYTES:02d}").write_bytes(data[i : i + PART_BYTES])
    print(f"learn_gpu: exported {name} ({len(data) / 2**20:.1f} MiB) to {out}")


def import_files(src: Path, name: str, dest: Path) -> bool:
    """Unpack src/name.tar.NN into dest; False when there are no such parts."""
    import io
    import tarfile

    parts = sorted(src.glob(f"{name}.tar.[0-9][0-9]"))
    if not parts:
        return False
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        tar.extractall(dest, filter="data")
    print(f"learn_gpu: imported {name} from {src} into {dest}")
    return True


def export_start(res: Path, out: Path) -> None:
    """The RL start model in bf16 (55 MB for 'gpu': 4 parts), without the weight manifest
    (its checksums are of the fp32 files); plus the SFT measurements."""
    import torch
    from safetensors.torch import load_file, save_file

    start, tmp = res / "start", res / "export"
    tmp.mkdir(exist_ok=True)
    members = {}
    for f in start.iterdir():
        if f.suffix == ".safetensors":
            save_file(
                {k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, tmp / f.name, metadata={"format": "pt"}
            )
            members[f"start/{f.name}"] = tmp / f.name
        elif f.name != "manifest.json":
            members[f"start/{f.name}"] = f
    members |= {"sft/accuracy.json": res / "sft" / "accuracy.json", "sft/metrics.jsonl": res / "sft" / "metrics.jsonl"}
    export_files(out, "start", members)


# --- (b) sft ----------------------------------------------------------------------------------
def greedy_accuracy(model_dir: str, val_file: str, device: str, batch: int) -> float:
    """Mean verl gsm8k reward of greedy answers to every held-out prompt (the validator's
    measure, with the transformers engine)."""
    from rollout import reward
    from rollout.dataset import load_prompts
    from rollout.engine import HFEngine, SamplingSettings

    engine = HFEngine(model_dir, "bfloat16" if device == "cuda" else "float32", device)
    prompts = load_prompts([val_file], engine.tokenizer, "prompt", arith.MAX_PROMPT_LENGTH)
    score = reward.resolve(None, "compute_score")
    params = SamplingSettings(n=1, temperature=0.0, top_p=1.0, max_tokens=arith.MAX_RESPONSE_LENGTH, seed=0)
    total = 0.0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        for p, [c] in zip(chunk, engine.generate([p.token_ids for p in chunk], params)):
            text = engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            total += score(p.data_source, text, p.ground_truth, p.extra_info)
    engine.close()
    return total / len(prompts)


def sft(res: Path, prof: dict, args) -> None:
    build(res, prof)
    out = RunLayout(str(res / "sft"))
    steps = args.steps or prof["sft_steps"]
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "-m",
            "trainer.sft",
            f"data.train_files=[{_paths(res)['sft', 'train']}]",
            f"data.val_files=[{_paths(res)['sft', 'val']}]",
            f"model.partial_pretrain={res / 'model'}",
            f"trainer.default_local_dir={out.root}",
            f"trainer.total_training_steps={steps}",
            "trainer.total_epochs=1000",
            f"trainer.save_freq={args.save_every or prof['save_every']}",
            f"trainer.test_freq={args.save_every or prof['save_every']}",
            "trainer.max_ckpt_to_keep=1000",
            f"data.train_batch_size={prof['sft_batch']}",
            f"optim.lr={prof['sft_lr']}",
            "optim.warmup_steps_ratio=0.05",
            "optim.weight_decay=0.01",
            "model.enable_gradient_checkpointing=false",
            f"data.max_length={arith.MAX_PROMPT_LENGTH + arith.MAX_RESPONSE_LENGTH}",
            f"data.max_token_len_per_gpu={prof['sft_token_budget']}",
            *args.set,
        ],
        None if args.cpu else "0",
        res / "sft.log",
    )
    # Greedy held-out accuracy of every saved step; the RL start is the one nearest --target.
    device = "cpu" if args.cpu else "cuda"
    acc_file = res / "sft" / "accuracy.json"
    acc = json.loads(acc_file.read_text()) if acc_file.exists() else {}
    for d in sorted(glob.glob(f"{out.weights_dir}/v*"), key=lambda d: int(d.rsplit("v", 1)[1])):
        step = str(int(d.rsplit("v", 1)[1]))  # the folders are v000100
        if step not in acc:
            acc[step] = greedy_accuracy(d, _paths(res)["rl", "val"], device, prof["eval_batch"])
            print(f"learn_gpu sft: step {step}: held-out greedy accuracy {acc[step]:.3f}", flush=True)
    acc_file.write_text(json.dumps(acc, indent=1))
    chosen = min(acc, key=lambda s: (abs(acc[s] - args.target), int(s)))
    link, tmp = res / "start", res / "start.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(out.version_dir(int(chosen)), res), tmp)
    os.replace(tmp, link)
    print(
        f"learn_gpu sft: RL starts from step {chosen} (held-out accuracy {acc[chosen]:.3f}, "
        f"target {args.target}): {link} -> {os.readlink(link)}"
    )
    if max(acc.values()) < args.target:
        print(
            f"learn_gpu sft: no saved step reached --target {args.target}: run more SFT steps "
            f"(--steps; it resumes from the last checkpoint)",
            file=sys.stderr,
        )
    if args.export:
        export_start(res, args.export)


# --- (c) rl -----------------------------------------------------------------------------------
def mode_settings(mode: str, samples_per_batch: int) -> tuple[list[str], list[str]]:
    """(trainer, worker) settings of a mode."""
    if mode == "sync":
        return (
            os.environ.get("TANDEM_SYNC_SETTING", "trainer.max_staleness=0").split(),
            os.environ.get("TANDEM_SYNC_WORKER_SETTING", "").split(),
        )
    s = MODES[mode]
    return [f"trainer.max_staleness={s}"], [f"buffer.max_backlog_samples={(s + 1) * samples_per_batch}"]


def gpu_placement(placement: str, worker_memory: float) -> tuple[list[str], float | None]:
    """(launch.local's GPU flags, the vLLM worker's gpu_memory_utilization or None for its
    default). 'two': the worker alone on GPU 1, trainer and validator on GPU 0. 'one': all three
    on GPU 0, the worker's engine taking `worker_memory` of it (vLLM reserves that fraction for
    weights, activations and KV cache up front; the trainer and validator of the 27M model need
    a few GiB). 'auto': 'one' when a single GPU is visible."""
    if placement == "auto":
        import torch

        placement = "one" if torch.cuda.device_count() == 1 else "two"
    print(
        f"learn_gpu rl: placement {placement}"
        + (f" (vLLM worker at gpu_memory_utilization={worker_memory})" if placement == "one" else "")
    )
    if placement == "one":
        return ["--trainer-gpus", "0", "--worker-gpus", "0", "--validator-gpu", "0"], worker_memory
    return ["--trainer-gpus", "0", "--worker-gpus", "1", "--validator-gpu", "0"], None


def rl(res: Path, prof: dict, args) -> None:
    if not (res / "start").exists() and args.import_dir:
        import_files(args.import_dir, "start", res)
    _need(res / "start", "sft")
    build(res, prof, model=False)
    root = res / f"rl-{args.mode}"
    if root.exists():
        raise SystemExit(f"learn_gpu rl: {root} exists (an earlier run of this mode); move it away")
    batch, n = args.batch or prof["batch"], args.n or prof["n"]
    trainer_mode, worker_mode = mode_settings(args.mode, batch * n)
    trainer = [
        f"data.train_batch_size={batch}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        f"actor_rollout_ref.actor.optim.lr={args.lr or prof['lr']}",
        "actor_rollout_ref.actor.optim.weight_decay=0",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={prof['micro_token_budget']}",
        "trainer.keep_versions=8",
        *trainer_mode,
    ]
    worker = [
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.prompts_per_batch={batch}",
        f"buffer.flush_samples={batch * n}",
        "buffer.flush_interval=2",
        *worker_mode,
    ]
    placement = []
    if not args.cpu:
        worker += ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=bfloat16"]
        placement, memory = gpu_placement(args.placement, args.worker_memory)
        worker += [f"actor_rollout_ref.rollout.gpu_memory_utilization={memory}"] if memory else []
    cmd = [
        sys.executable,
        "-m",
        "launch.local",
        "--root",
        str(root),
        "--task",
        "arith",
        "--model",
        str((res / "start").resolve()),
        "--data",
        _paths(res)["rl", "train"],
        "--val-data",
        _paths(res)["rl", "val"],
        "--steps",
        str(args.steps or prof["rl_steps"]),
        "--test-freq",
        str(prof["test_freq"]),
        "--nproc",
        "1",
        "--workers",
        "1",
        "--timeout",
        str(prof["timeout"]),
        *placement,
        *[x for s in trainer + args.trainer for x in ("--trainer", s)],
        *[x for s in worker + args.worker for x in ("--worker", s)],
        *[x for s in [f"data.val_batch_size={prof['eval_batch']}", *args.validator] for x in ("--validator", s)],
    ]
    try:
        _run(cmd, None, res / f"rl-{args.mode}.log")
    finally:  # a run cut short by its timeout still has curves to plot
        if args.export:
            files = [
                root / "metrics.jsonl",
                root / "progress.json",
                *root.glob("workers/*.json"),
                *root.glob("logs/*.log"),
            ]
            export_files(args.export, root.name, {str(f.relative_to(res)): f for f in files if f.exists()})


# --- (d) plot ---------------------------------------------------------------------------------
def plot(res: Path, args) -> None:
    for mode in MODES:
        if args.import_dir and not (res / f"rl-{mode}").exists():
            import_files(args.import_dir, f"rl-{mode}", res)
    runs = [d for m in MODES if (d := res / f"rl-{m}").exists()]
    if not runs:
        raise SystemExit(f"learn_gpu plot: no {res}/rl-MODE folders: run the 'rl' step first")
    from benchmarks import plot_learning

    plot_learning.main([*map(str, runs), "--out", str(res / "plots")])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.learn_gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("step", choices=("build", "sft", "rl", "plot"))
    p.add_argument("res", help="results folder (every step reads and writes here)")
    p.add_argument("mode", nargs="?", choices=sorted(MODES), help="rl: the mode")
    p.add_argument("--cpu", action="store_true", help="this machine's CPU, the tiny model")
    p.add_argument("--steps", type=int, help="sft/rl: steps (default: the profile's)")
    p.add_argument("--save-every", type=int, help="sft: save (and measure) every this many steps")
    p.add_argument(
        "--target", type=float, default=0.4, help="sft: held-out accuracy the RL start should have (default 0.4)"
    )
    p.add_argument("--batch", type=int, help="rl: prompts per step and per rollout batch")
    p.add_argument("--n", type=int, help="rl: responses per prompt (group size)")
    p.add_argument("--lr", type=float, help="rl: actor learning rate")
    p.add_argument(
        "--placement",
        choices=("auto", "one", "two"),
        default="auto",
        help="rl on GPU: 'two' puts the vLLM worker on GPU 1, 'one' shares GPU 0 with "
        "the trainer and validator; 'auto' (default): 'one' when one GPU is visible",
    )
    p.add_argument(
        "--worker-memory",
        type=float,
        default=0.25,
        metavar="FRACTION",
        help="rl, placement 'one': the vLLM worker's gpu_memory_utilization (default 0.25)",
    )
    p.add_argument(
        "--export",
        type=Path,
        metavar="DIR",
        help="sft: write the RL start (bf16) and SFT measurements; rl: the run's "
        "metrics, heartbeats and logs; as tar parts of at most 15 MiB in DIR (e.g. "
        "$OUT), for a later step on another machine",
    )
    p.add_argument(
        "--import",
        dest="import_dir",
        type=Path,
        metavar="DIR",
        help="rl: take the RL start from DIR's start.tar.NN parts when RES has none; "
        "plot: unpack DIR's rl-MODE.tar.NN parts",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="sft: extra setting")
    p.add_argument("--trainer", action="append", default=[], metavar="KEY=VALUE", help="rl: extra trainer setting")
    p.add_argument("--worker", action="append", default=[], metavar="KEY=VALUE", help="rl: extra worker setting")
    p.add_argument(
        "--validator",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="rl: extra validator setting, after the profile's (e.g. data.val_batch_size=128: at the "
        "default 512 its transformers engine held 57 GiB, too much beside the trainer and the vLLM "
        "worker on one 80 GB card, 2026-12-06)",
    )
    args = p.parse_args(argv)
    if not 0 < args.worker_memory < 1:
        p.error(f"--worker-memory {args.worker_memory}: a fraction of the GPU in (0, 1)")
    if args.step == "rl" and args.mode is None:
        p.error(f"rl needs a MODE: one of {', '.join(MODES)}")
    res = Path(args.res).absolute()
    res.mkdir(parents=True, exist_ok=True)
    prof = PROFILES["cpu" if args.cpu else "gpu"]
    if args.step == "build":
        build(res, prof)
    elif args.step == "sft":
        sft(res, prof, args)
    elif args.step == "rl":
        rl(res, prof, args)
    else:
        plot(res, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
