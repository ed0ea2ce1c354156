"""Plots of a run and one self-contained HTML page: `python -m launch.report RUN [--out DIR]`.

Writes into DIR (default RUN/report/) one PNG per plot, `data.json` with the numbers behind
them, and `index.html` with the status snapshot (launch.status) and every plot embedded (no
file or network access needed to view it):
- reward and every val-core/* metric against step and against wall-clock;
- staleness: how many steps trained at each staleness (mean and max, in versions), and by step;
- generation throughput of each worker over time (tokens/s of each batch);
- the weight version each worker had loaded over time, beside the version the trainer published;
- time breakdown of each trainer step: wait for experience / compute / publish;
- weight-sync latency: from the moment LATEST named a version to each worker's finished load.

Sources: metrics.jsonl (trainer), workers/*.json (each heartbeat keeps the worker's loads and a
bounded per-batch history). Works on a finished run and on a live one (a snapshot of it).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import os
import sys
import time
from typing import Any

from buffer.run import setup_trainer_run
from launch import status

PLOTS = (  # name, title, what it shows
    ("reward", "Reward and validation", "reward/mean of each trainer step and every val-core/* metric"),
    (
        "staleness",
        "Staleness",
        "weight versions between the policy that generated a step's samples "
        "and the trainer's; samples beyond trainer.max_staleness are dropped",
    ),
    ("throughput", "Worker throughput", "generated tokens per second of each batch, per worker"),
    (
        "versions",
        "Weight version per worker",
        "the version each worker had loaded, and the trainer's published version",
    ),
    ("step_time", "Trainer step time", "seconds of each step: waiting for experience, computing, publishing weights"),
    (
        "sync_latency",
        "Weight-sync latency",
        "seconds from a version's publication (LATEST replaced) to each worker's finished in-place load",
    ),
)


def collect(root: str) -> dict:
    """The series every plot draws, as plain data (written as data.json)."""
    run = setup_trainer_run(root)
    rows, vals = status.split_metrics(status.read_metrics(run))
    beats = status.read_heartbeats(run)
    timed = [r for r in rows if "time/unix" in r]
    published = {
        r["weights/published"]: r["weights/published_at"] for r in rows if r.get("weights/published_at") is not None
    }
    data: dict[str, Any] = {
        "root": run.files.root,
        "steps": [r["step"] for r in rows],
        "time": [r.get("time/unix") for r in rows],
        "reward": [r["reward/mean"] for r in rows],
        "validation": status.validation_series(vals),
        "staleness_mean": [r["staleness/mean"] for r in rows],
        "staleness_max": [r["staleness/max"] for r in rows],
        "dropped_stale_samples": rows[-1].get("buffer/dropped_stale_samples", 0) if rows else 0,
        "step_time": {k: [status.step_split(r)[k] for r in rows] for k in ("wait_s", "compute_s", "publish_s")},
        "published": sorted([v, t] for v, t in published.items()),
        # per worker: [unix, tokens/s] per batch, [unix, version] per load, [version, latency s]
        "throughput": {w: [[h[0], h[3] / h[4]] for h in b.get("history", []) if h[4] > 0] for w, b in beats.items()},
        "versions": {w: [[t, v] for v, t in b.get("loads", [])] for w, b in beats.items()},
        "last_beat": {w: b.get("last_beat") for w, b in beats.items()},
        "sync_latency": {
            w: [[v, t - published[v]] for v, t in b.get("loads", []) if v in published] for w, b in beats.items()
        },
    }
    starts = (
        [r["time/unix"] - r["time/step_s"] for r in timed[:1]]
        + [s[0][0] for s in data["throughput"].values() if s]
        + [s[0][0] for s in data["versions"].values() if s]
    )
    data["t0"] = min(starts) if starts else None
    return data


# --- plots ------------------------------------------------------------------------------------
def _minutes(data: dict, t: float) -> float:
    return (t - data["t0"]) / 60


def _plot_reward(data, fig):
    if not data["steps"]:
        return False
    by_step, by_time = fig.subplots(1, 2)
    by_step.plot(data["steps"], data["reward"], label="reward/mean", color="C0", lw=1)
    mins = [_minutes(data, t) if t is not None else None for t in data["time"]]
    by_time.plot(
        [m for m in mins if m is not None], [r for r, m in zip(data["reward"], mins) if m is not None], color="C0", lw=1
    )
    for i, (key, points) in enumerate(sorted(data["validation"].items()), start=1):
        by_step.plot([p[0] for p in points], [p[2] for p in points], "o-", color=f"C{i}", ms=4, label=key)
        by_time.plot(
            [_minutes(data, p[1]) for p in points if p[1] is not None],
            [p[2] for p in points if p[1] is not None],
            "o-",
            color=f"C{i}",
            ms=4,
        )
    by_step.set(xlabel="trainer step", ylabel="reward / accuracy")
    by_time.set(xlabel="wall-clock (minutes since start)")
    by_step.legend(fontsize=8)
    return True


def _plot_staleness(data, fig):
    if not data["steps"]:
        return False
    import numpy as np

    hist, by_step = fig.subplots(1, 2)
    top = max(data["staleness_max"])
    bins = np.arange(-0.5, top + 1.5, 1) if top <= 40 else 40
    hist.hist([data["staleness_mean"], data["staleness_max"]], bins=bins, label=["mean", "max"])
    hist.set(xlabel="staleness of a step's samples (versions)", ylabel="trainer steps")
    hist.legend(fontsize=8)
    by_step.plot(data["steps"], data["staleness_max"], label="max", lw=1, color="C1", alpha=0.6)
    by_step.plot(data["steps"], data["staleness_mean"], label="mean", lw=1, color="C0")
    by_step.set(
        xlabel="trainer step", ylabel="versions", title=f"{data['dropped_stale_samples']:,} samples dropped as stale"
    )
    by_step.title.set_fontsize(9)
    by_step.legend(fontsize=8)
    return True


def _per_worker(data, series, fig, ylabel, step=False):
    series = {w: s for w, s in series.items() if s}
    if not series:
        return False
    ax = fig.subplots()
    for w, s in sorted(series.items()):
        xs, ys = [_minutes(data, p[0]) for p in s], [p[1] for p in s]
        if step:
            ax.step(xs, ys, where="post", label=w)
        else:
            ax.plot(xs, ys, ".-", ms=3, lw=0.8, label=w)
    ax.set(xlabel="wall-clock (minutes since start)", ylabel=ylabel)
    return ax


def _plot_throughput(data, fig):
    ax = _per_worker(data, data["throughput"], fig, "tokens/s (one batch)")
    if ax:
        ax.legend(fontsize=8)
    return bool(ax)


def _plot_versions(data, fig):
    # each worker's line runs on to its last heartbeat, on the version it had then
    ax = _per_worker(
        data,
        {
            w: s + [[data["last_beat"][w], s[-1][1]]] if s and data["last_beat"][w] else s
            for w, s in data["versions"].items()
        },
        fig,
        "weight version",
        step=True,
    )
    if not ax:
        return False
    if data["published"]:
        ax.step(
            [_minutes(data, t) for _, t in data["published"]],
            [v for v, _ in data["published"]],
            where="post",
            color="k",
            ls="--",
            lw=1,
            label="published (trainer)",
        )
    ax.legend(fontsize=8)
    return True


def _plot_step_time(data, fig):
    if not data["steps"]:
        return False
    ax = fig.subplots()
    parts = data["step_time"]
    ax.stackplot(
        data["steps"],
        parts["wait_s"],
        parts["compute_s"],
        parts["publish_s"],
        labels=["wait for experience", "compute", "publish"],
        step="mid",
    )
    ax.set(xlabel="trainer step", ylabel="seconds")
    # A first step that waits for the workers to start would flatten every other: clip it.
    totals = sorted(w + c + p for w, c, p in zip(parts["wait_s"], parts["compute_s"], parts["publish_s"]))
    top = 2 * totals[int(0.95 * (len(totals) - 1))]
    if top > 0 and totals[-1] > top:
        ax.set_ylim(0, top)
        ax.set_title(
            f"{sum(t > top for t in totals)} step(s) above {top:.2f} s clipped (longest {totals[-1]:.1f} s)", fontsize=9
        )
    ax.legend(fontsize=8, loc="upper right")
    return True


def _plot_sync_latency(data, fig):
    series = {w: s for w, s in data["sync_latency"].items() if s}
    if not series:
        return False
    ax = fig.subplots()
    for w, s in sorted(series.items()):
        lat = sorted(p[1] for p in s)
        ax.plot([p[0] for p in s], [p[1] for p in s], "o", ms=3, label=f"{w} (median {lat[len(lat) // 2]:.2f} s)")
    ax.set(xlabel="weight version", ylabel="seconds from publish to loaded")
    ax.legend(fontsize=8)
    return True


DRAW = {
    "reward": _plot_reward,
    "staleness": _plot_staleness,
    "throughput": _plot_throughput,
    "versions": _plot_versions,
    "step_time": _plot_step_time,
    "sync_latency": _plot_sync_latency,
}


def draw(data: dict, out: str) -> dict[str, bytes | None]:
    """Each plot as PNG bytes (also written to out/<name>.png); None where there is no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pngs: dict[str, bytes | None] = {}
    for name, title, _ in PLOTS:
        pngs[name] = None
        fig = plt.figure(figsize=(10, 3.4), dpi=90, layout="constrained")
        try:
            if DRAW[name](data, fig):
                fig.suptitle(title, fontsize=11)
                buf = io.BytesIO()
                fig.savefig(buf, format="png")
                pngs[name] = buf.getvalue()
                with open(os.path.join(out, f"{name}.png"), "wb") as f:
                    f.write(pngs[name])
        finally:
            plt.close(fig)
    return pngs


# --- the page ---------------------------------------------------------------------------------
CSS = """body{font-family:system-ui,sans-serif;margin:24px;max-width:1000px;color:#222}
table{border-collapse:collapse;margin:4px 0 16px}td,th{padding:2px 10px;text-align:left;
border-bottom:1px solid #ddd;font-size:14px}th{background:#f4f4f4}tr.silent td{color:#b00;
font-weight:bold}img{max-width:100%;display:block}p.note{color:#666;font-size:13px;margin:2px 0}
h2{margin:24px 0 4px;font-size:18px}"""


def _kv_table(lines: list[tuple[str, str]]) -> str:
    return (
        "<table>"
        + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in lines)
        + "</table>"
    )


def page(snap: dict, pngs: dict[str, bytes | None]) -> str:
    e = html.escape
    workers = (
        "<table><tr>"
        + "".join(f"<th>{e(c)}</th>" for c in status.WORKER_COLUMNS)
        + "</tr>"
        + "".join(
            f"<tr class={'silent' if w['silent'] else 'ok'}>"
            + "".join(f"<td>{e(c)}</td>" for c in status.worker_cells(w))
            + "</tr>"
            for w in snap["workers"]
        )
        + "</table>"
    )
    val = "".join(
        f"<tr><td>{e(k)}</td><td>{v['step']}</td><td>{v['value']:.4f}</td><td>{v['best']:.4f}</td></tr>"
        for k, v in sorted(snap["validation"].items())
    )
    parts = [
        f"<h1>tandem run report</h1><p class=note>{e(snap['root'])} &middot; "
        f"{e(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(snap['time'])))}</p>",
        "<h2>Trainer</h2>",
        _kv_table(status.trainer_lines(snap["trainer"])),
        f"<h2>Workers</h2><p class=note>SILENT: no heartbeat for {snap['silent_after_s']:.0f} s</p>",
        workers,
        "<h2>Buffer</h2>",
        _kv_table(status.buffer_lines(snap["buffer"])),
    ]
    if val:
        parts.append(
            f"<h2>Validation</h2><table><tr><th>metric</th><th>step</th><th>value</th><th>best</th></tr>{val}</table>"
        )
    for name, title, what in PLOTS:
        parts.append(f"<h2>{e(title)}</h2><p class=note>{e(what)}</p>")
        png = pngs.get(name)
        parts.append(
            f'<img id="plot-{name}" alt="{e(title)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
            if png
            else "<p class=note>no data yet</p>"
        )
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>tandem report</title>"
        f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>\n"
    )


def write_report(root: str, out: str | None = None, silent_after: float = 300.0) -> str:
    """Write the PNGs, data.json and index.html into `out` (default RUN/report); the page's path."""
    run = setup_trainer_run(root)
    if out is None and not run.is_local():
        raise ValueError(f"{root} is not a local folder: give the report's folder (--out)")
    out = out or run.files.report_dir
    os.makedirs(out, exist_ok=True)
    data = collect(root)
    pngs = draw(data, out)
    with open(os.path.join(out, "data.json"), "w") as f:
        json.dump(data, f)
    path = os.path.join(out, "index.html")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(page(status.snapshot(root, silent_after), pngs))
    os.replace(tmp, path)  # a browser reloading the page never sees half of it
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m launch.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("root", help="the run folder")
    ap.add_argument("--out", help="output folder (default RUN/report)")
    ap.add_argument(
        "--silent-after",
        type=float,
        default=300.0,
        help="flag a worker whose last heartbeat is older than this many seconds (default 300)",
    )
    args = ap.parse_args(argv)
    run = setup_trainer_run(args.root)
    if not run.fs.isdir(run.files.root):
        ap.error(f"{args.root}: no such run folder")
    path = write_report(args.root, args.out, args.silent_after)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
