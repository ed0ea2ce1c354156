"""Delta density and bytes per weight version from real optimizer steps (issue 26).

    python -m benchmarks.weights_delta [--shape 0.5b|tiny] [--steps 4] [--lr 1e-6] [--full-freq 8]
        [--out benchmarks/results/weights_delta.json]

A Qwen2-shaped causal LM (transformers' Qwen2ForCausalLM from a config, random init: no model
hub; `--shape 0.5b` is Qwen2.5-0.5B's shape, 494 M parameters) with fp32 master weights takes
real AdamW steps (verl's usual actor learning rate, 1e-6, by default) on random token batches;
after each step the trainer's WeightStore publishes the bf16 weights (trainer.publish_full_freq:
a snapshot, then deltas), and a reader on a separate cache rebuilds each delta (as a network
worker does). Per version: the share of bf16 values that changed, the published bytes (delta
against full), the trainer's publish seconds and the reader's rebuild seconds, and the time to
load the same version full. A tiny RL run's own numbers are in its metrics
(`weights/delta_density`, `weights/published_bytes`, per publish) with trainer.publish_full_freq
> 1. On the 2-core CPU box a 0.5B step takes minutes; `--shape tiny` is for a quick look.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

SHAPES = {
    # Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads (2 KV), FFN 4864, vocab 151936, tied embeddings
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        vocab_size=1024,
        tie_word_embeddings=True,
    ),
}


def build(shape: str, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=512)
    return Qwen2ForCausalLM(cfg)


def published(model) -> dict[str, torch.Tensor]:
    """What the trainer publishes: bf16 copies of the state dict (tied lm_head left out)."""
    return {
        k: v.detach().to(torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
    }


def main(argv: list[str] | None = None) -> dict:
    from buffer.weights import delta
    from buffer.weights.fs import FsWeightSource, WeightStore, read_tensors

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (one version each)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--full-freq", type=int, default=8, help="trainer.publish_full_freq")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default=None, help="folder for the run (default: a temporary one, removed)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    root = args.root or tempfile.mkdtemp(prefix="weights_delta-")
    model = build(args.shape, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    meta = os.path.join(root, "model")
    os.makedirs(meta, exist_ok=True)
    model.config.save_pretrained(meta)
    store = WeightStore(os.path.join(root, "trainer"))
    store.publish_full_freq = args.full_freq
    reader_dir = os.path.join(root, "reader")  # a reader's own cache: rebuilds every delta
    rows = []
    gen = torch.Generator().manual_seed(args.seed)
    for version in range(args.steps + 1):
        step_s = 0.0
        if version:
            t0 = time.monotonic()
            ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step_s = time.monotonic() - t0
        tensors = published(model)
        t0 = time.monotonic()
        store.publish_hf_folder(meta, version, version, keep=3, tensors=tensors)
        publish_s = time.monotonic() - t0
        made = store.last_delta
        # the reader: the published folder copied (as a fetch brings it), then rebuilt on its base
        src = store.layout.version_dir(version)
        mine = os.path.join(reader_dir, "weights", f"v{version:06d}")
        shutil.copytree(src, mine)
        t0 = time.monotonic()
        reader = FsWeightSource(store.fs, type(store.layout)(reader_dir))
        files = reader.files(version)
        rebuild_s = time.monotonic() - t0
        t0 = time.monotonic()
        got = dict(read_tensors(files))
        load_s = time.monotonic() - t0
        exact = all(torch.equal(got[k].view(torch.int16), t.view(torch.int16)) for k, t in tensors.items())
        row = {
            "version": version,
            "kind": "full" if made is None else "delta",
            "published_bytes": store.last_bytes,
            "full_bytes": sum(t.numel() * 2 for t in tensors.values()),
            "density": None if made is None else made.density,
            "step_s": step_s,
            "publish_s": publish_s,
            "rebuild_s": rebuild_s if made is not None else 0.0,
            "read_full_s": load_s,
            "bit_exact": exact,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        for old in (
            os.path.join(reader_dir, "weights", f"v{version - 2:06d}"),
            delta.full_dir(os.path.join(reader_dir, "weights"), version - 2),
        ):  # the reader keeps two versions (disk: a 0.5B version is 1 GB)
            shutil.rmtree(old, ignore_errors=True)
    deltas = [r for r in rows if r["kind"] == "delta"]
    summary = {
        "shape": args.shape,
        "parameters": n_params,
        "lr": args.lr,
        "full_freq": args.full_freq,
        "versions": rows,
        "mean_density": sum(r["density"] for r in deltas) / len(deltas) if deltas else None,
        "mean_delta_share": sum(r["published_bytes"] / r["full_bytes"] for r in deltas) / len(deltas)
        if deltas
        else None,
        "all_bit_exact": all(r["bit_exact"] for r in rows),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "versions"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)
    return summary


if __name__ == "__main__":
    main()
