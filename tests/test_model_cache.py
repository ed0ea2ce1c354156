"""launch.local's built-in initial model comes from a per-machine cache (launch/local.py
`initial_model`): the same bytes as building it, built once, and a run still starts when the
cache cannot be written."""

from __future__ import annotations

import hashlib
import os

import pytest

from launch import local
from rollout import builtin_task


def _digests(folder) -> dict[str, str]:
    return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in sorted(os.listdir(folder))}


def test_the_cached_initial_model_is_the_built_one_and_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv(local.CACHE_ENV, str(tmp_path / "cache"))
    builtin_task.write_model(tmp_path / "fresh")
    local.initial_model(str(tmp_path / "a"), "copy")
    assert _digests(tmp_path / "a") == _digests(tmp_path / "fresh")  # the seeded build, byte for byte

    def no_build(out_dir, task):
        raise AssertionError(f"built again into {out_dir}")

    monkeypatch.setattr(local, "_write_model", no_build)  # a second run copies the cache
    old = os.umask(0o002)  # ... with its own umask's modes (a shared cluster's group reads it)
    try:
        local.initial_model(str(tmp_path / "b"), "copy")
    finally:
        os.umask(old)
    assert _digests(tmp_path / "b") == _digests(tmp_path / "fresh")
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "b").iterdir()} == {0o664}
    assert not [p for p in (tmp_path / "cache" / "init-models").iterdir() if ".tmp" in p.name]
    with pytest.raises(AssertionError, match="built again"):  # another task is another key
        local.initial_model(str(tmp_path / "c"), "arith")


def test_an_unwritable_cache_builds_in_the_run_folder(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "not-a-folder"
    cache.write_text("")  # no folder can be made under a file, whoever runs this (root too)
    monkeypatch.setenv(local.CACHE_ENV, str(cache))
    local.initial_model(str(tmp_path / "m"), "copy")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert "no model cache" in capsys.readouterr().err
