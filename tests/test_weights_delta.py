"""Weight versions as exact deltas (buffer/weights/delta.py) through the real stores: the trainer's
WeightStore publishing a real tiny model's tensors with random sparse updates, the real run
service and weight service on loopback, network workers with their own caches, and a real worker
process killed (kill -9, by its pid) while it rebuilds a version."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import free_port, subprocess_env
from safetensors.torch import load_file, save_file

from buffer.config import BufferConfig
from buffer.layout import TMP_MARK
from buffer.run import setup_trainer_run, setup_worker_run
from buffer.weights import delta
from buffer.weights.fs import FsWeightSource, read_tensors
from rollout.config import WorkerConfig

TOKEN = "delta-token"


def _cfg(tmp_path, port) -> BufferConfig:
    (tmp_path / "token").write_text(TOKEN)
    return BufferConfig(
        transport="grpc",
        grpc_bind=f"127.0.0.1:{port}",
        grpc_address=f"127.0.0.1:{port}",
        grpc_token_file=str(tmp_path / "token"),
        grpc_call_timeout_s=10,
        grpc_trainer_wait_s=20,
        grpc_linger_s=0,
        weights_chunk_kb=256,
        weights_peer_host="127.0.0.1",
        weights_peer_refresh_s=0.2,
        weights_stall_timeout_s=60,
    )


def _qwen_shaped(folder, hidden: int, layers: int, vocab: int = 384) -> dict[str, torch.Tensor]:
    """A Qwen2-shaped tiny model's HF tensor names and shapes with random values, and its
    config.json: what the trainer publishes, without building the model (transformers' import
    alone is seconds on a loaded box). bf16 as a GPU trainer publishes; the norms fp32, so both
    dtypes go through deltas."""
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab})
    )
    g = torch.Generator().manual_seed(1)
    ffn = hidden * 11 // 4
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}self_attn.{name}.weight"] = (hidden, hidden)
        shapes |= {f"{p}mlp.gate_proj.weight": (ffn, hidden), f"{p}mlp.up_proj.weight": (ffn, hidden)}
        shapes |= {f"{p}mlp.down_proj.weight": (hidden, ffn), f"{p}input_layernorm.weight": (hidden,)}
    return {
        k: torch.randn(s, generator=g).to(torch.float32 if len(s) == 1 else torch.bfloat16) for k, s in shapes.items()
    }


class _Run:
    """The trainer's run folder and run server; `step()` changes a random sparse share of the
    model's values (as an RL step at a small learning rate does) and publishes a version."""

    def __init__(self, tmp_path, full_freq: int, hidden: int = 64, layers: int = 2, keep: int = 3):
        self.tmp_path, self.keep = tmp_path, keep
        self.now = _qwen_shaped(tmp_path / "model", hidden, layers)
        self.trainer = setup_trainer_run(str(tmp_path / "trainer"))
        self.trainer.state.ensure_run_id()
        self.store = self.trainer.publisher
        self.store.publish_full_freq = full_freq
        self.cfg = _cfg(tmp_path, free_port())
        self.server = self.trainer.serve(self.cfg)
        self.truth: dict[int, dict[str, torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(0)
        self.version = -1
        self.workers: list = []
        self.step(density=0.0)

    def step(self, density: float = 0.03) -> int:
        for t in self.now.values():
            hit = torch.rand(t.shape, generator=self.gen) < density
            t[hit] = (t[hit].float() + torch.randn(int(hit.sum()), generator=self.gen) * 0.01).to(t.dtype)
        self.version += 1
        self.store.publish_hf_folder(self.tmp_path / "model", self.version, self.version, self.keep, tensors=self.now)
        self.truth[self.version] = {k: v.clone() for k, v in self.now.items()}
        return self.version

    def worker(self, name: str = "worker"):
        self.workers.append(setup_worker_run(WorkerConfig(root=str(self.tmp_path / name), buffer=self.cfg)))
        return self.workers[-1]

    def stop(self):
        for w in self.workers:
            w.weights.close()
        self.server.stop(grace_s=1)


@pytest.fixture
def run(tmp_path):
    made = []

    def start(**kw):
        made.append(_Run(tmp_path, **kw))
        return made[-1]

    yield start
    for r in made:
        r.stop()


def _exact(files, want: dict[str, torch.Tensor]) -> bool:
    got = dict(read_tensors(files))
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want
    )


def test_fifty_versions_rebuild_bit_exact_from_deltas(run):
    """50 versions, a snapshot every 8: a network worker rebuilds every delta bit for bit (and
    moves a small share of a full version for each); a reader on the shared folder rebuilds the
    kept versions from the deltas alone; retention keeps each kept delta's chain; a worker that
    joins late takes a delta from the first one (peer fan-out serves deltas too)."""
    r = run(full_freq=8)
    worker = r.worker()
    full_bytes = worker.weights.version_bytes(0) if worker.weights.fetch(0) else 0
    delta_bytes = []
    for _ in range(49):
        v = r.step()
        assert _exact(worker.weights.files(v), r.truth[v]), f"v{v} rebuilt differently"
        manifest = r.store.manifest(v)
        assert (manifest.base is None) == (v % 8 == 0), f"v{v}: base {manifest.base}"
        if manifest.base is not None:
            delta_bytes.append(worker.weights.version_bytes(v))
    assert max(delta_bytes) < 0.5 * full_bytes, (max(delta_bytes), full_bytes)
    # peer fan-out: a second worker takes the delta v49 from the first (which serves it)
    late = r.worker("late")
    assert _exact(late.weights.files(49), r.truth[49])
    assert late.weights._fetcher.stats[49].from_peers > 0, late.weights._fetcher.stats[49]
    # v47..49 kept, and their chain back to the snapshot v40; nothing else
    assert r.store.versions() == list(range(40, 50))
    shutil.rmtree(os.path.join(r.store.dir, delta.FULL_DIR))  # the trainer's own rebuilt copies
    reader = FsWeightSource(r.trainer.fs, r.trainer.files)
    for v in (47, 49):  # deltas (v48 is a snapshot): rebuilt on the shared folder
        assert _exact(reader.files(v), r.truth[v])
        assert reader.files(v)[0].startswith(os.path.join(r.store.dir, delta.FULL_DIR))


def test_a_lost_base_makes_the_worker_ask_for_a_snapshot(run):
    """A delta whose base is gone (not held by the worker, not published any more) raises
    BaseMissing; the worker asks the trainer over the run service, and the trainer's next
    version is full although its schedule says delta; the worker loads that one."""
    r = run(full_freq=10)
    r.step()
    worker = r.worker()
    v = r.step()
    for gone in (0, 1):  # as a prune racing a reader's chain walk leaves it
        shutil.rmtree(r.store.layout.version_dir(gone))
        shutil.rmtree(delta.full_dir(r.store.dir, gone), ignore_errors=True)
    with pytest.raises(delta.BaseMissing, match="is a delta of version 1"):
        worker.weights.fetch(v)
    worker.weights.request_snapshot(v)  # what RolloutWorker.maybe_reload does on BaseMissing
    v = r.step()
    assert r.store.manifest(v).base is None, "the trainer did not publish the snapshot asked for"
    assert _exact(worker.weights.files(v), r.truth[v])
    assert r.store.manifest(r.step()).base == v  # deltas again after it


def test_a_corrupted_delta_is_caught_by_the_rebuilt_checksum_and_fetched_again(run, caplog):
    """The worker's copy of a delta is damaged in a way its own file checksum cannot see (its
    manifest entry rewritten to match): the rebuilt file fails the trainer's sha256, the copy is
    dropped and fetched again, and the version rebuilt from it is exact."""
    r = run(full_freq=10)
    worker = r.worker()
    worker.weights.fetch(0)
    v = r.step()
    _damage(worker.weights._published(v))  # the delta in the worker's cache, not yet rebuilt
    with caplog.at_level(logging.WARNING, logger="buffer.weights.delta"):
        assert _exact(worker.weights.files(v), r.truth[v])
    assert "does not match the trainer's sha256" in caplog.text


def _damage(folder, later=None) -> None:
    """Flip one bit of a changed value in a cached delta, its manifest entry rewritten to match
    (so only the rebuilt file's checksum can tell). `later`: a later delta of the chain, which
    must not set that position again (it would repair the damage)."""
    from safetensors import safe_open

    from buffer.weights.fs import describe_files

    name = next(n for n in os.listdir(folder) if n.startswith(delta.PREFIX))
    tensors = load_file(os.path.join(folder, name))
    key = next(k for k in tensors if k.endswith("::val"))
    i = 0
    if later is not None:
        tensor = key.removesuffix("::val")
        with (
            safe_open(os.path.join(folder, name), framework="pt") as d,
            safe_open(os.path.join(later, name), framework="pt") as e,
        ):
            mine = delta._positions_of(d, tensor, set(d.keys())).tolist()
            again = delta._positions_of(e, tensor, set(e.keys()))
        again = set() if again is None else set(again.tolist())
        i = next(j for j, at in enumerate(mine) if at not in again)
    tensors[key] = tensors[key].clone()
    tensors[key].view(torch.int16 if tensors[key].element_size() == 2 else torch.int32)[i] ^= 1
    save_file(tensors, os.path.join(folder, name))
    manifest = delta.read_manifest(folder)
    manifest.files, _ = describe_files(folder, [f.name for f in manifest.files])
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        f.write(manifest.to_json())


def test_a_lagging_worker_rebuilds_only_the_version_it_asks_for(run, caplog):
    """A worker holding v0 asks for v5 (v1..v5 each a delta on the one before): v5 is rebuilt on
    v0 with the four deltas between applied in memory, one folder written and hashed instead of
    five, bit for bit. Then, with a damaged delta in the middle of a chain, the rebuilt checksum
    catches it and the version-by-version path fetches that copy again: exact all the same."""
    r = run(full_freq=100)
    worker = r.worker()
    worker.weights.fetch(0)
    for _ in range(5):
        r.step()
    rebuilt = os.path.join(worker.weights.layout.weights_dir, delta.FULL_DIR)
    with caplog.at_level(logging.INFO, logger="buffer.weights.delta"):
        assert _exact(worker.weights.files(5), r.truth[5])
    assert os.listdir(rebuilt) == [os.path.basename(delta.full_dir(rebuilt, 5))], "one folder, not one per version"
    assert "through 4 deltas in memory" in caplog.text
    for _ in range(3):
        r.step()
    for v in (6, 7):
        worker.weights._published(v)
    _damage(worker.weights._published(7), later=worker.weights._published(8))  # v5 -> v6, v7 (damaged) -> v8
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="buffer.weights.delta"):
        assert _exact(worker.weights.files(8), r.truth[8])
    assert "rebuilding version by version" in caplog.text and "does not match the trainer's sha256" in caplog.text


def test_a_worker_killed_mid_apply_resumes_with_nothing_lost(run, tmp_path):
    """A real worker process rebuilds a chain of deltas and is killed -9 (by its pid) while a
    rebuild is half written: the deltas it fetched stay (not fetched again), no half-written
    version is ever visible, and the next process rebuilds the version exactly."""
    r = run(full_freq=100, hidden=256, layers=4, keep=8)
    for _ in range(7):
        r.step()
    script = (
        "import sys, dataclasses, json\n"
        "from buffer.config import BufferConfig\n"
        "from buffer.run import setup_worker_run\n"
        "from rollout.config import WorkerConfig\n"
        "cfg = BufferConfig(**json.loads(sys.argv[2]))\n"
        "run = setup_worker_run(WorkerConfig(root=sys.argv[1], buffer=cfg))\n"
        "for v in range(8):\n"
        "    run.weights._published(v)\n"  # every delta fetched first, then the rebuilds
        "print('fetched', flush=True)\n"
        "run.weights.fetch(7)\n"
        "print('rebuilt', flush=True)\n"
    )
    import dataclasses
    import json

    rebuilt = tmp_path / "worker" / "weights" / delta.FULL_DIR
    caught = False
    for _attempt in range(3):
        shutil.rmtree(rebuilt, ignore_errors=True)
        child = subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / "worker"), json.dumps(dataclasses.asdict(r.cfg))],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout.readline().strip() == "fetched"
            deadline = time.monotonic() + 60
            while child.poll() is None and time.monotonic() < deadline:
                if rebuilt.is_dir() and any(TMP_MARK in n for n in os.listdir(rebuilt)):
                    os.kill(child.pid, signal.SIGKILL)
                    caught = True
                    break
                time.sleep(0.001)
        finally:
            if child.poll() is None and not caught:
                os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
        if caught:
            break
    assert caught, "the worker finished every rebuild before it could be killed mid-apply (3 tries)"
    assert any(TMP_MARK in n for n in os.listdir(rebuilt)), "killed mid-apply: a temp folder is left"
    for name in os.listdir(rebuilt):  # what is there under a version name is complete
        if TMP_MARK not in name:
            assert delta.held_full(str(rebuilt / name), int(name[1:]))
    worker = r.worker()
    assert _exact(worker.weights.files(7), r.truth[7])
    stats = worker.weights._fetcher.stats if worker.weights._fetcher else {}
    assert all(s.from_trainer == 0 and s.from_peers == 0 for s in stats.values()), "fetched again"
    assert not any(TMP_MARK in n for n in os.listdir(rebuilt)), "the killed rebuild's temp folder stays"


def test_a_version_of_several_files_makes_the_same_delta_on_one_thread_and_on_four(tmp_path, monkeypatch):
    """make_delta compares a version's files on threads of their own (the trainer waits for
    it): one thread and four write the same delta files, bit for bit, with the same counts; and
    a version too dense to pay is refused (None) on four as on one."""
    from benchmarks import delta_make

    monkeypatch.setattr(delta_make, "FILE_MB", 1)  # 4 files of 1 MiB
    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.w": torch.randn(256, 1024, generator=g).bfloat16() for i in range(8)}
    store = setup_trainer_run(str(tmp_path / "run")).publisher
    for v, density in ((0, 0.0), (1, 0.03), (2, 0.9)):
        for t in tensors.values():
            hit = torch.rand(t.shape, generator=g) < density
            t[hit] = (t[hit].float() + 0.01).bfloat16()
        delta_make._folder(str(tmp_path / f"m{v}"), tensors)
        store.publish_hf_folder(str(tmp_path / f"m{v}"), v, v, 3)
    folders = [store.layout.version_dir(v) for v in range(3)]
    manifests = [delta.read_manifest(f) for f in folders]
    assert len(manifests[1].files) >= 4 + 1  # the safetensors files, the config and index
    made = {}
    for threads in (1, 4):
        out = tmp_path / f"delta{threads}"
        out.mkdir()
        result = delta.make_delta(folders[1], manifests[1], folders[0], manifests[0], str(out), threads=threads)
        assert result is not None
        made[threads] = (result[1], {p.name: p.read_bytes() for p in sorted(out.iterdir())})
        dense = tmp_path / f"dense{threads}"
        dense.mkdir()
        assert delta.make_delta(folders[2], manifests[2], folders[1], manifests[1], str(dense), threads=threads) is None
    assert made[1] == made[4]
    stats = made[4][0]
    assert stats.values == 8 * 256 * 1024 and 0.02 < stats.density < 0.04
