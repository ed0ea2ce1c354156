"""Issue 26 on one H200: full against delta weight versions, shared folder against the network
store, the worker beside the trainer.

    python -m benchmarks.net26 --out OUT --mode shared-full     # one device call each (~3-5 min)
    python -m benchmarks.net26 --out OUT --mode shared-delta
    python -m benchmarks.net26 --out OUT --mode remote-full
    python -m benchmarks.net26 --out OUT --mode remote-delta
    python -m benchmarks.net26 --table OUT                      # OUT/<mode>/ -> OUT/net26.md, .json
    add --cpu: the built-in tiny model on this machine's CPU (the wiring check, not a measurement)

A mode is one `launch.local` run: a Qwen2.5-0.5B-shaped model (random init, 0.99 GB of bf16 per
version; benchmarks/rollout_bench.py's), the trainer and one vLLM worker (default multiprocess
engine) both on GPU 0, a new version after every step at verl's usual actor lr 1e-6. The reward
is `benchmarks/net26_reward.py`'s dense one (the share of even token ids, read through a
tokenizer as wide as the model's vocabulary): the built-in task scores a random-init 0.5B at 0,
and zero advantages leave every delta empty (the first H200 run, 2026-12-04). `shared`
reads the trainer's run folder; `remote` is `--remote-workers` (weights from the trainer's weight
service into the worker's own cache, experience over gRPC). `full` publishes every version whole
(`trainer.publish_full_freq=1`), `delta` a snapshot every 8 and exact deltas between
(`trainer.publish_full_freq=8`). The table: bytes per published version (full and delta), the
deltas' density, the worker's versions loaded and bytes and seconds per reload (its heartbeat),
stale samples the trainer dropped, the steady step time and the trainer's waiting share; the
worker's reload seconds of full and of delta versions apart (its log's "loaded ... in" lines). The
acceptance compares stale samples dropped, remote against shared, in one session.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
REWARD = os.path.join(REPO, "benchmarks", "net26_reward.py")
LOADED = re.compile(r"loaded weights v(\d+) in place: \d+ tensors in ([\d.]+) s")

MODES = {  # mode -> (launch.local flags, trainer settings)
    "shared-full": ([], ["trainer.publish_full_freq=1"]),
    "shared-delta": ([], ["trainer.publish_full_freq=8"]),
    "remote-full": (["--remote-workers"], ["trainer.publish_full_freq=1"]),
    "remote-delta": (["--remote-workers"], ["trainer.publish_full_freq=8"]),
}
COMMON_TRAINER = ["actor_rollout_ref.actor.optim.lr=1e-6", "trainer.publish_freq=1", "trainer.publish_dtype=bfloat16"]
GPU = dict(  # one H200: the trainer and the vLLM worker share GPU 0 (0.30 of its memory for vLLM)
    flags=["--trainer-gpus", "0", "--worker-gpus", "0", "--nproc", "1"],
    trainer=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"],
    worker=[
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=bfloat16",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "data.max_response_length=64",
        f"custom_reward_function.path={REWARD}",
        "custom_reward_function.name=compute_score",
    ],
)
CPU = dict(flags=["--nproc", "1"], trainer=[], worker=[])  # the built-in task's tiny model


def run_mode(args) -> None:
    """One launch.local run into OUT/<mode>/: its console, metrics, trainer log, heartbeats."""
    flags, trainer = MODES[args.mode]
    prof = CPU if args.cpu else GPU
    out = os.path.join(args.out, args.mode)
    work = os.path.join(args.work, args.mode)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(out)
    os.makedirs(work)
    data = [] if args.cpu else build_inputs(args.work)
    cmd = [sys.executable, "-m", "launch.local", "--root", f"{work}/run", "--steps", str(args.steps)]
    cmd += ["--workers", "1", "--timeout", str(args.timeout), "--no-report", "--test-freq", "0"]
    cmd += [*prof["flags"], *data, *flags]
    cmd += [x for s in COMMON_TRAINER + trainer + prof["trainer"] for x in ("--trainer", s)]
    cmd += [x for s in prof["worker"] + args.worker for x in ("--worker", s)]
    print("+", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    with open(f"{out}/console.txt", "w") as console:
        rc = run_bounded(cmd, console, args.timeout)
    collect(f"{work}/run", out, {"rc": rc, "wall_s": time.monotonic() - t0, "cmd": cmd})
    print(f"{args.mode}: rc {rc} in {time.monotonic() - t0:.0f} s; {out}", flush=True)
    if rc != 0:
        sys.exit(f"net26 {args.mode}: launch.local exited {rc}; see {out}/console.txt")


def run_bounded(cmd: list[str], console, timeout: float) -> int:
    """launch.local in a session of its own; past its own --timeout and its 60 s stop grace, its
    whole process group is killed (the trainer and the vLLM worker too, so that none is left on
    the GPU for the next mode); the exit code (-9 when killed)."""
    proc = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout + 75)
    except subprocess.TimeoutExpired:
        print(f"net26: launch.local still running {timeout + 75:.0f} s after its start: killing its group", flush=True)
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=30)


def collect(run: str, out: str, summary: dict) -> None:
    """The run's metrics, trainer and worker logs and heartbeats into OUT/<mode>/ (also after a
    cut run: its steps so far still make a row)."""
    for src, dst in (("metrics.jsonl", "metrics.jsonl"), ("logs/trainer.log", "trainer.log")):
        if os.path.exists(f"{run}/{src}"):
            shutil.copy(f"{run}/{src}", f"{out}/{dst}")
    beats = {os.path.basename(p)[:-5]: json.load(open(p)) for p in glob.glob(f"{run}/workers/*.json")}
    logs = glob.glob(f"{run}/logs/*w0*.log") + glob.glob(f"{run}/remote/w0/logs/*.log")  # shared, remote
    for log in logs[:1]:
        shutil.copy(log, f"{out}/worker.log")
    json.dump({**summary, "heartbeats": beats}, open(f"{out}/run.json", "w"))


def build_inputs(work: str) -> list[str]:
    """launch.local's --model/--data: the 0.5B shape with the wide tokenizer, and the prompts,
    built on the CPU once for every mode (~20 s; seeded, so every mode starts the same)."""
    from benchmarks.rollout_bench import QWEN25_05B, build_model
    from rollout import builtin_task

    model, data = f"{work}/model", f"{work}/train.parquet"
    if not os.path.exists(f"{model}/done"):
        build_model(model)
        builtin_task.build_tokenizer(QWEN25_05B["vocab_size"]).save_pretrained(model)
        builtin_task.write_parquet(data, builtin_task.make_rows(512, 3))
        open(f"{model}/done", "w").close()
    return ["--model", model, "--data", data]


def reload_seconds(out: str, mode: str, rows: list[dict]) -> dict[str, list[float]]:
    """The worker's reload seconds of full and of delta versions, from its log."""
    delta = {int(r["weights/published"]): bool(r.get("weights/delta")) for r in rows if "weights/published" in r}
    seconds: dict[str, list[float]] = {"full": [], "delta": []}
    log = f"{out}/{mode}/worker.log"
    for m in LOADED.finditer(open(log).read() if os.path.exists(log) else ""):
        seconds["delta" if delta.get(int(m[1])) else "full"].append(float(m[2]))
    return seconds


def summarize(out: str, mode: str) -> dict:
    """The row of one mode from OUT/<mode>/ (metrics.jsonl, run.json)."""
    rows = [json.loads(line) for line in open(f"{out}/{mode}/metrics.jsonl") if line.strip()]
    rows = [r for r in rows if "time/step_s" in r]  # trainer steps, not validation rows
    run = json.load(open(f"{out}/{mode}/run.json"))
    pubs = [r for r in rows if "weights/published_bytes" in r]
    delta = [r for r in pubs if r.get("weights/delta")]
    full = [r for r in pubs if not r.get("weights/delta")]
    beat = next(iter(run["heartbeats"].values()), {})
    reloads = beat.get("reloads") or 0
    steps = [r["time/step_s"] for r in rows[len(rows) // 4 :]]  # steady: the first quarter left out
    loads = reload_seconds(out, mode, rows)
    scores = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    mb = 1e6
    return {
        "mode": mode,
        "rc": run["rc"],
        "steps": len(rows),
        "full_versions": len(full),
        "delta_versions": len(delta),
        "mb_per_full": statistics.mean(r["weights/published_bytes"] for r in full) / mb if full else None,
        "mb_per_delta": statistics.mean(r["weights/published_bytes"] for r in delta) / mb if delta else None,
        "delta_density": statistics.mean(r["weights/delta_density"] for r in delta) if delta else None,
        "publish_s": statistics.median(r["weights/publish_s"] for r in pubs) if pubs else None,
        "delta_s": statistics.median(r["weights/delta_s"] for r in delta)
        if delta and "weights/delta_s" in delta[0]
        else None,
        "versions_loaded": len(beat.get("versions_loaded") or []),
        "mb_per_reload": (beat.get("reload_bytes") or 0) / reloads / mb if reloads else None,
        "s_per_reload": (beat.get("reload_s") or 0) / reloads if reloads else None,
        "s_per_full_reload": statistics.median(loads["full"]) if loads["full"] else None,
        "s_per_delta_reload": statistics.median(loads["delta"]) if loads["delta"] else None,
        "score_mean": statistics.mean(scores) if scores else None,  # the learning signal is there
        "stale_dropped": rows[-1].get("buffer/dropped_stale_samples", 0) if rows else None,
        "arriving_wait_s": beat.get("arriving_wait_s"),  # the worker held for versions in flight
        "step_s": statistics.median(steps) if steps else None,
        "wait_share": sum(r["time/wait_s"] for r in rows) / max(1e-9, sum(r["time/step_s"] for r in rows)),
    }


def table(out: str) -> None:
    """OUT/net26.json and OUT/net26.md from every mode run into OUT."""
    found = [m for m in MODES if os.path.exists(f"{out}/{m}/metrics.jsonl")]
    rows = [summarize(out, m) for m in found]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    head = "| mode | rc | steps | full / delta versions | MB per full | MB per delta | delta density "
    head += "| publish s (of it delta s) "
    head += "| versions loaded | MB per reload | s per reload (full / delta, median) | stale dropped | step s "
    head += "| wait share | score mean |"
    lines = [head, "|" + " --- |" * 15]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['rc']} | {r['steps']} | {r['full_versions']} / {r['delta_versions']} "
            f"| {f(r['mb_per_full'], '.1f')} | {f(r['mb_per_delta'], '.2f')} | {f(r['delta_density'], '.2%')} "
            f"| {f(r['publish_s'], '.2f')} ({f(r.get('delta_s'), '.2f')}) | {r['versions_loaded']} "
            f"| {f(r['mb_per_reload'], '.1f')} "
            f"| {f(r['s_per_full_reload'], '.2f')} / {f(r['s_per_delta_reload'], '.2f')} "
            f"| {r['stale_dropped']} | {f(r['step_s'], '.2f')} | {f(r['wait_share'], '.3f')} "
            f"| {f(r.get('score_mean'), '.3f')} |"
        )
    for kind in ("full", "delta"):  # the acceptance: stale drops of the network worker vs shared
        s, n = (next((r for r in rows if r["mode"] == f"{side}-{kind}"), None) for side in ("shared", "remote"))
        if s and n:
            dropped = f"network {n['stale_dropped']} vs shared {s['stale_dropped']}"
            lines.append(f"\n{kind}: stale samples dropped, {dropped}")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = f"net26 on {platform.node()}, {when}\n\n" + "\n".join(lines) + "\n"
    open(f"{out}/net26.md", "w").write(text)
    json.dump(rows, open(f"{out}/net26.json", "w"), indent=1)
    print(text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="results folder (a subfolder per mode)")
    p.add_argument("--mode", choices=sorted(MODES), help="the run to make")
    p.add_argument("--table", metavar="OUT", help="summarize the modes found in OUT")
    p.add_argument("--steps", type=int, default=30, help="trainer steps per run (default 30)")
    p.add_argument("--timeout", type=int, default=420, help="launch.local's --timeout in seconds (default 420)")
    p.add_argument("--work", default="/tmp/net26", help="scratch folder for models and runs (default /tmp/net26)")
    p.add_argument("--cpu", action="store_true", help="the built-in tiny model on the CPU (wiring check)")
    p.add_argument("--worker", action="append", default=[], metavar="KEY=VALUE", help="an extra worker setting")
    args = p.parse_args(argv)
    if args.table:
        return table(args.table)
    if not (args.out and args.mode):
        p.error("give --out OUT --mode MODE, or --table OUT")
    run_mode(args)


if __name__ == "__main__":
    main()
