"""Clear refusals: a bad input stops the role at start with one line naming the setting, the
file or the row, before anything heavy loads; tools report missing folders as failures."""

import logging
import subprocess
import sys
import threading
import time

import pytest
from conftest import subprocess_env

from buffer.config import BufferConfig
from buffer.experience.reader import ExperienceReader
from buffer.storage import atomic_write_json, stop_watch, watch
from protocol.config import ConfigError, build
from rollout import builtin_task
from rollout.config import WorkerConfig
from rollout.dataset import DatasetError, load_prompts


def _run(*args, timeout=120):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=subprocess_env())
    return p, time.monotonic() - t0


def test_missing_model_path_is_named_before_loading(tmp_path):
    p, _ = _run("-m", "trainer.main", f"root={tmp_path / 'run'}", "actor_rollout_ref.model.path=/nonexistent/model")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "actor_rollout_ref.model.path: /nonexistent/model not found" in p.stderr
    assert "Repo id" not in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "run").exists()  # nothing was started
    p, _ = _run("-m", "launch.local", "--root", str(tmp_path / "run"), "--model", "/nonexistent/m")
    assert p.returncode != 0 and "--model: /nonexistent/m not found" in p.stderr, p.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no child was started


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_task.build_tokenizer()


def _parquet(path, **row):
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = builtin_task.make_rows(2, 3)
    base[1].update(row)
    pq.write_table(pa.Table.from_pylist(base), path)
    return str(path)


@pytest.mark.parametrize("prompt", [[], [{"role": "user"}], "just text"])
def test_bad_prompt_rows_name_the_file_and_row(tmp_path, tokenizer, prompt):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = builtin_task.make_rows(2, 3)
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "good.parquet")
    # one column per case: a list of structs cannot hold a string row, and vice versa
    table = pa.table({"data_source": ["tandem/copy"], "prompt": [prompt], "reward_model": [rows[0]["reward_model"]]})
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match=rf"{path} row 0: field 'prompt' must be a non-empty list"):
        load_prompts([str(tmp_path / "good.parquet"), str(path)], tokenizer, "prompt", 64)


def _worker(tmp_path, data, *extra, timeout=120):
    return _run(
        "-m",
        "rollout.worker",
        f"root={tmp_path / 'run'}",
        f"data.train_files=[{data}]",
        "worker.id=w0",
        "worker.weights_timeout_s=60",
        *extra,
        timeout=timeout,
    )


def test_unknown_data_source_is_refused_at_start(tmp_path):
    """No weights are published: the worker must not wait for them (nor load an engine) to
    find out that it cannot score the dataset."""
    data = _parquet(tmp_path / "t.parquet", data_source="nobody/knows")
    p, took = _worker(tmp_path, data)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"data_source 'nobody/knows' (in {data}) has no reward function" in p.stderr
    assert took < 50, took  # well under weights_timeout_s: nothing waited for weights
    assert not (tmp_path / "run" / "experience").exists()
    # The validator scores data.val_files the same way: refused before it waits for weights.
    p, took = _run(
        "-m",
        "rollout.validate",
        f"root={tmp_path / 'run'}",
        f"data.val_files=[{data}]",
        "validator.weights_timeout_s=60",
    )
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"data_source 'nobody/knows' (in {data}) has no reward function" in p.stderr
    assert took < 50, took


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("worker.id", "../evil", "worker.id: worker id '../evil'"),
        ("worker.id", "w0\n", "worker.id: worker id 'w0\\n'"),
        ("worker.device", "tpu", "worker.device: 'tpu' is not one of"),
    ],
)
def test_worker_settings_are_refused_at_config_time(key, value, words):
    with pytest.raises(ConfigError) as e:
        build(WorkerConfig, {"root": "/r", "data.train_files": "[x.parquet]", key: value})
    assert words in str(e.value)


def test_inspect_of_a_missing_folder_fails(tmp_path):
    p, _ = _run("-m", "buffer.inspect", str(tmp_path / "nothere"))
    assert p.returncode != 0 and f"run folder {tmp_path / 'nothere'} not found" in p.stderr
    assert not (tmp_path / "nothere").exists()


def test_stopping_a_watch_under_a_stream_of_events_logs_no_error(tmp_path, caplog):
    """watchdog logs 'InotifyEmitter.queue_events() called when the thread is inactive' when an
    event lands while its observer stops (about 1 stop in 8 here before the fix); that line
    ended every clean pool run. Stopping a watch on purpose must log nothing."""
    caplog.set_level(logging.INFO, logger="watchdog")
    for _ in range(40):
        observer = watch(str(tmp_path), lambda event: None, recursive=False)
        stop = threading.Event()

        def churn(stop=stop):
            k = 0
            while not stop.is_set():
                (tmp_path / f"f{k % 5}").write_bytes(b"")
                k += 1

        t = threading.Thread(target=churn)
        t.start()
        time.sleep(0.02)  # let events flow; the stop below lands in the middle of them
        stop_watch(observer)
        stop.set()
        t.join(timeout=30)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]


def test_trainer_wait_says_what_it_has_needs_and_who_is_alive(tmp_path, caplog):
    root = tmp_path / "run"
    from buffer.layout import RunLayout
    from buffer.storage import filesystem

    lay = RunLayout(str(root))
    fs, _ = filesystem(str(root))
    atomic_write_json(
        fs, lay.heartbeat("w7"), {"worker_id": "w7", "state": "running", "last_beat": time.time(), "samples_written": 0}
    )
    reader = ExperienceReader(str(root), BufferConfig(poll_interval=0.05), max_staleness=1)
    caplog.set_level(logging.INFO, logger="buffer.experience.reader")
    try:
        with pytest.raises(TimeoutError, match="w7 running"):
            reader.next_batch(4, current_version=0, timeout_s=1.0, note_every_s=0.2)
    finally:
        reader.close()
    notes = [r.getMessage() for r in caplog.records if "waiting for experience" in r.getMessage()]
    assert notes and "have 0/4 groups (0 samples" in notes[0] and "workers: w7 running" in notes[0]
