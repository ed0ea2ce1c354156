"""Issue 30, items 8-12: a bad version, a full cache disk, a failing reward, a garbage control
file or an unreachable trainer costs that version, that wait, that sample or that file, never
the worker or the run. Real parts throughout: the trainer's weight server and a fetcher on
loopback, the built-in tiny model in a real RolloutWorker, real worker processes for the restart
and signal checks. Cheap by design (seconds each): small versions, waits on events with timeouts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import torch
from conftest import free_port, small_filesystem, subprocess_env
from safetensors.torch import save_file

from buffer.config import BufferConfig
from buffer.experience.net_server import ShardServer
from buffer.weights.fs import WeightStore
from buffer.weights.net_client import WeightFetcher
from buffer.weights.net_server import add_weight_service
from launch.status import snapshot
from protocol.config import build
from protocol.weights import ManifestError
from rollout import builtin_task
from rollout.config import WorkerConfig

TOKEN = "contained-token"


def _wait(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.05)


def _grpc_cfg(tmp_path, port: int, **kw) -> BufferConfig:
    (tmp_path / "token").write_text(TOKEN)
    base = dict(
        transport="grpc",
        grpc_bind=f"127.0.0.1:{port}",
        grpc_address=f"127.0.0.1:{port}",
        grpc_token_file=str(tmp_path / "token"),
        weights_chunk_kb=64,
        weights_peer_fanout=False,
        weights_chunk_timeout_s=10.0,
    )
    return BufferConfig(**{**base, **kw})


def _publish_random(root, version: int, mb: float) -> WeightStore:
    """A version of one safetensors file of `mb` MB and a config.json on `root`'s weights."""
    src = root / f"src{version}"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    g = torch.Generator().manual_seed(version)
    save_file({"a": torch.randn(int(mb * (1 << 20)) // 4, generator=g)}, str(src / "model.safetensors"))
    store = WeightStore(str(root))
    store.publish_hf_folder(src, version=version, step=version, keep=4)
    return store


def _serve_weights(store: WeightStore, cfg: BufferConfig) -> ShardServer:
    """The trainer's rank-0 server with its weight service, over `store`'s versions."""

    def version_dir(v: int) -> str | None:
        d = store.layout.version_dir(v)
        return d if os.path.isdir(d) else None

    server = ShardServer(str(store.layout.root), cfg)
    add_weight_service(server.server, version_dir, TOKEN, cfg)
    return server


# --- 8. a version pruned mid-download fails that fetch at once --------------------------------


def test_a_version_pruned_mid_download_fails_fast(tmp_path):
    port = free_port()
    # 2 MB at 2 MB/s: a second of transfer, long enough to prune the version half-way
    cfg = _grpc_cfg(tmp_path, port, weights_upload_mb_s=2.0, weights_stall_timeout_s=120.0)
    store = _publish_random(tmp_path / "trainer", 1, mb=2)
    server = _serve_weights(store, cfg)
    fetcher = WeightFetcher(f"127.0.0.1:{port}", TOKEN, cfg)
    result: dict = {}

    def fetch() -> None:
        try:
            result["dest"] = fetcher.fetch(1, str(tmp_path / "cache" / "v1"))
        except BaseException as e:  # judged below
            result["error"] = e
        result["at"] = time.monotonic()

    th = threading.Thread(target=fetch)
    try:
        th.start()
        _wait(lambda: 1 in fetcher.stats and fetcher.stats[1].from_trainer >= 2, "the first chunks")
        shutil.rmtree(store.layout.version_dir(1))  # what retention does to an old version
        pruned = time.monotonic()
        th.join(timeout=20)
        assert not th.is_alive(), "the fetch of a pruned version still retries 20 s later"
        assert isinstance(result.get("error"), ManifestError), result
        assert result["at"] - pruned < 10, f"failed {result['at'] - pruned:.1f} s after the prune"
    finally:
        fetcher.close()
        th.join(timeout=30)
        server.stop(grace_s=0.5)


# --- 9. a full weight cache is waited out, then the fetch completes -----------------------------

FULL_CACHE = r"""
import json, logging, os, sys, threading, time
sys.path.insert(0, os.environ["TESTS_DIR"])
from conftest import fill_disk
from buffer.channel import RunClient
from buffer.config import BufferConfig
from buffer.layout import RunLayout
from buffer.weights.net_client import NetWeightSource
from protocol.weights import WeightManifest, verify_files

small, cfg_json, out = sys.argv[1:4]
said = threading.Event()

class Said(logging.Handler):
    def emit(self, record):
        if "disk full at" in record.getMessage():
            said.set()

logging.basicConfig(level=logging.INFO)
logging.getLogger().addHandler(Said())
cfg = BufferConfig(**json.loads(cfg_json))
layout = RunLayout(os.path.join(small, "worker"))
os.makedirs(layout.weights_dir)
source = NetWeightSource(RunClient(cfg), layout, keep=2)
filler = os.path.join(small, "filler")
fill_disk(filler)
got = {}

def fetch():
    try:
        got["folder"] = source.fetch(1)
    except BaseException as e:
        got["error"] = repr(e)

th = threading.Thread(target=fetch)
th.start()
# the fetch fails while the disk is full; freed once it said so, it must resume and finish
deadline = time.monotonic() + 60
while not said.is_set() and th.is_alive() and time.monotonic() < deadline:
    said.wait(timeout=0.1)
full_said = said.is_set()
os.remove(filler)
th.join(timeout=90)
if "folder" in got:
    with open(os.path.join(got["folder"], "manifest.json")) as f:
        verify_files(WeightManifest.from_json(f.read()), got["folder"])
source.close()
json.dump({**got, "said": full_said, "alive": th.is_alive()}, open(out, "w"))
"""


def test_a_full_weight_cache_is_waited_out_not_a_crash(tmp_path):
    port = free_port()
    cfg = _grpc_cfg(tmp_path, port, weights_stall_timeout_s=60.0)
    store = _publish_random(tmp_path / "trainer", 1, mb=2)
    server = _serve_weights(store, cfg)
    small, out, script = tmp_path / "small", tmp_path / "result.json", tmp_path / "full_cache.py"
    small.mkdir()
    script.write_text(FULL_CACHE)
    fields = ("transport", "grpc_address", "grpc_token_file", "weights_chunk_kb", "weights_peer_fanout")
    cfg_json = json.dumps({k: getattr(cfg, k) for k in fields + ("weights_stall_timeout_s",)})
    try:
        p = subprocess.run(
            small_filesystem(small, 8, [sys.executable, str(script), str(small), cfg_json, str(out)]),
            capture_output=True,
            text=True,
            timeout=240,
            env={**subprocess_env(), "TESTS_DIR": os.path.dirname(__file__)},
        )
    finally:
        server.stop(grace_s=0.5)
    assert p.returncode == 0 and out.exists(), p.stdout[-2000:] + p.stderr[-3000:]
    got = json.loads(out.read_text())
    assert "error" not in got and not got["alive"], (got, p.stderr[-3000:])
    assert got["said"], p.stderr[-3000:]  # "disk full at <cache>", a line while it waits
    assert got["folder"] == os.path.join(str(small), "worker", "weights", "v000001"), got


# --- 10. a damaged version is skipped; 11. a reward that raises scores 0 -------------------------


def _worker(tmp_path, store_root, **more):
    from rollout.worker import RolloutWorker

    builtin_task.write_parquet(tmp_path / "t.parquet", builtin_task.make_rows(8, 3))
    args = {
        "root": str(store_root),
        "worker.id": "w",
        "train_files": f"[{tmp_path / 't.parquet'}]",
        "prompts_per_batch": "2",
        "actor_rollout_ref.rollout.n": "2",
        "max_response_length": "4",
        "weights_timeout_s": "30",
        **more,
    }
    return RolloutWorker(build(WorkerConfig, args))


def test_a_damaged_version_is_skipped_and_the_worker_keeps_a_good_one(tmp_path, caplog):
    builtin_task.write_model(tmp_path / "m")
    root = tmp_path / "run"
    store = WeightStore(str(root))
    for v in (0, 1):
        store.publish_hf_folder(tmp_path / "m", v, v, keep=5)
    with open(store.layout.manifest(1), "w") as f:
        f.write("{garbage")  # at start: the newest is bad
    worker = _worker(tmp_path, root)
    caplog.set_level(logging.WARNING, "rollout.worker")
    assert worker.start()
    try:
        assert worker.version == 0 and worker.versions_skipped == 1  # an older good version
        store.publish_hf_folder(tmp_path / "m", 2, 2, keep=5)
        with open(os.path.join(store.layout.version_dir(2), "model.safetensors"), "r+b") as f:
            f.truncate(1000)  # at reload: a truncated file
        assert worker.maybe_reload() is False and worker.version == 0
        assert worker.maybe_reload() is False and worker.versions_skipped == 2  # checked once
        worker.heartbeat("running")
        assert worker.stores.heartbeats.read("w")["versions_skipped"] == 2
        assert snapshot(str(root))["workers"][0]["versions_skipped"] == 2  # launch.status shows it
        named = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
        assert len(named) == 2 and "weight version 1" in named[0] and "weight version 2" in named[1], named
        store.publish_hf_folder(tmp_path / "m", 3, 3, keep=5)
        assert worker.maybe_reload() is True and worker.version == 3  # the next good one loads
    finally:
        worker.engine.close()


RAISING_REWARD = """
def score(data_source, solution_str, ground_truth, extra_info=None):
    return {}["no such key"]  # a reward function with a bug
"""


def test_a_reward_function_that_raises_costs_that_samples_score_only(tmp_path, caplog):
    assert builtin_task.compute_score("tandem/copy", "", "") == 1.0  # was 0 / 0
    assert builtin_task.compute_score("tandem/copy", "12", "") == 0.0
    builtin_task.write_model(tmp_path / "m")
    root = tmp_path / "run"
    WeightStore(str(root)).publish_hf_folder(tmp_path / "m", 0, 0, keep=2)
    (tmp_path / "reward.py").write_text(RAISING_REWARD)
    worker = _worker(
        tmp_path,
        root,
        **{"custom_reward_function.path": str(tmp_path / "reward.py"), "custom_reward_function.name": "score"},
    )
    caplog.set_level(logging.WARNING, "rollout.worker")
    assert worker.start()
    try:
        for _ in range(2):
            assert worker.run_batch() == 0.0
        worker.writer.flush()
        assert worker.reward_failures == 8 and worker.writer.samples_written == 8  # every sample kept, scored 0
        worker.heartbeat("running")
        assert worker.stores.heartbeats.read("w")["reward_failures"] == 8
        named = [r.getMessage() for r in caplog.records if "reward function raised" in r.getMessage()]
        assert len(named) == 1 and "KeyError" in named[0], named  # named once, then counted
    finally:
        worker.engine.close()


# --- 10. launch.local starts a dead worker again, never one that refused ----------------------


def test_launch_local_restarts_a_dead_worker_but_not_a_refusal(tmp_path):
    from launch.local import Child, restart_dead

    builtin_task.write_parquet(tmp_path / "t.parquet", builtin_task.make_rows(4, 3))
    cmd = [
        sys.executable,
        "-m",
        "rollout.worker",
        f"root={tmp_path / 'run'}",
        f"train_files=[{tmp_path / 't.parquet'}]",
    ]
    # waits for a first weight version that never comes (no trainer): alive until killed
    live = Child("worker w0", [*cmd, "worker.id=w0", "weights_timeout_s=300"], str(tmp_path / "w0.log"))
    refused = Child("worker w1", [*cmd, "worker.id=w1", "no_such_key=1"], str(tmp_path / "w1.log"))
    children = [live, refused]
    try:
        first = live.proc.pid
        live.proc.kill()  # our own child: a crash or an OOM kill
        live.proc.wait(timeout=30)
        assert restart_dead([live], max_restarts=1) is None
        assert live.restarts == 1 and live.proc.pid != first and live.poll() is None
        refused.proc.wait(timeout=60)
        assert refused.poll() == 2, (tmp_path / "w1.log").read_text()[-2000:]
        assert restart_dead(children, max_restarts=1) is refused and refused.restarts == 0  # it would refuse again
        live.proc.kill()
        live.proc.wait(timeout=30)
        assert restart_dead([live], max_restarts=1) is live and live.restarts == 1  # once too often
    finally:
        for child in children:
            if child.poll() is None:
                child.proc.kill()
                child.proc.wait(timeout=30)
            child.log.close()


# --- 12. a garbage control.json is set aside; commands go on being accepted -------------------


def test_a_garbage_control_file_is_set_aside_and_commands_go_on(tmp_path, caplog):
    from buffer.run import setup_trainer_run
    from launch import control as launch_control

    root = tmp_path / "run"
    root.mkdir()
    run = setup_trainer_run(str(root))
    garbage = b"\xff\xfe{ not json"
    (root / "control.json").write_bytes(garbage)
    assert launch_control.main(["--root", str(root), "add", "2"]) == 0
    aside = [p for p in root.iterdir() if p.name.startswith("control.json.damaged-")]
    assert len(aside) == 1 and aside[0].read_bytes() == garbage  # kept for whoever wrote it
    assert aside[0].name in caplog.text  # and named (launch.control prints it)
    assert launch_control.main(["--root", str(root), "remove", "1"]) == 0
    cmds, errors = run.control.commands()
    assert [(c.action, c.count) for c in cmds] == [("add", 2), ("remove", 1)] and errors == []


# --- SIGTERM interrupts a call waiting for an unreachable trainer -----------------------------


def test_sigterm_stops_a_worker_waiting_for_an_unreachable_trainer(tmp_path):
    port = free_port()  # nothing listens there: the trainer is gone
    (tmp_path / "token").write_text(TOKEN)
    builtin_task.write_parquet(tmp_path / "t.parquet", builtin_task.make_rows(4, 3))
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollout.worker",
                f"root={tmp_path / 'own'}",
                f"train_files=[{tmp_path / 't.parquet'}]",
                "worker.id=w0",
                "buffer.transport=grpc",
                f"buffer.grpc_address=127.0.0.1:{port}",
                f"buffer.grpc_token_file={tmp_path / 'token'}",
                "buffer.grpc_trainer_wait_s=600",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=subprocess_env(),
        )
    try:
        _wait(lambda: b"waiting for the trainer's run service" in log_path.read_bytes(), "the worker to wait", 90)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = proc.wait(timeout=30)
        took = time.monotonic() - sent
        assert code == 0 and took < 10, f"exit {code} after {took:.1f} s:\n{log_path.read_text()[-2000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
