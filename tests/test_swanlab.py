"""trainer.logger=[console,swanlab] through verl's Tracking, offline (SWANLAB_MODE=local)."""

from __future__ import annotations

import json
import sqlite3

from conftest import STEPS, run_folder, trainer_proc


def test_swanlab_local_mode_records_every_step(experience, tmp_path, monkeypatch):
    monkeypatch.setenv("SWANLAB_MODE", "local")  # no account, no network: files in the run folder
    monkeypatch.delenv("SWANLAB_LOG_DIR", raising=False)
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    root = run_folder(experience, "swanlab")
    p = trainer_proc(
        root, experience / "model", 1, "trainer.logger=[console,swanlab]", "trainer.experiment_name=swan-test"
    )
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))

    swanlog = root / "swanlog"  # RunLayout.swanlab_dir: SWANLAB_LOG_DIR defaults into the run
    db = sqlite3.connect(swanlog / "runs.swanlab")
    try:
        assert [name for (name,) in db.execute("select name from experiment")] == ["swan-test"]
        folders = dict(db.execute("select name, folder from tag"))
    finally:
        db.close()
    [run_dir] = swanlog.glob("run-*")
    for key in ("reward/mean", "actor/pg_loss", "weights/version", "time/step_s"):
        points = [
            json.loads(line)
            for f in sorted((run_dir / "logs" / folders[key]).glob("*.log"))
            for line in f.read_text().splitlines()
        ]
        assert [(p["index"], p["data"]) for p in points] == [(r["step"], r[key]) for r in rows], key
