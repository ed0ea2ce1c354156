"""Publish the sharded actor as full HF-named tensors: every rank writes a disjoint share.

Tensors are gathered one at a time (every rank joins each all-gather). Tensor ownership is
balanced by bytes; each rank cuts its share into `model-r<rank>-<k>.safetensors` buckets of
BUCKET_BYTES and hands each to one of WRITERS threads, which writes, fsyncs and checksums it
(`WeightStore.write_file`) while the gathers go on: sha256 runs on one core per file, so several
files hash at once, and the writes overlap the collectives. Host memory stays under
(WRITERS + 1) buckets. Rank 0 writes the index and the manifest and publishes atomically.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch
import torch.distributed as dist

from buffer.storage import when_space
from buffer.weights.fs import WeightStore, copy_model_metadata
from protocol.weights import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from trainer import lora

BUCKET_BYTES = 256 << 20
WRITERS = 4  # bucket files of one rank written and hashed at once


def _owners(sizes: list[int], world: int) -> list[int]:
    """Greedy balance: largest tensors first, each to the rank with the fewest bytes so far."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = load.index(min(load))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bucket on the host with one device-to-host copy, instead of one synchronizing copy
    (and one host allocation) per tensor."""
    if all(t.device.type == "cpu" for t in tensors.values()):
        return {k: t.contiguous() for k, t in tensors.items()}
    return _unflatten(_flat_bytes(tensors).cpu(), tensors)


def _flat_bytes(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()])


def _unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views into `flat` shaped as `like`. A bucket holds one dtype, so every offset is
    aligned for it."""
    out, offset = {}, 0
    for key, t in like.items():
        n = t.numel() * t.element_size()
        out[key] = flat[offset : offset + n].view(t.dtype).view(t.shape)
        offset += n
    return out


def _gathers(model) -> list[tuple[str, Callable[[], torch.Tensor], int]]:
    """(HF name, collective returning the full tensor, numel) of every tensor to publish: the
    model's own, or for a PeftModel the base with the adapter merged in (trainer/lora.py)."""
    if lora.is_peft(model):
        return lora.merged_items(model)
    return [(k, functools.partial(lora.full_tensor, v), v.numel()) for k, v in model.state_dict().items()]


def publish_version(
    model,
    store: WeightStore,
    model_path: str,
    version: int,
    step: int,
    keep: int,
    dtype: torch.dtype = torch.float32,
    announce: dict | None = None,
) -> dict:
    """Collective: every rank calls it. Returns timing and size metrics. `announce`: extra
    fields of weights/LATEST (`WeightStore.publish`). A PeftModel is published merged (full
    weights); `publish_adapter` publishes its adapter alone."""
    t0 = time.monotonic()
    rank, world = dist.get_rank(), dist.get_world_size()
    items = [
        (k, gather, n)
        for k, gather, n in _gathers(model)
        if not (k == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False))
    ]
    owner = _owners([n * dtype.itemsize for _, _, n in items], world)
    box = [store.stage(version) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    staged: str = box[0]
    mine: dict[str, torch.Tensor] = {}
    pending: list[Future] = []
    size, nbytes = 0, 0
    with ThreadPoolExecutor(WRITERS, thread_name_prefix="publish") as pool:

        def flush():
            busy = [f for f in pending if not f.done()]
            if len(busy) >= WRITERS:  # bound host memory
                wait(busy, return_when=FIRST_COMPLETED)
            name = f"model-r{rank:04d}-{len(pending):04d}.safetensors"
            pending.append(pool.submit(store.write_file, staged, name, _to_host(mine)))

        for (name, gather, _), who in zip(items, owner):
            full = gather()  # collective
            if who == rank:
                mine[name] = full.detach().to(dtype)  # on the device until its bucket is full
                size += mine[name].numel() * dtype.itemsize
                if size >= BUCKET_BYTES:
                    flush()
                    nbytes, mine, size = nbytes + size, {}, 0
            del full
        if mine:
            flush()
            nbytes += size
        gathered_at = time.monotonic()
        written = [f.result() for f in pending]
    files = [entry for entry, _ in written]
    tensors = {k: v for _, entries in written for k, v in entries.items()}
    written_at = time.monotonic()
    gathered: list = [None] * world if rank == 0 else None
    dist.gather_object((files, tensors), gathered, dst=0)
    totals = torch.tensor([nbytes], dtype=torch.float64, device=next(model.parameters()).device)
    dist.all_reduce(totals)
    if rank == 0:
        all_files = [f for fs, _ in gathered for f in fs]
        all_tensors = {k: v for _, ts in gathered for k, v in ts.items()}
        index = {
            "metadata": {"total_size": int(totals.item())},
            "weight_map": {k: v.file for k, v in sorted(all_tensors.items())},
        }

        def metadata():
            with open(os.path.join(staged, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=1)
            copy_model_metadata(model_path, staged)

        when_space(metadata, staged)
        store.publish(staged, version, step, keep, described=(all_files, all_tensors), announce=announce)
    dist.barrier()
    made = store.last_delta if rank == 0 else None
    return {
        "weights/delta": float(made is not None),
        **({"weights/delta_density": made.density} if made is not None else {}),
        # rank 0's comparison with the base (delta.make_delta), inside publish_s
        "weights/delta_s": store.last_delta_s if rank == 0 else 0.0,
        "weights/published_bytes": store.last_bytes if rank == 0 else 0,
        "weights/published": version,
        "weights/published_at": store.announced_at,
        "weights/publish_s": time.monotonic() - t0,
        "weights/gather_s": gathered_at - t0,
        "weights/write_wait_s": written_at - gathered_at,
        "weights/bytes": int(totals.item()),
    }


def publish_adapter(
    model,
    store: WeightStore,
    model_path: str,
    version: int,
    step: int,
    keep: int,
    base: str | None,
    dtype: torch.dtype = torch.float32,
    announce: dict | None = None,
) -> dict:
    """Collective: an adapter-only version of a PeftModel (LoRA). Every rank joins the gathers
    of the adapter's tensors; rank 0 writes them in PEFT's layout (ADAPTER_WEIGHTS, PEFT's key
    names, and ADAPTER_CONFIG, PEFT's LoraConfig), the base's config and tokenizer files, and
    publishes with the manifest's `adapter` field naming the base by `base`
    (protocol.weights.base_checksum of model_path, rank 0's; None on the other ranks). Never a
    delta (WeightStore.publish): the files are megabytes."""
    t0 = time.monotonic()
    rank0 = dist.get_rank() == 0
    tensors = lora.adapter_tensors(model, dtype, keep=rank0)
    gathered_at = time.monotonic()
    nbytes = 0
    if rank0:
        staged = store.stage(version)
        entry, entries = store.write_file(staged, ADAPTER_WEIGHTS, tensors)
        nbytes = entry.bytes

        def metadata():
            copy_model_metadata(model_path, staged)
            model.peft_config[lora.ADAPTER].save_pretrained(staged)  # PEFT's own ADAPTER_CONFIG
            if not os.path.isfile(os.path.join(staged, ADAPTER_CONFIG)):
                raise RuntimeError(f"peft wrote no {ADAPTER_CONFIG} in {staged}")

        when_space(metadata, staged)
        store.publish(
            staged,
            version,
            step,
            keep,
            described=([entry], entries),
            announce=announce,
            adapter=lora.manifest_field(model, base or ""),
        )
    dist.barrier()
    return {
        "weights/delta": 0.0,
        "weights/adapter": 1.0,
        "weights/published_bytes": store.last_bytes if rank0 else 0,
        "weights/published": version,
        "weights/published_at": store.announced_at,
        "weights/publish_s": time.monotonic() - t0,
        "weights/gather_s": gathered_at - t0,
        "weights/bytes": nbytes,
    }
