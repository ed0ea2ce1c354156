"""LoRA on the trainer's models (issue 27): PEFT adapters on a frozen base, sharded with FSDP2.

`apply` wraps the HF model with PEFT before any sharding (trainer/model.py), so the adapters are
ordinary parameters of the decoder layers' FSDP units: every rank holds a shard of the frozen base
and of the adapters, and only the adapters (plus a critic's value head) require gradients, so
the optimizer holds only them. The reference policy of the KL terms is the same model with the
adapter disabled (`reference`), never a second copy of the base.

What leaves the trainer (all collectives, every rank in the same order):
- `adapter_tensors`: the adapter's full tensors on rank 0, PEFT's names
  (`base_model.model.<module>.lora_A.weight`): an adapter-only weight version
  (trainer/publish.py, protocol/weights.py's `adapter` field);
- `merged_items`: the base with the adapter folded in, HF names (W + alpha/r * B @ A, PEFT's
  merge_and_unload): SFT's HF folders, which RL then loads as its base.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import torch

from protocol.sections import ALL_LINEAR

ADAPTER = "default"  # PEFT's name of the one adapter


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]  # ALL_LINEAR or module names
    exclude_modules: tuple[str, ...] = ()
    dropout: float = 0.0

    @classmethod
    def of(cls, section) -> LoraSpec | None:
        """From a model section with protocol.sections.LoraFields; None when lora_rank is 0."""
        if not section.lora_rank:
            return None
        targets = section.target_modules
        return cls(
            rank=int(section.lora_rank),
            alpha=float(section.lora_alpha),
            target_modules=targets if targets == ALL_LINEAR else tuple(targets),
            exclude_modules=tuple(section.exclude_modules or ()),
            dropout=float(section.lora_dropout),
        )

    def describe(self) -> dict:
        """What a checkpoint records and a resume must match."""
        return dataclasses.asdict(self) | {
            "target_modules": self.targets(),
            "exclude_modules": list(self.exclude_modules),
        }

    def targets(self) -> str | list[str]:
        return self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def hf_model(model):
    """The HF model inside a PeftModel (the model itself otherwise): what has model.layers."""
    return model.get_base_model() if is_peft(model) else model


def apply(model, spec: LoraSpec, value_head: bool = False):
    """The PeftModel of `model` with fresh adapters (B = 0: it starts as the base). A value head
    (`score`, the critic's) gets no adapter and trains in full: it is new and random, there is
    no pretrained weight to keep."""
    from peft import LoraConfig, get_peft_model

    exclude = [*spec.exclude_modules, *(["score"] if value_head else [])]
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=spec.targets(),
        exclude_modules=exclude or None,
        lora_dropout=spec.dropout,
        bias="none",
    )
    peft_model = get_peft_model(model, config)
    if value_head:
        hf_model(peft_model).score.requires_grad_(True)
    return peft_model


def adapted_modules(model) -> list[str]:
    """Names (HF, no PEFT prefix) of the modules that carry an adapter."""
    from peft.tuners.lora import LoraLayer

    return sorted(n for n, m in hf_model(model).named_modules() if isinstance(m, LoraLayer))


def manifest_field(model, base: str) -> dict:
    """protocol/weights.py's WeightManifest.adapter of this model's adapter over base `base`."""
    config = model.peft_config[ADAPTER]
    return {
        "base": base,
        "rank": int(config.r),
        "alpha": config.lora_alpha,
        # the kinds of module adapted (PEFT resolves 'all-linear' into every full name)
        "target_modules": sorted({name.rpartition(".")[2] for name in adapted_modules(model)}),
    }


@contextlib.contextmanager
def reference(model):
    """The base policy: `model` with its adapter disabled (PEFT's disable_adapter), or nothing
    to do for a model without one. Used under no_grad only (pi_ref)."""
    if not is_peft(model):
        yield model
        return
    with model.disable_adapter():
        yield model


@contextlib.contextmanager
def dropout(model, on: bool):
    """The adapters' dropout on or off (only their `lora_dropout` modules, whatever the model's
    own train/eval mode), restored after: on for updates, off for pi_old, the reference, values
    and validation, which the workers' sampling (no dropout) must match."""
    mods = [m for n, m in model.named_modules() if n.endswith(f"lora_dropout.{ADAPTER}")] if is_peft(model) else []
    before = [m.training for m in mods]
    for m in mods:
        m.train(on)
    try:
        yield
    finally:
        for m, was in zip(mods, before):
            m.train(was)


def dropout_active(model, spec: LoraSpec | None):
    """The adapters' dropout for an update (a no-op without LoRA or with lora_dropout=0)."""
    return dropout(model, spec is not None and spec.dropout > 0)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # collective for a DTensor


def _merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A (PEFT's get_delta_weight for a plain linear layer), gathered."""
    return full_tensor(w) + scale * (full_tensor(b) @ full_tensor(a))


def adapter_tensors(model, dtype: torch.dtype, keep: bool) -> dict[str, torch.Tensor]:
    """The adapter's full tensors in PEFT's names and layout (get_peft_model_state_dict: the
    adapter name dropped). Collective: every rank gathers each one; `keep` says which rank
    holds them (the others get {})."""
    from peft import get_peft_model_state_dict

    out = {}
    for name, t in sorted(get_peft_model_state_dict(model).items()):
        full = full_tensor(t).detach()
        if keep:
            out[name] = full.to(dtype).cpu()
        del full
    return out


def merged_items(model) -> list[tuple[str, Callable[[], torch.Tensor], int]]:
    """(HF name, gather, numel) for every tensor of the base with the adapter merged in: the
    name merge_and_unload would give it, a collective that returns its full merged value, and
    its size (to balance writers). Call the gathers in this order on every rank."""
    from peft.tuners.lora import LoraLayer

    sd = model.state_dict()
    prefix = "base_model.model."
    layers = {n: m for n, m in hf_model(model).named_modules() if isinstance(m, LoraLayer)}
    items: list[tuple[str, Callable[[], torch.Tensor], int]] = []
    for key, value in sd.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix(prefix)
        module, _, leaf = name.rpartition(".")
        owner = module.removesuffix(".base_layer")
        if module.endswith(".base_layer") and owner in layers and leaf == "weight":
            a, b = sd[f"{prefix}{owner}.lora_A.{ADAPTER}.weight"], sd[f"{prefix}{owner}.lora_B.{ADAPTER}.weight"]
            merge = functools.partial(_merged, value, a, b, layers[owner].scaling[ADAPTER])
            items.append((f"{owner}.weight", merge, value.numel()))
        else:
            hf_name = f"{owner}.{leaf}" if module.endswith(".base_layer") else name
            items.append((hf_name, functools.partial(full_tensor, value), value.numel()))
    return items


def trainable(model) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: all of a full model, the adapters (and a value
    head) of a PeftModel."""
    return [p for p in model.parameters() if p.requires_grad]
