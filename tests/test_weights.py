"""Weight versions: atomic publish, manifest, checksum verification, in-place load, retention."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from buffer.weights import WeightStore
from protocol.weights import ManifestError
from rollout import builtin_task
from rollout.engine import HFEngine
from trainer.publish import copy_model_metadata


@pytest.fixture
def model_dir(tmp_path):
    builtin_task.write_model(tmp_path / "init")
    return str(tmp_path / "init")


def _publish_scaled(store, engine, model_dir, version, scale, keep=3):
    state = {k: (v * scale).contiguous() for k, v in engine.model.state_dict().items()
             if k != "lm_head.weight"}
    staged = store.stage(version)
    save_file(state, os.path.join(staged, "model.safetensors"))
    copy_model_metadata(model_dir, staged)
    return store.publish(staged, version, step=version * 10, keep=keep), state


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
    loaded = engine.load_weights(store.tensors(1))
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
        list(store.tensors(1))


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


def test_publish_splits_tensors_across_ranks_by_bytes():
    from trainer.publish import _owners
    owners = _owners([100, 10, 10, 60, 30], world=2)
    loads = [sum(s for s, o in zip([100, 10, 10, 60, 30], owners) if o == r) for r in range(2)]
    assert sorted(loads) == [100, 110]
    assert _owners([5, 5], world=1) == [0, 0]
