"""Weight-version manifests: what a published actor version contains.

A version folder holds HF-named safetensors files, the HF config, and `manifest.json` with this
schema. A reader trusts a version only after its manifest parses and the checksums of the files it
reads match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

MANIFEST_FORMAT = 1
# weights/LATEST is {"version": N, "step": S} plus, in synchronous mode (trainer.max_staleness=0),
# this key: the prompt groups the trainer will train on with version N (buffer/control/sync.py).
SYNC_GROUPS = "sync_groups"


class ManifestError(ValueError):
    """A manifest is missing, malformed, or does not match the files beside it."""


@dataclasses.dataclass
class TensorEntry:
    file: str
    dtype: str  # safetensors dtype name, e.g. "F32", "BF16"
    shape: list[int]


@dataclasses.dataclass
class FileEntry:
    name: str
    bytes: int
    sha256: str


@dataclasses.dataclass
class WeightManifest:
    version: int
    step: int  # trainer optimizer steps taken when these weights were gathered
    created_at: float
    files: list[FileEntry]
    tensors: dict[str, TensorEntry]
    format: int = MANIFEST_FORMAT

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> WeightManifest:
        try:
            d = json.loads(text)
            if d.get("format") != MANIFEST_FORMAT:
                raise ManifestError(f"{where}: format {d.get('format')}, expected {MANIFEST_FORMAT}")
            return cls(
                version=int(d["version"]),
                step=int(d["step"]),
                created_at=float(d["created_at"]),
                files=[FileEntry(**f) for f in d["files"]],
                tensors={k: TensorEntry(**v) for k, v in d["tensors"].items()},
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(f"{where}: malformed manifest: {e!r}") from None


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_files(manifest: WeightManifest, folder: str | Path, threads: int = 4) -> None:
    """Raise ManifestError unless every listed file has the recorded size and checksum.

    Files are hashed by `threads` threads at once (hashlib releases the GIL), so a version
    published as several 256 MiB files verifies in about the time of its largest file.
    """
    from concurrent.futures import ThreadPoolExecutor

    def check(entry: FileEntry) -> None:
        path = Path(folder) / entry.name
        if not path.exists():
            raise ManifestError(f"{path}: listed in the manifest but missing")
        if path.stat().st_size != entry.bytes:
            raise ManifestError(f"{path}: {path.stat().st_size} bytes, manifest says {entry.bytes}")
        if sha256_file(path) != entry.sha256:
            raise ManifestError(f"{path}: checksum does not match the manifest")

    with ThreadPoolExecutor(max(1, min(threads, len(manifest.files)))) as pool:
        for done in [pool.submit(check, e) for e in manifest.files]:
            done.result()  # the first failure, in manifest order
