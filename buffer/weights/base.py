"""Weight versions, the trainer's producer side and the workers' consumer side.

The trainer publishes a version (`WeightPublisher`: staged, described in a manifest, renamed into
place, announced in LATEST, pruned); a worker or the validator reads it (`WeightSource`: the
pointer, then a LOCAL verified folder whose files an engine loads in place). Media: the run folder
(buffer/weights/fs.py: the trainer's publisher and the workers' source, read in place) and the
network (buffer/weights/net_server.py on the trainer, buffer/weights/net_client.py on a worker:
chunked, verified, resumable, from peers too). Tensors of a version are read by
buffer/weights/fs.py's read_tensors, whichever medium brought the files.
"""

from __future__ import annotations

import abc
import logging
import os
import time

from buffer.control.base import ShouldStop
from protocol.weights import FileEntry, TensorEntry, WeightManifest

log = logging.getLogger(__name__)


class WeightPublisher(abc.ABC):
    """The trainer's side: versions are staged in a fresh folder, then published whole."""

    @abc.abstractmethod
    def stage(self, version: int) -> str:
        """A fresh local staging folder for `version`; fill it, then call `publish`."""

    @abc.abstractmethod
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
        """Describe the files in `staged` in a manifest (those not `described` already), make
        the version visible whole, announce it (`announce`: extra fields of LATEST), prune to
        the newest `keep`. `adapter`: WeightManifest.adapter of an adapter-only (LoRA) version."""

    @abc.abstractmethod
    def versions(self) -> list[int]:
        """The published versions, ascending."""

    @abc.abstractmethod
    def prune(self, keep: int) -> None:
        """Remove all but the newest `keep` versions (and those validation still holds)."""


class WeightSource(abc.ABC):
    """The trainer's weight versions as a worker or the validator reads them."""

    @abc.abstractmethod
    def pointer(self) -> dict | None:
        """weights/LATEST: {"version": int, "step": int, plus what the trainer announced with it
        (protocol.weights.SYNC_GROUPS)}; None before the first version."""

    def latest(self) -> int | None:
        """The newest published version, None before the first."""
        pointer = self.pointer()
        return None if pointer is None else int(pointer["version"])

    @abc.abstractmethod
    def fetch(self, version: int) -> str:
        """A LOCAL HF model folder (config, tokenizer, safetensors, manifest.json) holding
        `version`, every file checked against the version's manifest. The filesystem source
        returns the run's own folder; the network one streams it into the worker's cache.
        Raises FileNotFoundError or protocol.weights.ManifestError when the version is gone
        (pruned) or does not match its manifest."""

    def ready(self, version: int) -> bool:
        """Whether `fetch(version)` would return without waiting for a transfer. The filesystem
        source always is; the network one starts fetching each new version it sees in
        `pointer()` in the background, so a worker keeps generating while the bytes arrive."""
        return True

    def newest_ready(self, above: int) -> int | None:
        """The newest version above `above` that `fetch` would return at once, or None. The
        network source names one it fetched in the background while the trainer published newer
        ones; the filesystem source never needs it (every version is ready)."""
        return None

    def version_bytes(self, version: int) -> int:
        """Bytes of the published folder of `version` (a delta's, or a snapshot's): what a
        reader moves to load it (the worker's heartbeat reports them per reload)."""
        return 0

    def request_snapshot(self, version: int) -> None:
        """Ask the trainer to publish its next version full (a snapshot): `version` is a delta
        whose base this reader cannot get any more (buffer/weights/delta.py, BaseMissing)."""
        return None

    def close(self) -> None:
        """A clean stop: ends background work (the network source cancels a fetch in flight).
        The filesystem source has none."""
        return None

    @abc.abstractmethod
    def exists(self, version: int) -> bool:
        """Whether `version` is still published (not pruned): tells a version pruned while it
        loaded (retry with a newer one) from a damaged newest version (an error)."""

    def files(self, version: int) -> list[str]:
        """Local paths of `version`'s safetensors files (sorted by name) after `fetch`: what an
        engine loads in place (vLLM's worker processes open them themselves)."""
        return tensor_files(*self.fetch_manifest(version))

    def fetch_manifest(self, version: int) -> tuple[str, WeightManifest]:
        """`fetch(version)` and the manifest of the folder it returns (a delta's rebuilt folder
        has its own): a reader tells an adapter-only version (`manifest.adapter`) from full
        weights by it before loading anything."""
        folder = self.fetch(version)
        where = os.path.join(folder, "manifest.json")
        with open(where) as f:
            return folder, WeightManifest.from_json(f.read(), where=where)

    def wait_latest(
        self, timeout_s: float, should_stop: ShouldStop = lambda: False, poll_s: float = 0.5, note_every_s: float = 30.0
    ) -> int | None:
        """The newest published version, waiting up to `timeout_s` for the first; None as soon
        as `should_stop()` says so. A log line when it starts waiting, then every
        `note_every_s`; TimeoutError after `timeout_s`."""
        start, last_note = time.monotonic(), None
        while (v := self.latest()) is None:
            if should_stop():
                return None
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise TimeoutError(
                    f"no weight version appeared in {self.where()} within {timeout_s:.0f} s: has the trainer started?"
                )
            if last_note is None or time.monotonic() - last_note >= note_every_s:
                log.info("waiting for the first weight version in %s (%.0f s of %.0f)", self.where(), waited, timeout_s)
                last_note = time.monotonic()
            time.sleep(poll_s)
        return v

    @abc.abstractmethod
    def where(self) -> str:
        """Where versions come from, for messages (a path or an address)."""


def tensor_files(folder: str, manifest: WeightManifest) -> list[str]:
    """The safetensors files of a fetched version's folder that hold its tensors, sorted by name."""
    return [os.path.join(folder, name) for name in sorted({t.file for t in manifest.tensors.values()})]
