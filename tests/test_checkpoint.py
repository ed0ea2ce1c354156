"""Trainer checkpoints: SIGKILL and resume (on fewer ranks) reaches the uninterrupted result."""

import json
import os
import signal
import time
from pathlib import Path

from conftest import CRITIC, REORDER_REL_BOUND, STEPS, ids_by_step, kill_tree, weight_distances
from conftest import final_weights as _final_weights
from conftest import run_folder as _run_folder
from conftest import trainer_proc as _trainer

from buffer.checkpoints import FsCheckpoints
from buffer.layout import RunLayout
from protocol.experience import decode, from_table


def _processes_of(run: Path) -> list[int]:
    """Live processes started for this run folder: torchrun and its ranks carry root=<run>."""
    arg = f"root={run}".encode() + b"\0"
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if arg in f.read():
                    pids.append(int(pid))
        except OSError:  # ended meanwhile
            pass
    return pids


def test_sigkill_and_resume_on_one_rank_matches_uninterrupted_run(experience, critic_reference):
    model = experience / "model"
    ref = critic_reference

    run = _run_folder(experience, "killed")
    p = _trainer(run, model, 2, "trainer.save_freq=3", "trainer.log_sample_ids=true", *CRITIC)
    ckpt = Path(RunLayout(str(run)).checkpoint(3))
    deadline = time.monotonic() + 240
    try:
        while not ckpt.exists():
            assert p.poll() is None, p.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint at step 3 within 240 s"
            time.sleep(0.05)
        kill_tree(p.pid)  # torchrun and both ranks (each in a session of its own), mid-run
    finally:
        p.wait(timeout=60)
    # The kill landed on a live run that had not finished: torchrun died of SIGKILL (a run that
    # had already exited returns 0), none of its ranks is left to write on, no DONE marker, and
    # fewer than STEPS steps were logged.
    assert p.returncode == -signal.SIGKILL, p.returncode
    deadline = time.monotonic() + 60
    while left := _processes_of(run):
        assert time.monotonic() < deadline, f"processes of the killed run still alive: {left}"
        time.sleep(0.05)
    layout = RunLayout(str(run))
    assert not os.path.exists(layout.done_marker)
    assert 3 <= len((run / "metrics.jsonl").read_text().splitlines()) < STEPS
    resumed_from = FsCheckpoints(layout).latest_complete()
    assert RunLayout.checkpoint_step(resumed_from) in (3, 6)
    saved = json.loads((Path(resumed_from) / "trainer_state.json").read_text())
    assert len(saved["rng"]["cpu"]) > 0 and saved["model_path"] == str(model)
    assert saved["critic"] and saved["kl_coef"] != 0.1

    p = _trainer(run, model, 1, "trainer.save_freq=3", "trainer.log_sample_ids=true", *CRITIC)  # 2 ranks -> 1
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    assert "resumed from" in out
    # Exactly once over the run's final timeline: steps after the checkpoint ran twice (before
    # the kill and after the resume); the later line of each step is the one that counts. And
    # each step trained the same samples as in the uninterrupted run.
    by_step = ids_by_step(run)
    assert sorted(by_step) == list(range(1, STEPS + 1)) and by_step == ids_by_step(ref)
    trained = [i for ids in by_step.values() for i in ids]
    committed = {s.sample_id for p in (ref / "experience").rglob("*.arrow") for s in from_table(decode(p.read_bytes()))}
    assert len(trained) == len(set(trained)) and set(trained) == committed
    # Same samples at every step (above): only the order of fp32 sums differs (1 rank vs 2).
    differ, moved, worst = weight_distances(_final_weights(ref), _final_weights(run), model)
    assert moved > 1e-2 and differ < REORDER_REL_BOUND * moved, (differ, moved, worst)
    # Retention: shards covered by the last committed checkpoint are gone from the killed run
    # (the uninterrupted one saved no checkpoint and keeps all of them).
    assert len(list((run / "experience").rglob("*.arrow"))) < len(list((ref / "experience").rglob("*.arrow")))


def test_half_written_checkpoint_is_never_picked(tmp_path):
    layout = RunLayout(str(tmp_path))
    for step, complete in ((2, True), (4, False)):
        d = Path(layout.checkpoint(step))
        d.mkdir(parents=True)
        if complete:
            (d / "trainer_state.json").write_text("{}")
    Path(layout.checkpoint_tmp(6, "node1-4242")).mkdir()  # a save killed before its rename
    assert FsCheckpoints(layout).latest_complete() == layout.checkpoint(2)
