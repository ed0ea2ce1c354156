"""Weight versions on the run folder: the trainer publishes (`WeightStore`), workers read in
place (`FsWeightSource`).

A version is staged in a hidden temporary folder, fsynced, renamed to `weights/v<N>/`, and only
then announced by atomically replacing `weights/LATEST`. A reader that follows LATEST therefore
never sees a partial version; it still verifies checksums against the manifest before loading.
Only the newest `keep` versions are kept on disk, plus up to `keep` older ones that wait for
validation (FsValidation, buffer/control/fs.py). Tensors are read and written by
buffer/weights/tensors.py, imported where they are (it imports torch; the tools on the run
folder never need it).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from buffer.control.fs import FsStore, FsValidation
from buffer.layout import TMP_MARK, RunLayout
from buffer.storage import atomic_write_json, filesystem, fsync_tree, read_json, when_space
from buffer.weights.base import WeightPublisher, WeightSource
from protocol.weights import FileEntry, ManifestError, TensorEntry, WeightManifest, verify_files

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class FsWeightSource(FsStore, WeightSource):
    """weights/LATEST and weights/v<N>/ of the run folder, read in place."""

    def pointer(self) -> dict | None:
        return read_json(self.fs, self.layout.latest_pointer)

    def manifest(self, version: int) -> WeightManifest:
        path = self.layout.manifest(version)
        try:
            text = self.fs.cat_file(path).decode()
        except FileNotFoundError:
            raise ManifestError(f"{path}: missing (version pruned or never published)") from None
        manifest = WeightManifest.from_json(text, where=path)
        if manifest.version != version:
            raise ManifestError(f"{path}: says version {manifest.version}, expected {version}")
        return manifest

    def fetch(self, version: int) -> str:
        # Engines read the files themselves (vLLM's worker processes open them directly), so
        # the bytes are checked once here and never shipped between processes.
        folder = self.layout.version_dir(version)
        verify_files(self.manifest(version), folder)
        return folder

    def files(self, version: int) -> list[str]:
        manifest = self.manifest(version)
        folder = self.layout.version_dir(version)
        verify_files(manifest, folder)
        return [os.path.join(folder, f) for f in sorted({t.file for t in manifest.tensors.values()})]

    def exists(self, version: int) -> bool:
        return self.fs.isdir(self.layout.version_dir(version))

    def where(self) -> str:
        return self.layout.latest_pointer

    def tensors(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Verify the version's checksums, then yield its tensors one at a time (bounded memory)."""
        from buffer.weights.tensors import read_tensors  # torch: where tensors are read
        yield from read_tensors(self.files(version))


def copy_model_metadata(model_path: str, dest: str) -> None:
    """Config, generation config and tokenizer files: what makes a version an HF model folder."""
    for name in os.listdir(model_path):
        src = os.path.join(model_path, name)
        # A model folder that is itself a published version (an SFT output) has a manifest of
        # its own files: never carry it into another version.
        if os.path.isfile(src) and not name.endswith(_WEIGHT_SUFFIXES) and name != "manifest.json":
            shutil.copy2(src, os.path.join(dest, name))


def hf_folder_problem(folder: str) -> str | None:
    """Why `folder` cannot be an HF model folder, or None; cheap, checked before any loading."""
    if not os.path.isdir(folder):
        return f"{folder} not found (an HF model folder: config.json, weights, tokenizer)"
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return f"{folder} is not an HF model folder (no config.json)"
    return None


class WeightStore(FsWeightSource, WeightPublisher):
    """The trainer's weights on its run folder: it publishes and prunes versions, and reads
    them as any FsWeightSource does (a trainer resuming, tests, launch tools)."""

    def __init__(self, root: str):
        fs, root_path = filesystem(root)
        super().__init__(fs, RunLayout(root_path))
        self.announced_at: float | None = None  # unix time of the last publish()'s announcement
        self.validation = FsValidation(fs, self.layout)

    # --- trainer side -------------------------------------------------------------------
    @property
    def dir(self) -> str:
        return self.layout.weights_dir

    def stage(self, version: int) -> str:
        """A fresh local staging folder for `version`; fill it, then call `publish`."""
        tmp = self.layout.version_tmp(version, os.getpid())
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        return tmp

    @staticmethod
    def describe(folder: str, names: list[str]) -> tuple[list[FileEntry], dict[str, TensorEntry]]:
        """buffer.weights.tensors.describe_files: trainer ranks describe the files they wrote."""
        from buffer.weights.tensors import describe_files  # torch: where tensors are written
        return describe_files(folder, names)

    @staticmethod
    def write_file(folder: str, name: str, tensors: Mapping[str, torch.Tensor]
                   ) -> tuple[FileEntry, dict[str, TensorEntry]]:
        """buffer.weights.tensors.write_file: `tensors` as a safetensors file, hashed as written."""
        from buffer.weights.tensors import write_file  # torch: where tensors are written
        return write_file(folder, name, tensors)

    def publish(self, staged: str, version: int, step: int, keep: int,
                described: tuple[list[FileEntry], dict[str, TensorEntry]] | None = None,
                announce: dict | None = None) -> WeightManifest:
        """Write the manifest for the files in `staged` (those not `described` already are
        described here), rename into place, announce (`announce`: extra fields of LATEST, e.g.
        protocol.weights.SYNC_GROUPS), prune."""
        files, tensors = described or ([], {})
        known = {f.name for f in files}
        more_files, more_tensors = self.describe(
            staged, [n for n in sorted(os.listdir(staged)) if n not in known])
        files = sorted([*files, *more_files], key=lambda f: f.name)
        tensors = {**tensors, **more_tensors}
        manifest = WeightManifest(version=version, step=step, created_at=time.time(),
                                  files=files, tensors=tensors)
        when_space(lambda: Path(staged, "manifest.json").write_text(manifest.to_json()), staged)
        fsync_tree(staged)
        final = self.layout.version_dir(version)
        if os.path.exists(final):
            raise FileExistsError(f"{final} already exists: weight versions are never rewritten")
        os.rename(staged, final)
        # Taken before LATEST names the version: no worker can have loaded it earlier (the
        # weight-sync latency in launch.report is never negative on one clock).
        self.announced_at = time.time()
        when_space(lambda: atomic_write_json(self.fs, self.layout.latest_pointer,
                                             {**(announce or {}), "version": version, "step": step}),
                   self.layout.latest_pointer)
        self.prune(keep)
        return manifest

    def publish_hf_folder(self, folder: str | os.PathLike, version: int, step: int, keep: int, *,
                          tensors: Mapping[str, torch.Tensor] | None = None) -> WeightManifest:
        """Publish an HF model folder (safetensors weights + config/tokenizer files) as `version`.

        The trainer publishes from its sharded model (`trainer.publish.publish_version`); this is
        for a version whose weights already sit in an HF folder: seeding version 0 from the
        initial model, and tests and benchmarks. The folder's `*.safetensors` (and a sharded
        model's `model.safetensors.index.json`) are copied, never linked, so later edits of the
        folder cannot change a published version; its config, generation config and tokenizer
        files are copied as the trainer copies them. With `tensors`, those are written as
        `model.safetensors` instead of the folder's weights (only its metadata is used).
        Staged, described and published atomically like `publish`; a failure leaves no staging
        folder behind. Raises FileNotFoundError / ValueError naming `folder` when it is not a
        usable HF folder.
        """
        folder = os.fspath(folder)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{folder}: no such model folder")
        names = sorted(os.listdir(folder))
        if "config.json" not in names:
            raise ValueError(f"{folder}: not an HF model folder (no config.json)")
        weights = [n for n in names if n.endswith(".safetensors")
                   or n == "model.safetensors.index.json"]
        if tensors is None and not any(n.endswith(".safetensors") for n in weights):
            raise ValueError(f"{folder}: no *.safetensors weights to publish")
        staged, described = self.stage(version), None
        try:
            if tensors is None:
                for name in weights:
                    shutil.copyfile(os.path.join(folder, name), os.path.join(staged, name))
            else:
                entry, entries = self.write_file(staged, "model.safetensors", tensors)
                described = ([entry], entries)
            copy_model_metadata(folder, staged)
            return self.publish(staged, version, step, keep, described=described)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise

    def remove_debris(self) -> int:
        """Remove staging folders of publishes that were killed (`weights/.v*.tmp-*`); only the
        run's one trainer (trainer/run_lock.py) may call this. Returns how many."""
        names = os.listdir(self.layout.weights_dir) if os.path.isdir(self.layout.weights_dir) else []
        debris = [n for n in names if n.startswith(".v") and TMP_MARK in n]
        for name in debris:
            shutil.rmtree(os.path.join(self.layout.weights_dir, name), ignore_errors=True)
        return len(debris)

    def remove(self, version: int) -> None:
        """Remove a published version (trainer.sft: folders a killed run wrote after its last
        checkpoint)."""
        shutil.rmtree(self.layout.version_dir(version))

    def link_final(self, version: int) -> str:
        """An SFT folder's `hf` -> weights/v<version> (relative symlink), replaced atomically;
        returns the link."""
        link = self.layout.hf_model
        tmp = f"{link}{TMP_MARK}{os.getpid()}"
        os.symlink(os.path.relpath(self.layout.version_dir(version), self.layout.root), tmp)
        os.replace(tmp, link)
        return link

    def versions(self) -> list[int]:
        if not self.fs.exists(self.layout.weights_dir):
            return []
        found = (RunLayout.version_of(p) for p in self.fs.ls(self.layout.weights_dir, detail=False))
        return sorted(v for v in found if v is not None)

    def prune(self, keep: int) -> None:
        """Remove all but the newest `keep` versions, except the newest `keep` of the older
        ones that a validation request holds (a stalled validator cannot fill the disk: the
        ones beyond go, and the validator reports them as skipped)."""
        old = self.versions()[:-keep]
        held = [v for v in self.validation.held() if v in old][-keep:]
        for v in old:
            if v in held:
                continue
            if self.fs.exists(self.layout.validation_request(v)):
                log.warning("pruning weight version %d before its validation: more than "
                            "keep_versions=%d versions wait for rollout.validate", v, keep)
            shutil.rmtree(self.layout.version_dir(v), ignore_errors=True)
