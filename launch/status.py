"""How a run goes, from its folder alone: `python -m launch.status RUN [--once] [--json]`.

A live terminal view refreshed every `--interval` seconds (Ctrl-C leaves it):
- trainer: state, step of total, weight version, reward, last step's time split into wait for
  experience / compute / publish (seconds), the run's idle fraction (waiting for experience),
  ETA from the wall-clock pace of the last 10 steps;
- each worker (its heartbeat): state, weight version loaded, tokens/s, samples written, reload
  time as a fraction of generating time, MB per reload (of the published versions: deltas or
  snapshots) and seconds of the last reload, age of the last heartbeat; SILENT when older than
  `--silent-after` seconds and not stopped (a worker beats after every batch and every 5 s while
  it waits for the trainer); REFUSED when it refused a weight version (an adapter for another base,
  issue 27: the reason, naming both checksums, is printed below the table) and exited;
- buffer: backlog (samples written minus retired, as the workers' backpressure sees it),
  staleness of the last step and over the run, samples dropped as stale, quarantined shards,
  bytes in experience/, weights/, checkpoints/, and the filesystem's free space;
- validation: the latest value of every `val-core/*` metric.

`--once` prints one snapshot and exits (scripts, SLURM logs); `--json` prints the same snapshot as
one JSON object. It only reads files (metrics.jsonl, progress.json, workers/*.json, the listing of
quarantine/ and sizes), never anything the trainer waits on.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time

from buffer.control.backpressure import backlog
from buffer.run import TrainerRun, setup_trainer_run

PACE_STEPS = 10  # ETA: wall-clock pace of the last this many steps
VALIDATION_PREFIX = "val-core/"


def read_metrics(run: TrainerRun) -> list[dict]:
    """The complete lines of metrics.jsonl (a live trainer may be writing the last one)."""
    try:
        text = run.fs.cat_file(run.files.metrics).decode(errors="replace")
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # never written by the trainer (one write() per line); skip, do not stop
    return rows


def split_metrics(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(one row per trainer step, one row per validation result in step order). metrics.jsonl
    interleaves them: a validation row is written when its result arrives, and its `step` is the
    step of the weights it measured (trainer/validation.py)."""
    train = [r for r in rows if "val/weights_version" not in r]
    vals = sorted((r for r in rows if "val/weights_version" in r), key=lambda r: r["step"])
    return train, vals


def read_heartbeats(run: TrainerRun) -> dict[str, dict]:
    """Worker id -> its last heartbeat."""
    return {str(b.get("worker_id", "?")): b for b in run.heartbeats.all()}


def step_split(row: dict) -> dict:
    """Seconds of one trainer step: waiting for experience, computing, publishing weights."""
    wait, publish = row.get("time/wait_s", 0.0), row.get("weights/publish_s", 0.0)
    return {"wait_s": wait, "compute_s": row["time/step_s"] - wait - publish, "publish_s": publish}


def _trainer(run: TrainerRun, rows: list[dict], now: float) -> dict:
    progress = run.progress.read() or {}
    done = run.state.done_info()
    latest = run.weights.pointer() or {}
    total = progress.get("total_steps") or (done or {}).get("steps")
    out = {
        "state": "done" if done is not None else ("running" if rows or progress else "not started"),
        "step": None,
        "total_steps": total,
        "version": None,
        "latest_published": latest.get("version"),
        "reward": None,
        "samples_consumed": None,
        "last_step": None,
        "last_step_age_s": None,
        "step_pace_s": None,
        "eta_s": None,
        "idle_fraction": None,
    }
    if not rows:
        return out
    last = rows[-1]
    out.update(
        step=last["step"],
        version=last["weights/version"],
        reward=last["reward/mean"],
        samples_consumed=last.get("samples/consumed"),
        last_step=step_split(last),
        idle_fraction=sum(r.get("time/wait_s", 0.0) for r in rows) / max(sum(r["time/step_s"] for r in rows), 1e-9),
    )
    if "time/unix" in last:
        out["last_step_age_s"] = now - last["time/unix"]
        recent = [r for r in rows[-(PACE_STEPS + 1) :] if "time/unix" in r]
        if len(recent) >= 2:  # wall-clock pace: everything between steps counts
            pace = (recent[-1]["time/unix"] - recent[0]["time/unix"]) / (recent[-1]["step"] - recent[0]["step"])
        else:
            pace = last["time/step_s"]
        out["step_pace_s"] = pace
        if total and done is None:
            out["eta_s"] = max(total - last["step"], 0) * pace
    return out


def _worker(worker: str, beat: dict, now: float, silent_after: float) -> dict:
    age = now - beat["last_beat"] if "last_beat" in beat else None
    state = beat.get("state", "?")
    refused = beat.get("refused")  # a version it would not sample from (rollout/versions.py): it exited 2
    return {
        "worker_id": worker,
        "state": "REFUSED" if refused else state,
        "refused": refused,
        "host": beat.get("host"),
        "pid": beat.get("pid"),
        "version": beat.get("weight_version"),
        "tokens_per_s": beat.get("tokens_per_s"),
        "samples_written": beat.get("samples_written"),
        "batches": beat.get("batches"),
        **{k: beat.get(k) for k in ("generate_s", "reload_s", "wait_s", "reload_fraction")},
        # what a worker contained instead of dying (issue 30): damaged versions, failing rewards
        **{k: beat.get(k, 0) for k in ("versions_skipped", "reward_failures", "rewards_dropped")},
        # per reload: bytes of the published version (a delta's or a snapshot's) and seconds
        "bytes_per_reload": beat["reload_bytes"] / beat["reloads"]
        if beat.get("reloads") and "reload_bytes" in beat
        else None,
        "last_reload_bytes": (beat.get("last_reload") or {}).get("bytes"),
        "last_reload_s": (beat.get("last_reload") or {}).get("seconds"),
        "last_beat_age_s": age,
        "silent": state != "stopped" and (age is None or age > silent_after),
    }


def refusal_lines(workers: list[dict]) -> list[tuple[str, str]]:
    """One line per worker that refused a weight version: its reason names both checksums."""
    return [(w["worker_id"], w["refused"].get("reason", "?")) for w in workers if w.get("refused")]


def _quarantined(run: TrainerRun) -> int:
    try:
        files = run.fs.find(run.files.quarantine_dir)
    except FileNotFoundError:
        return 0
    return sum(1 for f in files if not f.endswith(run.files.quarantine_reason("")))


def _bytes(fs, path: str) -> int:
    try:
        return int(fs.du(path, total=True))
    except FileNotFoundError:
        return 0


def _buffer(run: TrainerRun, rows: list[dict]) -> dict:
    fs, files = run.fs, run.files
    last = rows[-1] if rows else {}
    out = {
        "backlog_samples": backlog(run.heartbeats, run.progress),
        "staleness_mean": last.get("staleness/mean"),
        "staleness_max": last.get("staleness/max"),
        "run_staleness_mean": (sum(r["staleness/mean"] for r in rows) / len(rows)) if rows else None,
        "run_staleness_max": max((r["staleness/max"] for r in rows), default=None),
        "dropped_stale_samples": last.get("buffer/dropped_stale_samples"),
        "bad_shards": last.get("buffer/bad_shards"),
        "quarantined_shards": _quarantined(run),
        "declared_lost_shards": last.get("buffer/declared_lost_shards"),
        "bytes": {
            "experience": _bytes(fs, files.experience_dir),
            "weights": _bytes(fs, files.weights_dir),
            "checkpoints": _bytes(fs, files.checkpoints_dir),
        },
        "disk_free_bytes": None,
        "disk_total_bytes": None,
    }
    if run.is_local():
        usage = shutil.disk_usage(files.root)
        out["disk_free_bytes"], out["disk_total_bytes"] = usage.free, usage.total
    return out


def validation_series(rows: list[dict]) -> dict[str, list[list]]:
    """Every val-core/* metric of validation rows: [step, unix time, value] per step measured."""
    out: dict[str, list[list]] = {}
    for r in rows:
        for key, value in r.items():
            if key.startswith(VALIDATION_PREFIX) and isinstance(value, (int, float)):
                out.setdefault(key, []).append([r["step"], r.get("time/unix"), value])
    return out


def validation(rows: list[dict]) -> dict[str, dict]:
    """Every val-core/* metric: the latest value and its step, the first and the best value."""
    return {
        key: {"step": s[-1][0], "value": s[-1][2], "first": s[0][2], "best": max(p[2] for p in s)}
        for key, s in validation_series(rows).items()
    }


def snapshot(root: str, silent_after: float = 300.0, now: float | None = None) -> dict:
    """Everything the view shows, as plain data (what --json prints)."""
    run = setup_trainer_run(root)
    now = time.time() if now is None else now
    rows, vals = split_metrics(read_metrics(run))
    beats = read_heartbeats(run)
    return {
        "root": run.files.root,
        "time": now,
        "silent_after_s": silent_after,
        "trainer": _trainer(run, rows, now),
        "workers": [_worker(w, b, now, silent_after) for w, b in beats.items()],
        "buffer": _buffer(run, rows),
        "validation": validation(vals),
        "reward_servers": reward_servers(run, now),
    }


def reward_servers(run: TrainerRun, now: float) -> list[dict]:
    """The reward servers announced in the run folder (issue 28): address, model checksum, and
    whether workers would pick them now (a fresh beat, serving)."""
    live = {e.server_id for e in run.reward.live()}
    return [
        {
            "server_id": e.server_id,
            "address": e.address,
            "scorer": e.scorer,
            "state": e.state,
            "beat_age_s": round(now - e.last_beat, 1),
            "live": e.server_id in live,
        }
        for e in run.reward.all()
    ]


# --- text -------------------------------------------------------------------------------------
def _num(v, fmt: str = "{:.3f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def _v(version) -> str:
    return "-" if version is None else f"v{version}"


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB" if n < 1e10 else f"{n / 1e9:,.1f} GB"


def trainer_lines(t: dict) -> list[tuple[str, str]]:
    split = t["last_step"]
    return [
        ("state", t["state"]),
        ("step", f"{_num(t['step'], '{}')} / {_num(t['total_steps'], '{}', '?')}"),
        ("weights", f"training on {_v(t['version'])}, latest published {_v(t['latest_published'])}"),
        ("reward/mean", _num(t["reward"])),
        ("samples consumed", _num(t["samples_consumed"], "{:,}")),
        (
            "last step",
            "-"
            if split is None
            else f"wait {split['wait_s']:.2f} s | compute {split['compute_s']:.2f} s | "
            f"publish {split['publish_s']:.2f} s",
        ),
        ("idle", f"{_num(t['idle_fraction'], '{:.1%}')} of the run's step time waiting for experience"),
        ("pace", f"{_num(t['step_pace_s'], '{:.2f}')} s/step, last step {_dur(t['last_step_age_s'])} ago"),
        ("ETA", _dur(t["eta_s"]) if t["state"] != "done" else "finished"),
    ]


def buffer_lines(b: dict) -> list[tuple[str, str]]:
    sizes = ", ".join(f"{k} {_mb(v)}" for k, v in b["bytes"].items())
    free = "-" if b["disk_free_bytes"] is None else f"{_mb(b['disk_free_bytes'])} free of {_mb(b['disk_total_bytes'])}"
    return [
        ("backlog", f"{b['backlog_samples']:,} samples written, not yet trained on or dropped"),
        (
            "staleness",
            f"last step mean {_num(b['staleness_mean'], '{:.2f}')} max "
            f"{_num(b['staleness_max'], '{}')}; run mean {_num(b['run_staleness_mean'], '{:.2f}')} "
            f"max {_num(b['run_staleness_max'], '{}')} versions",
        ),
        ("dropped stale", f"{_num(b['dropped_stale_samples'], '{:,}')} samples"),
        ("bad / quarantined", f"{_num(b['bad_shards'], '{}')} rejected, {b['quarantined_shards']} in quarantine/"),
        ("declared lost", f"{_num(b['declared_lost_shards'], '{}')} shards (unacknowledged, not re-sendable)"),
        ("disk", f"{sizes}; {free}"),
    ]


WORKER_COLUMNS = (
    "worker",
    "state",
    "version",
    "tokens/s",
    "samples",
    "batches",
    "reload/gen",
    "MB/reload",
    "s/reload",
    "last beat",
    "flag",
)
_RIGHT = ("version", "tokens/s", "samples", "batches", "reload/gen", "MB/reload", "s/reload")


def worker_cells(w: dict) -> tuple[str, ...]:
    return (
        w["worker_id"],
        w["state"],
        _v(w["version"]),
        _num(w["tokens_per_s"], "{:,.0f}"),
        _num(w["samples_written"], "{:,}"),
        _num(w["batches"], "{:,}"),
        _num(w["reload_fraction"], "{:.1%}"),
        _num(None if w.get("bytes_per_reload") is None else w["bytes_per_reload"] / 1e6, "{:,.2f}"),
        _num(w.get("last_reload_s"), "{:.2f}"),
        f"{_dur(w['last_beat_age_s'])} ago",
        "REFUSED" if w.get("refused") else "SILENT" if w["silent"] else "",
    )


def render(snap: dict):
    """The snapshot as rich tables."""
    from rich.console import Group
    from rich.table import Table

    def kv(title: str, lines: list[tuple[str, str]]) -> Table:
        t = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        for k, v in lines:
            t.add_row(k, v)
        return t

    workers = Table(title=f"workers (SILENT: no heartbeat for {snap['silent_after_s']:.0f} s)", title_justify="left")
    for c in WORKER_COLUMNS:
        workers.add_column(c, justify="right" if c in _RIGHT else "left")
    for w in snap["workers"]:
        workers.add_row(*worker_cells(w), style="bold red" if w["silent"] or w.get("refused") else None)
    parts = [
        f"[bold]{snap['root']}[/bold]  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(snap['time']))}",
        kv("trainer", trainer_lines(snap["trainer"])),
        workers,
        kv("buffer", buffer_lines(snap["buffer"])),
    ]
    if refusals := refusal_lines(snap["workers"]):
        parts.insert(3, kv("refused weight versions (the worker exited 2; see its log)", refusals))
    if snap.get("reward_servers"):
        lines = [
            (
                s["server_id"],
                f"{s['address']}  scorer {s['scorer'][:16]}  beat {s['beat_age_s']:.0f} s ago"
                + ("" if s["live"] else "  (not picked: silent or draining)"),
            )
            for s in snap["reward_servers"]
        ]
        parts.append(kv("reward servers", lines))
    if snap["validation"]:
        val = Table(title="validation", title_justify="left")
        for c in ("metric", "step", "value", "first", "best"):
            val.add_column(c)
        for key, v in sorted(snap["validation"].items()):
            val.add_row(key, str(v["step"]), f"{v['value']:.4f}", f"{v['first']:.4f}", f"{v['best']:.4f}")
        parts.append(val)
    return Group(*parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m launch.status", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("root", help="the run folder")
    ap.add_argument("--once", action="store_true", help="print one snapshot and exit")
    ap.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    ap.add_argument("--interval", type=float, default=3.0, help="seconds between refreshes (default 3)")
    ap.add_argument(
        "--silent-after",
        type=float,
        default=300.0,
        help="flag a worker whose last heartbeat is older than this many seconds (default 300)",
    )
    args = ap.parse_args(argv)
    if args.interval <= 0 or args.silent_after <= 0:
        ap.error("--interval and --silent-after must be positive")
    run = setup_trainer_run(args.root)
    if not run.fs.isdir(run.files.root):
        ap.error(f"{args.root}: no such run folder")
    if args.json:
        print(json.dumps(snapshot(args.root, args.silent_after), indent=1, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.live import Live

    console = Console(width=None if sys.stdout.isatty() else 120)  # files and SLURM logs: no wrap
    if args.once:
        console.print(render(snapshot(args.root, args.silent_after)))
        return 0
    try:
        with Live(render(snapshot(args.root, args.silent_after)), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(snapshot(args.root, args.silent_after)), refresh=True)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
