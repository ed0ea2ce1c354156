"""launch.status and launch.report on a real CPU run (launch.local), while it runs and after.

One run serves every test here and tests/test_validation.py's held-out accuracy test (the session
fixture `status_run` in conftest.py, made by `observe_run`): while it trains, it takes status and report
snapshots, puts a damaged shard in the buffer (the trainer quarantines it) and stops one worker
with SIGSTOP until the status flags it SILENT (the trainer stopped too meanwhile, so that a short
run is still live then); then it lets the run finish.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import descendants

# 60 steps, validated every 20: what tests/test_validation.py needs to see held-out accuracy rise
# (past the first plateau, the prompt's first digit repeated, in every run seen); the live
# snapshots below need ~25 (0.3-0.5 s a step here).
STEPS, FREQ = 60, 20
SILENT_AFTER = 15.0  # 3x the 5 s heartbeat of a worker held back by backpressure (rollout.worker)
PLOTS = ("reward", "staleness", "throughput", "versions", "step_time", "sync_latency")


def _cli(module: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def _status(root, *args) -> dict:
    return json.loads(_cli("launch.status", str(root), "--json", *args))


CORE = "val-core/tandem/copy/reward/mean@1"


def _lines(root) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def _rows(root) -> list[dict]:
    """The trainer's rows (a validation result is a row of its own, with val/weights_version)."""
    return [r for r in _lines(root) if "val/weights_version" not in r]


def _vals(root) -> list[dict]:
    return sorted((r for r in _lines(root) if "val/weights_version" in r), key=lambda r: r["step"])


def _beats(root) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (root / "workers").glob("*.json")}


def _trainer_pids(proc) -> list[int]:
    """launch.local's torchrun of trainer.main and its ranks (in sessions of their own)."""
    for pid in descendants(proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"torch.distributed.run" in cmd and b"trainer.main" in cmd:
            return [pid, *descendants(pid)]
    raise AssertionError("no torchrun of trainer.main under launch.local")


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait(what: str, cond, proc, timeout_s: float = 300):
    """Poll `cond` until true; fail naming `what` if the run ends or the time is up."""
    deadline, note = time.monotonic() + timeout_s, time.monotonic()
    while not (value := cond()):
        assert proc.poll() is None, f"launch.local ended while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        if time.monotonic() - note > 30:
            print(f"still waiting for {what}", flush=True)
            note = time.monotonic()
        time.sleep(0.2)
    return value


def observe_run(tmp_path_factory) -> tuple[Path, dict]:
    """(run folder, observations made while it ran); conftest's `status_run` calls it once."""
    root = tmp_path_factory.mktemp("status") / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.local",
            "--root",
            str(root),
            "--steps",
            str(STEPS),
            "--test-freq",
            str(FREQ),
            "--timeout",
            "900",
            "--nproc",
            "1",  # one trainer rank, as conftest.launch_local's runs
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    live, stopped = {}, None
    try:
        _wait("3 trainer steps", lambda: (root / "metrics.jsonl").exists() and len(_rows(root)) >= 3, proc)
        # A shard no writer made: the trainer rejects it (no sha256 trailer) into quarantine/.
        bad = root / "experience" / "intruder" / "000000000.arrow"
        bad.parent.mkdir()
        bad.write_bytes(b"not an arrow stream")
        before, beats_before = _rows(root), _beats(root)
        live["status"] = _status(root)
        live["rows_before"], live["rows_after"] = before, _rows(root)
        live["beats_before"], live["beats_after"] = beats_before, _beats(root)
        live["report_dir"] = root.parent / "live_report"
        _cli("launch.report", str(root), "--out", str(live["report_dir"]))
        live["report_rows"] = _rows(root)
        _wait("the quarantined shard", lambda: list((root / "quarantine").rglob("*.arrow")), proc)

        # Freeze the trainer (its torchrun and ranks, all ours) and w1: the run stays live while
        # w1's heartbeat ages; w0 waits on backpressure and beats every 5 s meanwhile.
        stopped = _trainer_pids(proc) + [_beats(root)["w1"]["pid"]]
        _signal_all(stopped, signal.SIGSTOP)
        assert not (root / "DONE").exists(), f"the {STEPS} steps ended before the SILENT check: raise STEPS"
        _wait(
            f"w1 silent for {SILENT_AFTER} s",
            lambda: time.time() - _beats(root)["w1"]["last_beat"] > SILENT_AFTER,
            proc,
        )
        live["silent"] = _status(root, "--silent-after", str(SILENT_AFTER))
        live["silent_text"] = _cli("launch.status", str(root), "--once", "--silent-after", str(SILENT_AFTER))
        _signal_all(stopped, signal.SIGCONT)
        stopped = None
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:]
        live["local_out"] = out
    finally:
        if stopped is not None:
            _signal_all(stopped, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)
    return root, live


@pytest.fixture
def run(status_run):
    return status_run


def _split(row: dict) -> dict:
    wait, publish = row["time/wait_s"], row.get("weights/publish_s", 0.0)
    return {"wait_s": wait, "compute_s": row["time/step_s"] - wait - publish, "publish_s": publish}


def test_live_status_equals_metrics_and_heartbeats(run):
    _, live = run
    s, before, after = live["status"], live["rows_before"], live["rows_after"]
    t = s["trainer"]
    assert t["state"] == "running" and t["total_steps"] == STEPS
    assert before[-1]["step"] <= t["step"] <= after[-1]["step"]  # the run moved on meanwhile
    row = after[t["step"] - 1]
    assert (t["version"], t["reward"], t["last_step"]) == (row["weights/version"], row["reward/mean"], _split(row))
    assert t["eta_s"] > 0
    for w in s["workers"]:
        lo, hi = live["beats_before"][w["worker_id"]], live["beats_after"][w["worker_id"]]
        assert lo["samples_written"] <= w["samples_written"] <= hi["samples_written"]
        assert lo["weight_version"] <= w["version"] <= hi["weight_version"]
        assert w["state"] in ("running", "waiting") and not w["silent"]


def test_silent_worker_is_flagged(run):
    _, live = run
    by_id = {w["worker_id"]: w for w in live["silent"]["workers"]}
    assert by_id["w1"]["silent"] and by_id["w1"]["last_beat_age_s"] > SILENT_AFTER
    assert not by_id["w0"]["silent"], by_id["w0"]  # it beats every batch, or every 5 s waiting
    line = next(ln for ln in live["silent_text"].splitlines() if " w1 " in ln)  # not the run's path
    assert "SILENT" in line
    assert "SILENT" not in next(ln for ln in live["silent_text"].splitlines() if " w0 " in ln)


def test_finished_status_equals_files(run):
    root, live = run
    s, rows, beats = _status(root), _rows(root), _beats(root)
    last = rows[-1]
    t = s["trainer"]
    assert t["state"] == "done" and t["step"] == STEPS == t["total_steps"] and t["eta_s"] is None
    assert (t["version"], t["reward"], t["samples_consumed"], t["last_step"]) == (
        last["weights/version"],
        last["reward/mean"],
        last["samples/consumed"],
        _split(last),
    )
    assert t["latest_published"] == json.loads((root / "weights" / "LATEST").read_text())["version"]
    assert {w["worker_id"] for w in s["workers"]} == set(beats) == {"w0", "w1"}
    for w in s["workers"]:
        beat = beats[w["worker_id"]]
        assert (w["state"], w["version"], w["samples_written"], w["tokens_per_s"], w["batches"]) == (
            "stopped",
            beat["weight_version"],
            beat["samples_written"],
            beat["tokens_per_s"],
            beat["batches"],
        )
        assert not w["silent"]  # stopped workers are never silent
    b = s["buffer"]
    progress = json.loads((root / "progress.json").read_text())
    assert b["backlog_samples"] == sum(x["samples_written"] for x in beats.values()) - progress["samples_retired"]
    assert (b["staleness_mean"], b["staleness_max"], b["dropped_stale_samples"]) == (
        last["staleness/mean"],
        last["staleness/max"],
        last["buffer/dropped_stale_samples"],
    )
    assert b["run_staleness_max"] == max(r["staleness/max"] for r in rows)
    assert b["bad_shards"] == last["buffer/bad_shards"] == 1 and b["quarantined_shards"] == 1
    assert b["bytes"]["weights"] > 0 and b["disk_free_bytes"] > 0
    vals = _vals(root)
    assert [v["step"] for v in vals] == list(range(0, STEPS + 1, FREQ))
    assert s["validation"] == {
        CORE: {"step": STEPS, "value": vals[-1][CORE], "first": vals[0][CORE], "best": max(v[CORE] for v in vals)}
    }
    assert f"report: {root / 'report' / 'index.html'}" in live["local_out"]  # launch.local wrote it


def _check_report(folder: Path, rows: list[dict], beats: dict | None, plots=PLOTS) -> dict:
    """data.json equals the files' numbers; `plots` are drawn and embedded in index.html."""
    data = json.loads((folder / "data.json").read_text())
    assert data["steps"] == [r["step"] for r in rows]
    assert data["reward"] == [r["reward/mean"] for r in rows]
    assert data["staleness_max"] == [r["staleness/max"] for r in rows]
    assert [dict(zip(data["step_time"], v)) for v in zip(*data["step_time"].values())] == [_split(r) for r in rows]
    published = {r["weights/published"]: r["weights/published_at"] for r in rows}
    assert data["published"] == sorted([v, t] for v, t in published.items())
    if beats is not None:
        for w, beat in beats.items():
            assert data["versions"][w] == [[t, v] for v, t in beat["loads"]]
            assert data["throughput"][w] == [[h[0], h[3] / h[4]] for h in beat["history"]]
            assert data["sync_latency"][w] == [[v, t - published[v]] for v, t in beat["loads"] if v in published]
    html = (folder / "index.html").read_text()
    for name in plots:
        png = (folder / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG")
        assert f'id="plot-{name}" ' in html and base64.b64encode(png).decode() in html
    return data


def test_finished_report_equals_files(run):
    root, _ = run
    _cli("launch.report", str(root))  # again, now that every process has stopped
    data = _check_report(root / "report", _rows(root), _beats(root))
    assert data["validation"] == {CORE: [[v["step"], v["time/unix"], v[CORE]] for v in _vals(root)]}
    for w, points in data["sync_latency"].items():
        # a version is loaded after LATEST named it; each worker loaded several in place
        assert len(points) >= 2 and all(lat >= 0 for _, lat in points), (w, points)
        assert data["versions"][w][-1][1] == _beats(root)[w]["weight_version"]


def test_live_report_is_a_snapshot_of_the_run(run):
    root, live = run
    data = json.loads((live["report_dir"] / "data.json").read_text())
    n = len(data["steps"])
    assert len(live["rows_before"]) <= n <= len(live["report_rows"])
    # the trainer's plots; a worker's may have no data yet this early (e.g. no load of v1 yet)
    _check_report(live["report_dir"], _rows(root)[:n], beats=None, plots=("reward", "staleness", "step_time"))


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def test_report_page_opens_in_chromium(run, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the [test] extra")
    browser_path = _chromium()
    if browser_path is None:
        pytest.skip(
            "no Chromium on PATH: install Debian's (apt-get install chromium); playwright's "
            "own browser download needs its CDN, which this test does not use"
        )
    root, _ = run
    errors = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=browser_path,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1040, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto((root / "report" / "index.html").as_uri())
            images = page.evaluate("Array.from(document.images).map(i => [i.id, i.complete, i.naturalWidth])")
            page.screenshot(path=str(tmp_path / "report.png"))
        finally:
            browser.close()
    assert errors == []
    assert [i[0] for i in images] == [f"plot-{name}" for name in PLOTS]
    assert all(complete and width > 0 for _, complete, width in images), images
