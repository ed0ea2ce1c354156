"""Which weight versions a worker or the validator may load: full weights, or an adapter-only
(LoRA) version on the base it names (issue 27).

An adapter-only version (protocol/weights.py, `WeightManifest.adapter`) holds the adapter alone
and names its base by `base_checksum()` of the frozen base folder the trainer trains on. This
process's base is `actor_rollout_ref.model.path`; its checksum is computed once, at the first
adapter version (seconds for a 15 GB base), and compared BEFORE anything is loaded. A mismatch
is a refusal (`Refused`): the process names both checksums in its log and heartbeat
(`refused`), and exits 2, which launch.local never restarts. A worker that kept sampling on its
own base would sample a stale policy silently (verl #7495: the rollout engines sampled the
initial policy for two months).

A run's versions are all of one kind: full weights overwrite the engine's parameters, while an
adapter applies to the untouched base of model.path. A mix is refused: after full weights the
engine's base is no longer the folder whose checksum adapters name, and full weights after
adapters would be loaded under a live adapter. A trainer publishes one kind for a whole run
(LoRA is fixed at its start; a resume refuses other LoRA settings), so a mix means another
trainer or config on the run folder: loud, not handled.
"""

from __future__ import annotations

import os

from buffer.weights.base import WeightSource, tensor_files
from buffer.weights.fs import hf_folder_problem
from protocol.weights import WeightManifest, base_checksum

FULL, ADAPTER = "full", "adapter"
MODEL_PATH = "actor_rollout_ref.model.path"


class Refused(Exception):
    """A version this process must not sample from; `details` go into its heartbeat."""

    def __init__(self, reason: str, **details):
        super().__init__(reason)
        self.details = {"reason": reason, **details}


def kind(manifest: WeightManifest) -> str:
    return ADAPTER if manifest.adapter is not None else FULL


class VersionGate:
    """This process's base and the kind of version it holds; `check` refuses what it must not load."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.kind: str | None = None  # fixed by the first version loaded
        self._base: str | None = None

    def base(self) -> str:
        """base_checksum of model.path, computed once."""
        if self._base is None:
            self._base = base_checksum(self.model_path)
        return self._base

    def check(self, version: int, manifest: WeightManifest) -> None:
        """Raise Refused unless `version` may be loaded here (nothing is loaded yet)."""
        got = kind(manifest)
        if self.kind is not None and got != self.kind:
            raise Refused(
                f"weight version {version} is {got} weights but this run's earlier versions were "
                f"{self.kind}: a run publishes one kind (another trainer or config on this run folder?)",
                version=version,
                kind=got,
                loaded_kind=self.kind,
            )
        if manifest.adapter is not None:
            self._check_base(version, manifest.adapter)
        self.kind = got

    def _check_base(self, version: int, adapter: dict) -> None:
        wanted = adapter["base"]
        problem = f"{MODEL_PATH} is not set" if not self.model_path else hf_folder_problem(self.model_path)
        if problem is None and not any(n.endswith(".safetensors") for n in os.listdir(self.model_path)):
            problem = f"{self.model_path} holds no *.safetensors weights"
        if problem is not None:
            raise Refused(
                f"weight version {version} is an adapter for the base with checksum {wanted}, and this "
                f"process has no base to apply it to: {problem} (the base model folder the trainer trains on)",
                version=version,
                version_base=wanted,
                worker_base=None,
                model_path=self.model_path,
            )
        have = self.base()
        if have != wanted:
            raise Refused(
                f"weight version {version} is an adapter for the base with checksum {wanted}, but this "
                f"process's base {self.model_path} ({MODEL_PATH}) has checksum {have}: refusing it rather "
                "than sampling from a policy the trainer is not training",
                version=version,
                version_base=wanted,
                worker_base=have,
                model_path=self.model_path,
            )


def load_version(engine, store: WeightSource, gate: VersionGate, version: int) -> int:
    """Fetch `version` (verified), check it with `gate` (Refused), load it into `engine` in
    place: an adapter by its folder, full weights by their files. Returns the tensors loaded."""
    folder, manifest = store.fetch_manifest(version)
    gate.check(version, manifest)
    if manifest.adapter is not None:
        return engine.load_adapter(folder, version)
    return engine.load_files(tensor_files(folder, manifest))
