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
    # An exact delta (buffer/weights/delta.py): `files` are the files in the folder (the delta
    # and the small metadata files), `tensors` those of the reconstructed version, and `delta`
    # {"base": B, "files": [FileEntry of every reconstructed file]}: a reader rebuilds the
    # version from version B and proves by these checksums that it holds what the trainer held.
    # None: a full version (a snapshot).
    delta: dict | None = None
    # An adapter-only version (LoRA): `files` hold the adapter in PEFT's layout (ADAPTER_CONFIG,
    # ADAPTER_WEIGHTS; tensor names as PEFT saves them, `base_model.model.<module>.lora_A.weight`),
    # `tensors` the adapter's tensors, and `adapter` {"base": base_checksum() of the frozen base
    # model folder it applies to, "rank": r, "alpha": a, "target_modules": [...]}. A reader applies
    # it only to a base whose base_checksum() is "base" and refuses it otherwise, naming both (a
    # worker that kept sampling from its own base would sample a stale policy silently).
    # None: full weights.
    adapter: dict | None = None

    @property
    def base(self) -> int | None:
        """The version a delta applies to; None for a full version."""
        return None if self.delta is None else int(self.delta["base"])

    def full_files(self) -> list[FileEntry]:
        """The files of the version as the trainer holds it (a delta's reconstructed files)."""
        return self.files if self.delta is None else [FileEntry(**f) for f in self.delta["files"]]

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        for optional in ("delta", "adapter"):  # a full version's manifest reads as it always did
            if d[optional] is None:
                del d[optional]
        return json.dumps(d, indent=1, sort_keys=True)

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
                delta=_delta_field(d.get("delta")),
                adapter=_adapter_field(d.get("adapter")),
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(f"{where}: malformed manifest: {e!r}") from None


def _delta_field(raw) -> dict | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("base"), int) or not isinstance(raw.get("files"), list):
        raise ValueError(f"delta: {raw!r}, expected {{'base': int, 'files': [...]}}")
    [FileEntry(**f) for f in raw["files"]]  # each must be a file entry
    return raw


ADAPTER_CONFIG = "adapter_config.json"  # PEFT's names: vLLM's LoRA loader and PeftModel read them
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _adapter_field(raw) -> dict | None:
    if raw is None:
        return None
    ok = (
        isinstance(raw, dict)
        and isinstance(raw.get("base"), str)
        and isinstance(raw.get("rank"), int)
        and raw["rank"] > 0
        and isinstance(raw.get("alpha"), (int, float))
        and isinstance(raw.get("target_modules"), list)
    )
    if not ok:
        expected = "{'base': str, 'rank': int > 0, 'alpha': number, 'target_modules': [...]}"
        raise ValueError(f"adapter: {raw!r}, expected {expected}")
    return raw


def base_checksum(folder: str | Path, threads: int = 8) -> str:
    """The identity of a base model folder that adapter-only versions name: sha256 over the sorted
    `name sha256` lines of its *.safetensors files and config.json. Files are hashed in parallel
    (hashlib releases the GIL): a 15 GB base takes seconds, once per process."""
    from concurrent.futures import ThreadPoolExecutor

    root = Path(folder)
    names = sorted(p.name for p in root.iterdir() if p.suffix == ".safetensors" or p.name == "config.json")
    if not any(n.endswith(".safetensors") for n in names):
        raise ManifestError(f"{root}: no *.safetensors files: not a model folder")
    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        sums = list(pool.map(lambda n: sha256_file(root / n), names))
    lines = "".join(f"{n} {h}\n" for n, h in zip(names, sums))
    return hashlib.sha256(lines.encode()).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_files(
    manifest: WeightManifest, folder: str | Path, threads: int = 4, entries: list[FileEntry] | None = None
) -> None:
    """Raise ManifestError unless every listed file (`entries`, default the manifest's files)
    has the recorded size and checksum.

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

    listed = manifest.files if entries is None else entries
    with ThreadPoolExecutor(max(1, min(threads, len(listed)))) as pool:
        for done in [pool.submit(check, e) for e in listed]:
            done.result()  # the first failure, in manifest order
