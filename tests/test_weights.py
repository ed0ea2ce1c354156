"""Weight versions: atomic publish, manifest, checksum verification, in-place load, retention."""

import json
import os
import shutil

import pytest
import torch

from buffer.weights.fs import WeightStore
from protocol.weights import ManifestError, verify_files
from rollout import builtin_task
from rollout.engine import HFEngine


@pytest.fixture
def model_dir(tmp_path):
    builtin_task.write_model(tmp_path / "init")
    return str(tmp_path / "init")


def _publish_scaled(store, engine, model_dir, version, scale, keep=3):
    state = {k: (v * scale).contiguous() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    return store.publish_hf_folder(model_dir, version, version * 10, keep, tensors=state), state


def test_publish_manifest_and_in_place_load(tmp_path, model_dir):
    store = WeightStore(str(tmp_path / "run"))
    engine = HFEngine(model_dir)
    params_before = {n: p for n, p in engine.model.named_parameters()}
    manifest, state = _publish_scaled(store, engine, model_dir, 1, 0.5)
    assert store.latest() == 1
    assert json.loads(open(store.layout.latest_pointer).read()) == {"version": 1, "step": 10}
    assert set(manifest.tensors) == set(state)
    assert manifest.tensors["model.embed_tokens.weight"].shape == list(state["model.embed_tokens.weight"].shape)
    assert {f.name for f in manifest.files} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert not any(".tmp-" in p for p in os.listdir(store.layout.weights_dir))
    loaded = engine.load_files(store.files(1))
    assert loaded == len(state)
    for name, p in engine.model.named_parameters():
        assert p is params_before[name]  # same storage: loaded in place, not rebuilt
    sd = engine.model.state_dict()
    for name, t in state.items():
        assert torch.equal(sd[name], t)
    # The version folder is a complete HF model folder.
    assert HFEngine(store.layout.version_dir(1)).model.config.vocab_size == engine.model.config.vocab_size


def test_corrupt_version_is_refused(tmp_path, model_dir):
    store = WeightStore(str(tmp_path / "run"))
    engine = HFEngine(model_dir)
    _publish_scaled(store, engine, model_dir, 1, 2.0)
    path = os.path.join(store.layout.version_dir(1), "model.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(ManifestError, match="checksum"):
        store.files(1)


def test_engine_rejects_foreign_tensor_names(model_dir):
    engine = HFEngine(model_dir)
    with pytest.raises(KeyError, match="not a parameter"):
        engine.load_weights([("model.nonexistent.weight", torch.zeros(1))])


def test_only_newest_versions_are_kept(tmp_path, model_dir):
    store = WeightStore(str(tmp_path / "run"))
    engine = HFEngine(model_dir)
    for v in range(5):
        _publish_scaled(store, engine, model_dir, v, 1.0, keep=2)
    assert store.versions() == [3, 4]
    with pytest.raises(FileExistsError):
        _publish_scaled(store, engine, model_dir, 4, 1.0, keep=2)


def test_publish_hf_folder_verifies_and_loads_back(tmp_path, model_dir):
    from safetensors.torch import load_file

    store = WeightStore(str(tmp_path / "run"))
    manifest = store.publish_hf_folder(model_dir, 0, 0, keep=2)
    folder = store.layout.version_dir(0)
    assert store.latest() == 0 and store.manifest(0).to_json() == manifest.to_json()
    verify_files(manifest, folder)  # every file, metadata included, matches its checksum
    assert {f.name for f in manifest.files} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert not any(".tmp-" in p for p in os.listdir(store.layout.weights_dir))
    source = load_file(os.path.join(model_dir, "model.safetensors"))
    loaded = dict(store.tensors(0))
    assert set(loaded) == set(source) == set(manifest.tensors)
    for name, t in source.items():
        assert torch.equal(loaded[name], t)
    # A sharded HF folder keeps its index, so the version is still a loadable HF folder.
    sharded = tmp_path / "sharded"
    HFEngine(model_dir).model.save_pretrained(sharded, max_shard_size="100KB")
    builtin_task.build_tokenizer().save_pretrained(sharded)
    manifest = store.publish_hf_folder(sharded, 1, 1, keep=2)
    assert len({t.file for t in manifest.tensors.values()}) > 1
    assert "model.safetensors.index.json" in {f.name for f in manifest.files}
    verify_files(manifest, store.layout.version_dir(1))
    assert {k: v for k, v in store.tensors(1)}.keys() == source.keys()
    HFEngine(store.layout.version_dir(1))


def test_publish_hf_folder_refuses_a_bad_folder(tmp_path, model_dir):
    store = WeightStore(str(tmp_path / "run"))
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        store.publish_hf_folder(missing, 0, 0, keep=2)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(model_dir, "config.json"), no_weights)
    with pytest.raises(ValueError, match=f"{no_weights}.*safetensors"):
        store.publish_hf_folder(no_weights, 0, 0, keep=2)
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    os.link(os.path.join(model_dir, "model.safetensors"), no_config / "model.safetensors")
    with pytest.raises(ValueError, match=f"{no_config}.*config.json"):
        store.publish_hf_folder(no_config, 0, 0, keep=2)
    assert store.latest() is None and store.versions() == []
    # A failure after staging (the version exists already) leaves no staging folder behind.
    store.publish_hf_folder(model_dir, 0, 0, keep=2)
    with pytest.raises(FileExistsError):
        store.publish_hf_folder(model_dir, 0, 0, keep=2)
    assert not any(".tmp-" in p for p in os.listdir(store.layout.weights_dir))
    assert store.versions() == [0]


def test_publish_splits_tensors_across_ranks_by_bytes():
    from trainer.publish import _owners

    owners = _owners([100, 10, 10, 60, 30], world=2)
    loads = [sum(s for s, o in zip([100, 10, 10, 60, 30], owners) if o == r) for r in range(2)]
    assert sorted(loads) == [100, 110]
    assert _owners([5, 5], world=1) == [0, 0]


def test_write_file_entries_equal_a_described_read_back(tmp_path):
    """The trainer's publish takes sizes, sha256 and tensor entries from the bytes it writes;
    they must be what reading the file back gives (and what workers verify against)."""
    from safetensors.torch import load_file

    tensors = {
        "a.weight": torch.randn(7, 5),
        "b.bias": torch.randn(3).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False]),
        "strided": torch.randn(4, 6).t(),
    }
    entry, entries = WeightStore.write_file(str(tmp_path), "x.safetensors", tensors)
    files, described = WeightStore.describe(str(tmp_path), ["x.safetensors"])
    assert [entry] == files and entries == described
    assert sorted({e.dtype for e in entries.values()}) == ["BF16", "BOOL", "F32", "I64"]
    back = load_file(tmp_path / "x.safetensors")  # the reference reader accepts the file
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="bad: dtype"):
        WeightStore.write_file(str(tmp_path), "y.safetensors", {"bad": torch.zeros(2, dtype=torch.complex64)})


def test_publish_bucket_round_trips_through_one_flat_copy():
    """A publish bucket crosses to the host as one flat byte buffer; the views cut back out of
    it must be the tensors (shapes, 0-d and empty included)."""
    from trainer.publish import _flat_bytes, _unflatten

    bucket = {
        "a": torch.randn(3, 4),
        "s": torch.tensor(2.0),
        "e": torch.zeros(0, 3),
        "t": torch.randn(4, 6).t(),
        "b": torch.randn(5),
    }
    back = _unflatten(_flat_bytes(bucket).clone(), bucket)
    assert list(back) == list(bucket)
    assert all(back[k].shape == v.shape and torch.equal(back[k], v) for k, v in bucket.items())


def test_publish_in_many_small_buckets_with_few_writers(tmp_path, monkeypatch):
    """More buckets than writer threads: the submit path may wait for a writer (memory bound);
    every tensor still lands once, in a version whose checksums verify."""
    import socket

    import torch.distributed as dist

    from trainer import publish

    monkeypatch.setattr(publish, "BUCKET_BYTES", 16 << 10)
    monkeypatch.setattr(publish, "WRITERS", 2)
    builtin_task.write_model(tmp_path / "m", seed=3)
    model = HFEngine(str(tmp_path / "m")).model
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        store = WeightStore(str(tmp_path / "run"))
        metrics = publish.publish_version(model, store, str(tmp_path / "m"), 1, 1, keep=2)
    finally:
        dist.destroy_process_group()
    manifest = store.manifest(1)
    assert len([f for f in manifest.files if f.name.endswith(".safetensors")]) > 2 * publish.WRITERS
    published = dict(store.tensors(1))  # verifies every checksum first
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert published.keys() == expected.keys()
    assert all(torch.equal(published[k], v) for k, v in expected.items())
    assert metrics["weights/bytes"] == sum(v.numel() * 4 for v in expected.values())


def test_adapter_manifest_round_trip_and_base_checksum(tmp_path, model_dir):
    """An adapter-only manifest keeps its `adapter` field through JSON, a full one reads as before
    (no key), a malformed field is refused, and base_checksum follows the base's bytes."""
    from protocol.weights import WeightManifest, base_checksum

    base = base_checksum(model_dir)
    assert base == base_checksum(model_dir)  # deterministic
    adapter = {"base": base, "rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    m = WeightManifest(version=3, step=3, created_at=0.0, files=[], tensors={}, adapter=adapter)
    assert WeightManifest.from_json(m.to_json()).adapter == adapter
    full = WeightManifest(version=3, step=3, created_at=0.0, files=[], tensors={})
    assert "adapter" not in full.to_json() and WeightManifest.from_json(full.to_json()).adapter is None
    with pytest.raises(ManifestError, match="adapter"):
        WeightManifest.from_json(m.to_json().replace('"rank": 8', '"rank": 0'))
    copy = tmp_path / "base"
    shutil.copytree(model_dir, copy)
    assert base_checksum(copy) == base
    st = next(copy.glob("*.safetensors"))
    data = bytearray(st.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    st.write_bytes(bytes(data))
    assert base_checksum(copy) != base
    with pytest.raises(ManifestError, match="no .*safetensors"):
        base_checksum(tmp_path)
