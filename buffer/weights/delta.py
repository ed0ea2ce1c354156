"""Weight versions as exact deltas: the changed values of each tensor against an earlier version.

An RL step changes few of the published values (the trainer keeps fp32 masters; a bf16 value
changes only when its update crosses a rounding step), so with `trainer.publish_full_freq` K > 1
the trainer publishes a full version (a snapshot) every K versions and, in between, each version
as a delta against the one before: per tensor the flat positions that changed (uint16 gaps, or
int32/int64 positions where a gap is longer) and their new values (the tensor's own dtype), bit
for bit. A delta folder `weights/v<N>/` holds, per safetensors file of the version,
`delta.<file>` (the file's header bytes as `__header__`, then per changed tensor `<key>::gap`
or `<key>::idx` and `<key>::val`, or `<key>::full` for a tensor the base lacks) and the
version's small metadata files (config, tokenizer, index); its manifest lists those files
(what any medium moves) and, under `delta`, the base version and the name, size and sha256 of
every file of the rebuilt version. A reader rebuilds (`rebuild`) into `weights/.full/
v<N>/` next to it (staged, fsynced, renamed: a reader killed mid-apply leaves a temp folder and
nothing half-written) and proves by those checksums that it holds exactly the trainer's files.

The trainer keeps its own rebuilt folder of each delta version (its staged full version, moved to
`.full/`): the base of the next delta, and what a reader on the shared folder finds ready.
`resolve` walks a chain of deltas back to a folder it has (`full_dir`) or a snapshot; a base no
longer published raises `BaseMissing`: the reader asks the trainer for a snapshot
(`WeightSource.request_snapshot`) and loads the next version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buffer.config import usable_cpus
from buffer.layout import TMP_MARK
from buffer.storage import fsync_tree
from protocol.weights import FileEntry, ManifestError, TensorEntry, WeightManifest, sha256_file, verify_files

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
FULL_DIR = ".full"  # weights/.full/v<N>/: rebuilt delta versions (the trainer's own, readers')
PREFIX = "delta."  # delta.<file>: the delta of one safetensors file of the version
HEADER = "__header__"  # the rebuilt file's first bytes (length + JSON header), verbatim
SNAPSHOT_REQUEST = "SNAPSHOT_WANTED"  # weights/SNAPSHOT_WANTED: a reader lost its base
MAX_DENSITY = 0.5  # a delta larger than this share of the version is published full instead


class BaseMissing(FileNotFoundError):
    """A delta's base version is neither held nor published any more: ask for a snapshot."""

    def __init__(self, version: int, base: int, why: str):
        super().__init__(f"weight version {version} is a delta of version {base}, which is gone ({why})")
        self.version, self.base = version, base


class DeltaMismatch(ManifestError):
    """A rebuilt file does not match the sha256 the trainer recorded: the delta or the base is
    damaged (the reader drops both copies and fetches them again)."""


@dataclasses.dataclass
class DeltaStats:
    """What one delta holds, for the trainer's metrics and benchmarks/weights_delta.py."""

    values: int = 0  # elements of the version
    changed: int = 0  # elements stored in the delta
    full_bytes: int = 0  # bytes of the version's safetensors files
    delta_bytes: int = 0  # bytes of its delta files

    @property
    def density(self) -> float:
        return self.changed / self.values if self.values else 0.0


def full_dir(weights_dir: str, version: int) -> str:
    return os.path.join(weights_dir, FULL_DIR, f"v{version:06d}")


def read_manifest(folder: str) -> WeightManifest:
    path = os.path.join(folder, "manifest.json")
    try:
        with open(path) as f:
            return WeightManifest.from_json(f.read(), where=path)
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing") from None


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its element size: equal bits <=> equal integers (a float
    compare would call -0.0 == 0.0 and NaN != NaN)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.reshape(-1).view(ints[t.element_size()])


def _header(path: str) -> tuple[bytes, dict]:
    """A safetensors file's first bytes (8-byte length + JSON) and the parsed header."""
    with open(path, "rb") as f:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n)
    return head + raw, json.loads(raw)


def _data_order(header: dict, size: int, head_len: int, where: str) -> list[str] | None:
    """The tensor keys in file order, if their data fill the file exactly (then header bytes +
    each tensor's bytes in this order ARE the file); None otherwise (published full)."""
    keys = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    at = 0
    for k in keys:
        start, end = header[k]["data_offsets"]
        if start != at:
            log.info("%s: tensor %s does not follow the one before; no delta of this file", where, k)
            return None
        at = end
    return keys if head_len + at == size else None


def _positions(key: str, idx: torch.Tensor, numel: int) -> dict[str, torch.Tensor]:
    """The changed positions (ascending) of a tensor: as gaps from one to the next in uint16
    (`::gap`, 2 bytes a value; a few % of values change, so gaps are short), or, when a gap
    does not fit, as int32 (int64 past 2**31 elements) positions (`::idx`)."""
    import torch

    gaps = torch.diff(idx, prepend=idx.new_tensor([-1]))  # >= 1
    if int(gaps.max()) <= 1 << 16:
        return {f"{key}::gap": (gaps - 1).to(torch.uint16)}
    return {f"{key}::idx": idx.to(torch.int32 if numel < 2**31 else torch.int64)}


def _positions_of(d, key: str, names: set[str]) -> torch.Tensor | None:
    """The int64 positions `_positions` stored for `key` in the delta file `d`; None: none."""
    import torch

    if f"{key}::gap" in names:
        return (d.get_tensor(f"{key}::gap").to(torch.int64) + 1).cumsum(0) - 1
    if f"{key}::idx" in names:
        return d.get_tensor(f"{key}::idx").long()
    return None


MAKE_THREADS = 8  # files of one version compared at once (torch's compare and nonzero free the GIL)


def make_delta(
    staged: str,
    manifest: WeightManifest,
    base_folder: str,
    base: WeightManifest,
    out: str,
    threads: int | None = None,
) -> tuple[WeightManifest, DeltaStats] | None:
    """Write into `out` the delta of the full version in `staged` (its `manifest`) against the
    full folder `base_folder` (version `base`), and return the delta's manifest; None when a
    delta would not pay (or a file's layout cannot be rebuilt from tensors): publish full.
    The trainer calls it between two steps, so its files are compared on `threads` threads
    (default: MAKE_THREADS, at most the usable CPUs); each file's delta is independent."""
    names = sorted({t.file for t in manifest.tensors.values()})
    limit = MAX_DENSITY * sum(f.bytes for f in manifest.files)
    total = DeltaStats()
    lock, too_dense = threading.Lock(), threading.Event()

    def one(name: str) -> bool:
        if too_dense.is_set():  # another file already made the delta not worth it
            return False
        stats = _delta_file(staged, name, manifest, base_folder, base, out)
        if stats is None:
            return False
        with lock:
            for field in dataclasses.fields(DeltaStats):
                setattr(total, field.name, getattr(total, field.name) + getattr(stats, field.name))
            if total.delta_bytes > limit:
                too_dense.set()
        return not too_dense.is_set()

    workers = max(1, min(threads or MAKE_THREADS, len(names), usable_cpus()))
    with ThreadPoolExecutor(workers, thread_name_prefix="delta") as pool:
        if not all(list(pool.map(one, names))):
            return None
    small = [f.name for f in manifest.files if f.name not in set(names)]
    for name in small:
        shutil.copyfile(os.path.join(staged, name), os.path.join(out, name))
    paths = [os.path.join(out, n) for n in sorted(os.listdir(out))]
    files = [FileEntry(os.path.basename(p), os.path.getsize(p), sha256_file(p)) for p in paths]
    delta = {"base": base.version, "files": [dataclasses.asdict(f) for f in manifest.files]}
    return dataclasses.replace(manifest, files=files, delta=delta), total


def _delta_file(
    staged: str, name: str, manifest: WeightManifest, base_folder: str, base: WeightManifest, out: str
) -> DeltaStats | None:
    """`delta.<name>` in `out`: the changed values of the staged file `name` against the base
    version's tensors; its counts, or None when the file's layout cannot be rebuilt."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = os.path.join(staged, name)
    head, header = _header(path)
    order = _data_order(header, os.path.getsize(path), len(head), path)
    if order is None:
        return None
    stats = DeltaStats()
    pieces: dict[str, torch.Tensor] = {HEADER: torch.frombuffer(bytearray(head), dtype=torch.uint8)}
    with contextlib.ExitStack() as stack:
        opened: dict[str, Any] = {}

        def base_tensor(key: str, like: TensorEntry) -> torch.Tensor | None:
            entry = base.tensors.get(key)
            if entry is None or entry.dtype != like.dtype or entry.shape != like.shape:
                return None
            if entry.file not in opened:
                file = os.path.join(base_folder, entry.file)
                opened[entry.file] = stack.enter_context(safe_open(file, framework="pt"))
            return opened[entry.file].get_tensor(key)

        f = stack.enter_context(safe_open(path, framework="pt"))
        for key in order:
            new = f.get_tensor(key)
            old = base_tensor(key, manifest.tensors[key])
            stats.values += new.numel()
            stats.full_bytes += new.numel() * new.element_size()
            if old is None:
                pieces[f"{key}::full"] = new
                stats.changed += new.numel()
                continue
            idx = (_int_view(old) != _int_view(new)).nonzero().reshape(-1)
            if idx.numel():
                pieces.update(_positions(key, idx, new.numel()))
                pieces[f"{key}::val"] = new.reshape(-1)[idx]
                stats.changed += idx.numel()
    save_file(pieces, os.path.join(out, PREFIX + name))  # fsynced with the folder
    stats.delta_bytes = os.path.getsize(os.path.join(out, PREFIX + name))
    return stats


def _rebuilt_pieces(delta_file: str, base_tensor: Callable[[str], torch.Tensor]) -> Iterator[bytes | memoryview]:
    """The bytes of one rebuilt safetensors file, in order: its header, then each tensor (the
    base's, patched at the changed positions)."""
    import torch
    from safetensors import safe_open

    with safe_open(delta_file, framework="pt") as d:
        names = set(d.keys())
        head = d.get_tensor(HEADER).numpy().tobytes()
        yield head
        header = json.loads(head[8:])
        for key in sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]):
            t = d.get_tensor(f"{key}::full") if f"{key}::full" in names else _patched(d, names, key, base_tensor(key))
            yield memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _patched(d, names: set[str], key: str, before: torch.Tensor) -> torch.Tensor:
    """Tensor `key` of the delta file `d`'s version (`names`: its keys): its own copy if it
    holds one, else the version before's with the changed positions set (in place)."""
    if f"{key}::full" in names:
        return d.get_tensor(f"{key}::full")
    t = before.contiguous()
    at = _positions_of(d, key, names)
    if at is not None:
        _int_view(t)[at] = _int_view(d.get_tensor(f"{key}::val"))
    return t


Step = tuple[str, "WeightManifest"]  # a delta version between a rebuild's base and its target


def _rebuild_file(
    delta_folder: str, name: str, base_folder: str, base: WeightManifest, target: str, via: list[Step]
) -> str:
    """Write one file of the rebuilt version to `target`; its sha256. The hash of piece k runs
    in a thread while piece k+1 is patched and written (both release the GIL). `via`: the delta
    versions between the base and this one, oldest first, applied to each base tensor in memory
    (a lagging reader writes and hashes the newest version only, not every one on the way)."""
    from safetensors import safe_open

    if not os.path.exists(os.path.join(delta_folder, PREFIX + name)):  # a metadata file
        shutil.copyfile(os.path.join(delta_folder, name), target)
        return hashlib.sha256(Path(target).read_bytes()).hexdigest()
    with contextlib.ExitStack() as stack:
        opened: dict[str, tuple[Any, set[str]]] = {}  # path -> (the open file, its keys)

        def open_once(path: str) -> tuple[Any, set[str]]:
            if path not in opened:
                f = stack.enter_context(safe_open(path, framework="pt"))
                opened[path] = (f, set(f.keys()))
            return opened[path]

        def base_tensor(key: str):
            entry = base.tensors.get(key)
            if entry is None:
                raise DeltaMismatch(f"{delta_folder}: tensor {key} is in neither the delta nor the base")
            t = open_once(os.path.join(base_folder, entry.file))[0].get_tensor(key)
            for folder, manifest in via:
                step = manifest.tensors.get(key)
                if step is None:
                    raise DeltaMismatch(f"{folder}: version {manifest.version} has no tensor {key}")
                t = _patched(*open_once(os.path.join(folder, PREFIX + step.file)), key, t)
            return t

        sha, hashing = hashlib.sha256(), None
        with ThreadPoolExecutor(1, thread_name_prefix="rebuild-sha256") as pool, open(target, "wb") as f:
            for piece in _rebuilt_pieces(os.path.join(delta_folder, PREFIX + name), base_tensor):
                f.write(piece)
                if hashing is not None:
                    hashing.result()  # in order: the digest is of the file's bytes
                hashing = pool.submit(sha.update, piece)
            if hashing is not None:
                hashing.result()
        return sha.hexdigest()


def rebuild(
    delta_folder: str,
    manifest: WeightManifest,
    base_folder: str,
    out: str,
    threads: int = 4,
    via: list[Step] | None = None,
) -> str:
    """Rebuild the delta version in `delta_folder` (its `manifest`) on the full folder
    `base_folder` into `out`: staged in a temp folder (its files `threads` at a time), every
    file's sha256 checked against the manifest (DeltaMismatch), fsynced, renamed. Returns `out`.
    `via`: the deltas between the base and this version, oldest first (see `_rebuild_file`)."""
    tmp = f"{out}{TMP_MARK}{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    base = read_manifest(base_folder)
    entries = manifest.full_files()
    try:
        with ThreadPoolExecutor(max(1, min(threads, len(entries))), thread_name_prefix="rebuild") as pool:
            digests = list(
                pool.map(
                    lambda e: _rebuild_file(
                        delta_folder, e.name, base_folder, base, os.path.join(tmp, e.name), via or []
                    ),
                    entries,
                )
            )
        for entry, digest in zip(entries, digests):
            if digest != entry.sha256 or os.path.getsize(os.path.join(tmp, entry.name)) != entry.bytes:
                raise DeltaMismatch(
                    f"weight version {manifest.version}: {entry.name} rebuilt from the delta in "
                    f"{delta_folder} on {base_folder} does not match the trainer's sha256"
                )
        full = dataclasses.replace(manifest, files=entries, delta=None)
        Path(tmp, "manifest.json").write_text(full.to_json())
        fsync_tree(tmp)
        if os.path.isdir(out):  # another reader rebuilt it meanwhile (same bytes)
            shutil.rmtree(tmp, ignore_errors=True)
            return out
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dfd = os.open(os.path.dirname(out), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return out


def held_full(folder: str, version: int) -> bool:
    """Whether `folder` is a complete rebuilt version `version` (its manifest and checksums)."""
    if not os.path.isdir(folder):
        return False
    try:
        manifest = read_manifest(folder)
        if manifest.version != version or manifest.delta is not None:
            return False
        verify_files(manifest, folder)
    except (OSError, ManifestError):
        return False
    return True


def remove_debris(cache: str) -> None:
    """Temp folders of rebuilds that were killed (a reader killed mid-apply: another process;
    this one's own may be in progress in another thread)."""
    if os.path.isdir(cache):
        for name in os.listdir(cache):
            if TMP_MARK in name and not name.split(TMP_MARK, 1)[1].startswith(f"{os.getpid()}-"):
                shutil.rmtree(os.path.join(cache, name), ignore_errors=True)


def resolve(
    version: int,
    published: Callable[[int], str],
    weights_dir: str,
    drop: Callable[[int], None] = lambda v: None,
    verified: set[int] | None = None,
    depth: int = 0,
    in_memory: bool = True,
) -> str:
    """A full folder of `version`: the published folder (`published(v)`: verified, fetched if
    need be) when it is a snapshot, else the rebuilt one in weights_dir/.full/ (found and
    checked, or rebuilt on its base, itself resolved the same way). A rebuild that does not
    match is retried once after `drop`ping the delta's and the base's copies (a damaged copy is
    fetched again); a base gone raises BaseMissing. `verified`: versions whose rebuilt folder
    this process checked already (not hashed again while it is there). `in_memory`: a chain of
    several deltas is applied in one pass (`_rebuilt_along_chain`; False: version by version,
    for benchmarks/delta_chain.py's comparison)."""
    verified = set() if verified is None else verified
    out = full_dir(weights_dir, version)
    if version in verified and os.path.isdir(out):
        return out
    folder = published(version)
    manifest = read_manifest(folder)
    if manifest.base is None:
        return folder
    if held_full(out, version):
        verified.add(version)
        return out
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    remove_debris(os.path.dirname(out))
    if depth > 1000:
        raise ManifestError(f"weight version {version}: a chain of more than 1000 deltas")
    if in_memory and depth == 0 and _rebuilt_along_chain(version, folder, manifest, published, weights_dir, verified):
        return out
    for attempt in (0, 1):
        try:
            base = resolve(manifest.base, published, weights_dir, drop, verified, depth + 1)
        except (FileNotFoundError, ManifestError) as e:
            if isinstance(e, BaseMissing | DeltaMismatch):
                raise
            raise BaseMissing(version, manifest.base, str(e)) from None
        try:
            rebuild(folder, manifest, base, out)
            verified.add(version)
            return out
        except DeltaMismatch as e:
            if attempt:
                raise
            log.warning("%s; fetching the delta and its base again", e)
            for v in (version, manifest.base):
                drop(v)
                verified.discard(v)
                shutil.rmtree(full_dir(weights_dir, v), ignore_errors=True)
            folder = published(version)
            manifest = read_manifest(folder)
    raise AssertionError("unreachable")


def _rebuilt_along_chain(
    version: int, folder: str, manifest: WeightManifest, published, weights_dir: str, verified: set[int]
) -> bool:
    """A reader several deltas behind: rebuild `version` on the newest full folder it has (or a
    snapshot), the deltas between applied in memory, so one folder is written and hashed instead
    of one per version on the way. False when there is nothing to gain (the base is at hand) or
    when the result does not match its checksums (the version-by-version path below then finds
    the damaged copy and fetches it again); a base gone raises BaseMissing as there."""
    via: list[Step] = []
    base_version = manifest.base
    while base_version is not None:
        have = full_dir(weights_dir, base_version)
        if (base_version in verified and os.path.isdir(have)) or held_full(have, base_version):
            base_folder = have
            break
        try:
            base_folder = published(base_version)
            base_manifest = read_manifest(base_folder)
        except (FileNotFoundError, ManifestError) as e:
            if isinstance(e, BaseMissing):
                raise
            raise BaseMissing(version, base_version, str(e)) from None
        if base_manifest.base is None:
            break
        via.insert(0, (base_folder, base_manifest))
        base_version = base_manifest.base
        if len(via) > 1000:
            raise ManifestError(f"weight version {version}: a chain of more than 1000 deltas")
    if not via:
        return False
    try:
        rebuild(folder, manifest, base_folder, full_dir(weights_dir, version), via=via)
    except DeltaMismatch as e:
        log.warning("%s (along %d deltas in memory); rebuilding version by version", e, len(via))
        return False
    log.info("weight version %d rebuilt on %s through %d deltas in memory", version, base_folder, len(via))
    verified.add(version)
    return True
