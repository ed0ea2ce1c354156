"""Weight versions on the run folder: the trainer publishes (`WeightStore`), workers read in
place (`FsWeightSource`).

A version is staged in a hidden temporary folder, fsynced, renamed to `weights/v<N>/`, and only
then announced by atomically replacing `weights/LATEST`. A reader that follows LATEST therefore
never sees a partial version; it still verifies checksums against the manifest before loading.
Only the newest `keep` versions are kept on disk, plus up to `keep` older ones that wait for
validation (FsValidation, buffer/control/fs.py). The tensors of a version are written
(`write_file`, hashing while it writes), described for its manifest (`describe_files`) and read by
the engines that load a version in place (`read_tensors`) at the end of this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import struct
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buffer.control.fs import FsStore, FsValidation
from buffer.layout import TMP_MARK, RunLayout
from buffer.storage import atomic_write_json, filesystem, fsync_tree, read_json, when_space
from buffer.weights import delta
from buffer.weights.base import WeightPublisher, WeightSource
from protocol.weights import FileEntry, ManifestError, TensorEntry, WeightManifest, sha256_file, verify_files

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


@dataclasses.dataclass
class FsWeightSource(FsStore, WeightSource):
    """weights/LATEST and weights/v<N>/ of the run folder, read in place; a delta version
    (buffer/weights/delta.py) is read from its rebuilt folder weights/.full/v<N>/ (the
    trainer's, or rebuilt here from its base)."""

    rebuilt: set[int] = dataclasses.field(default_factory=set, repr=False)  # checked by this process

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

    def _published(self, version: int) -> str:
        folder = self.layout.version_dir(version)
        verify_files(self.manifest(version), folder)
        return folder

    def fetch(self, version: int) -> str:
        # Engines read the files themselves (vLLM's worker processes open them directly), so
        # the bytes are checked once here and never shipped between processes.
        return delta.resolve(version, self._published, self.layout.weights_dir, verified=self.rebuilt)

    def files(self, version: int) -> list[str]:
        folder = self.fetch(version)
        manifest = delta.read_manifest(folder)
        return [os.path.join(folder, f) for f in sorted({t.file for t in manifest.tensors.values()})]

    def version_bytes(self, version: int) -> int:
        try:
            return sum(f.bytes for f in self.manifest(version).files)
        except ManifestError:  # pruned meanwhile: not counted
            return 0

    def request_snapshot(self, version: int) -> None:
        atomic_write_json(
            self.fs, os.path.join(self.layout.weights_dir, delta.SNAPSHOT_REQUEST), {"lost": version, "at": time.time()}
        )

    def exists(self, version: int) -> bool:
        return self.fs.isdir(self.layout.version_dir(version))

    def where(self) -> str:
        return self.layout.latest_pointer

    def tensors(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Verify the version's checksums, then yield its tensors one at a time (bounded memory)."""
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


# --- tensors of a version (safetensors files). torch and safetensors are imported where tensors
# are read or written: the tools on the run folder (launch.status, ...) never need them.


@functools.cache
def _safetensors_dtypes() -> dict:
    import torch

    return {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
        torch.float8_e4m3fn: "F8_E4M3",
        torch.float8_e5m2: "F8_E5M2",
    }


def describe_files(folder: str, names: list[str]) -> tuple[list[FileEntry], dict[str, TensorEntry]]:
    """Manifest entries (size, sha256, tensor dtypes and shapes) of some files in `folder`;
    trainer ranks describe the files they wrote in parallel."""
    from safetensors import safe_open

    files, tensors = [], {}
    for name in names:
        path = os.path.join(folder, name)
        files.append(FileEntry(name, os.path.getsize(path), sha256_file(path)))
        if name.endswith(".safetensors"):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    tensors[key] = TensorEntry(name, sl.get_dtype(), list(sl.get_shape()))
    return files, tensors


def write_file(folder: str, name: str, tensors: Mapping[str, torch.Tensor]) -> tuple[FileEntry, dict[str, TensorEntry]]:
    """Write `tensors` as the safetensors file `folder/name` (fsynced) and return its
    manifest entries without reading the file back: each tensor's bytes go straight from
    its memory to the file, and the sha256 of piece k runs in a thread while piece k+1 is
    written (both release the GIL). What `save_file` + `describe` give, for about the cost
    of the write alone."""
    import torch

    dtypes = _safetensors_dtypes()
    header: dict[str, Any] = {}
    pieces, offset = [], 0
    for key, t in sorted(tensors.items()):
        if t.dtype not in dtypes:
            raise ValueError(f"{key}: dtype {t.dtype} has no safetensors name")
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        header[key] = {"dtype": dtypes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + raw.nbytes]}
        pieces.append(raw)
        offset += raw.nbytes
    header["__metadata__"] = {"format": "pt"}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data to 8 bytes
    pieces.insert(0, struct.pack("<Q", len(head)) + head)
    path = os.path.join(folder, name)

    def write() -> str:
        sha, hashing = hashlib.sha256(), None
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="sha256") as pool:
                with open(path, "wb") as f:
                    for piece in pieces:
                        f.write(piece)
                        if hashing is not None:
                            hashing.result()  # in order: the digest is of the file's bytes
                        hashing = pool.submit(sha.update, piece)
                    hashing.result()
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(path)  # a partial file would hold the space a retry needs
            raise
        return sha.hexdigest()

    digest = when_space(write, path)
    entries = {k: TensorEntry(name, v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
    return FileEntry(name, len(pieces[0]) + offset, digest), entries


def read_tensors(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of safetensors files, one at a time (memory-mapped, bounded memory)."""
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


class WeightStore(FsWeightSource, WeightPublisher):
    """The trainer's weights on its run folder: it publishes and prunes versions, and reads
    them as any FsWeightSource does (a trainer resuming, tests, launch tools)."""

    def __init__(self, root: str):
        fs, root_path = filesystem(root)
        super().__init__(fs, RunLayout(root_path))
        self.announced_at: float | None = None  # unix time of the last publish()'s announcement
        self.validation = FsValidation(fs, self.layout)
        # trainer.publish_full_freq: a full version every this many, deltas between (1: all full)
        self.publish_full_freq = 1
        self.last_delta: delta.DeltaStats | None = None  # of the last publish (None: it was full)
        self.last_bytes = 0  # bytes of the last published folder's files (what a reader moves)
        self.last_delta_s = 0.0  # seconds the last publish spent comparing with its base

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

    describe = staticmethod(describe_files)
    write_file = staticmethod(write_file)

    def publish(
        self,
        staged: str,
        version: int,
        step: int,
        keep: int,
        described: tuple[list[FileEntry], dict[str, TensorEntry]] | None = None,
        announce: dict | None = None,
        adapter: dict | None = None,
    ) -> WeightManifest:
        """Write the manifest for the files in `staged` (those not `described` already are
        described here), rename into place, announce (`announce`: extra fields of LATEST, e.g.
        protocol.weights.SYNC_GROUPS), prune. `adapter`: the manifest's adapter field (an
        adapter-only LoRA version, protocol/weights.py); such a version is always published as
        it is, never as a delta: it is megabytes, and a delta's base would be another adapter."""
        files, tensors = described or ([], {})
        known = {f.name for f in files}
        more_files, more_tensors = self.describe(staged, [n for n in sorted(os.listdir(staged)) if n not in known])
        files = sorted([*files, *more_files], key=lambda f: f.name)
        tensors = {**tensors, **more_tensors}
        manifest = WeightManifest(
            version=version, step=step, created_at=time.time(), files=files, tensors=tensors, adapter=adapter
        )
        when_space(lambda: Path(staged, "manifest.json").write_text(manifest.to_json()), staged)
        fsync_tree(staged)
        final = self.layout.version_dir(version)
        if os.path.exists(final):
            raise FileExistsError(f"{final} already exists: weight versions are never rewritten")
        t0 = time.monotonic()
        made = None if adapter is not None else self._delta_of(staged, manifest)
        self.last_delta_s = time.monotonic() - t0
        self.last_delta = None
        if made is None:
            os.rename(staged, final)
            self.last_bytes = sum(f.bytes for f in manifest.files)
        else:  # the full files become the rebuilt folder: the next delta's base, readers' copy
            folder, manifest, self.last_delta = made
            full = delta.full_dir(self.layout.weights_dir, version)
            shutil.rmtree(full, ignore_errors=True)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            os.rename(staged, full)
            os.rename(folder, final)
            self.last_bytes = sum(f.bytes for f in manifest.files)
        # Taken before LATEST names the version: no worker can have loaded it earlier (the
        # weight-sync latency in launch.report is never negative on one clock).
        self.announced_at = time.time()
        when_space(
            lambda: atomic_write_json(
                self.fs, self.layout.latest_pointer, {**(announce or {}), "version": version, "step": step}
            ),
            self.layout.latest_pointer,
        )
        self.prune(keep)
        return manifest

    def _delta_of(self, staged: str, manifest: WeightManifest) -> tuple[str, WeightManifest, delta.DeltaStats] | None:
        """The staged version as a delta against the newest published one (a folder, fsynced,
        its manifest written), or None: publish it full (deltas off, a snapshot due or asked
        for, no full base at hand, or a delta that would not pay)."""
        if self.publish_full_freq <= 1:
            return None
        wanted = os.path.join(self.layout.weights_dir, delta.SNAPSHOT_REQUEST)
        if os.path.exists(wanted):
            log.info("weight version %d published full: a reader asked for a snapshot (%s)", manifest.version, wanted)
            os.remove(wanted)
            return None
        versions = self.versions()
        if not versions or self.chain_length(versions[-1]) + 1 >= self.publish_full_freq:
            return None
        base_v = versions[-1]
        base_folder = self.full_folder(base_v)
        if base_folder is None:
            log.info("weight version %d published full: no full folder of version %d here", manifest.version, base_v)
            return None
        folder = f"{staged}.delta"
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        try:
            made = delta.make_delta(staged, manifest, base_folder, delta.read_manifest(base_folder), folder)
            if made is None:
                shutil.rmtree(folder)
                return None
            out, stats = made
            Path(folder, "manifest.json").write_text(out.to_json())
            fsync_tree(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder, out, stats

    def chain_length(self, version: int) -> int:
        """Deltas from `version` back to its snapshot (0: it is one), counted as far as the
        chain is still published: the trainer needs only its full copy of `version` to build
        the next delta, and a reader that cannot walk a broken chain asks for a snapshot."""
        n, v = 0, self.manifest(version).base
        while v is not None:
            n += 1
            try:
                v = self.manifest(v).base
            except ManifestError:
                break
        return n

    def full_folder(self, version: int) -> str | None:
        """The trainer's full folder of a published version: the folder itself (a snapshot) or
        its rebuilt copy in weights/.full/ (a delta); None when neither is there."""
        if self.manifest(version).base is None:
            return self.layout.version_dir(version)
        full = delta.full_dir(self.layout.weights_dir, version)
        return full if os.path.isfile(os.path.join(full, "manifest.json")) else None

    def publish_hf_folder(
        self,
        folder: str | os.PathLike,
        version: int,
        step: int,
        keep: int,
        *,
        tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> WeightManifest:
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
        weights = [n for n in names if n.endswith(".safetensors") or n == "model.safetensors.index.json"]
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
        shutil.rmtree(delta.full_dir(self.layout.weights_dir, version), ignore_errors=True)

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
        ones beyond go, and the validator reports them as skipped), and every version a kept
        delta is rebuilt from (its chain back to a snapshot). Rebuilt copies (.full/) are kept
        for the newest `keep` and the held ones only (a reader rebuilds an older one from the
        chain); the newest's is the base of the trainer's next delta."""
        versions = self.versions()
        old = versions[:-keep]
        held = [v for v in self.validation.held() if v in old][-keep:]
        needed = self._chains([*versions[-keep:], *held])
        for v in old:
            if v in held or v in needed:
                continue
            if self.fs.exists(self.layout.validation_request(v)):
                log.warning(
                    "pruning weight version %d before its validation: more than "
                    "keep_versions=%d versions wait for rollout.validate",
                    v,
                    keep,
                )
            shutil.rmtree(self.layout.version_dir(v), ignore_errors=True)
        cache = os.path.join(self.layout.weights_dir, delta.FULL_DIR)
        if os.path.isdir(cache):
            for name in os.listdir(cache):
                v = RunLayout.version_of(name)
                if v is not None and v not in {*versions[-keep:], *held}:
                    shutil.rmtree(os.path.join(cache, name), ignore_errors=True)

    def _chains(self, versions: list[int]) -> set[int]:
        """`versions` and every version their deltas are built on."""
        out: set[int] = set()
        for v in versions:
            while v is not None and v not in out:
                out.add(v)
                try:
                    v = self.manifest(v).base
                except ManifestError:
                    break
        return out
