"""Packed micro-batches on CUDA, through the kernel the trainer uses there (torch's varlen flash
attention, `tandem_varlen`, when flash_attn is not installed), against padded ones through
sdpa: the same logprobs and the same gradients, within bf16's own error.

Why a GPU test: tests/test_packing.py proves packing on CPU, where packed rows go through sdpa's
block-diagonal mask; on GPU they go through a different kernel (varlen, key/value heads repeated
on torch < 2.12) with its own backward. The first learn_gpu run with the packed trainer
(2026-12-02, benchmarks/README.md) did not learn in 90 steps where the padded trainer had; this
test tells a kernel fault from a recipe one.

Tolerance, measured rather than guessed: both CUDA paths run under bf16 autocast, so each is
compared with the padded path in float32 (sdpa, no autocast) on the same GPU, and the varlen
path's relative gradient error may be at most 3x the bf16 sdpa path's (plus 1e-3 for two
nearly exact paths). A kernel that leaks across rows, drops causality or mis-scales shows up
as an error of order 1 (CPU: 1e-1-sized differences with a leaking mask), far above that.

The CUDA work runs in a child process: the pytest process never touches CUDA
(tests/gpu/vllm_helpers.py), whatever order the GPU test files run in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from vllm_helpers import needs_gpus

pytestmark = [pytest.mark.gpu, needs_gpus(1)]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _samples():
    import random

    from protocol.experience import Sample

    rng = random.Random(0)
    out = []
    for i in range(12):  # ragged rows: prompts 3-60, responses 1-90 tokens of the built-in vocabulary (14)
        p, r = rng.randint(3, 60), rng.randint(1, 90)
        out.append(
            Sample(
                f"s{i}",
                f"g{i // 4}",
                "p",
                "w",
                0,
                [rng.randint(3, 13) for _ in range(p)],
                [rng.randint(3, 13) for _ in range(r)],
                [-1.0] * r,
                0.0,
                "stop",
                1.0,
                "tandem/copy",
                0.0,
                0.0,
            )
        )
    return out


def _child() -> dict:
    """Relative gradient errors of each path against float32 padded sdpa, and logprob errors."""
    import torch

    from rollout import builtin_task
    from trainer import algo, attention
    from trainer.batch import collate
    from trainer.update import micro

    dev = torch.device("cuda")
    assert attention.available(dev), "torch's varlen attention is not available on this GPU"
    tok = builtin_task.build_tokenizer()
    model = builtin_task.build_model(len(tok), seed=1, hidden=128, layers=3, heads=4, kv_heads=2, max_positions=256)
    model = model.float().to(dev).train()  # train mode, as build_actor leaves the actor
    name = attention.register()
    batch = collate(_samples()).to(dev)
    rows = torch.arange(len(batch), device=dev)
    padded, packed = micro(batch, rows, packed=False), micro(batch, rows, packed=True)
    adv = torch.linspace(-1, 1, padded.response_mask.numel(), device=dev).view_as(padded.response_mask)

    def run(c, impl: str, bf16: bool, ckpt: bool = False):
        model.config._attn_implementation = impl
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            lp, ent = algo.response_logprobs(model, c, with_entropy=True, chunk=64)
            loss = -(lp * adv[:, : lp.shape[1]]).sum() / c.response_mask.sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
        return lp.detach().float(), grads

    ref_lp, ref_g = run(padded, "sdpa", bf16=False)

    def err(lp, g) -> dict:
        return {
            "grad_rel": float((g - ref_g).norm() / ref_g.norm()),
            "lp_max_abs": float((lp - ref_lp).abs().max()),
        }

    out = {
        "padded_sdpa_bf16": err(*run(padded, "sdpa", bf16=True)),
        "packed_varlen_bf16": err(*run(packed, name, bf16=True)),
        "packed_varlen_bf16_ckpt": err(*run(packed, name, bf16=True, ckpt=True)),
        "packed_sdpa_fp32": err(*run(packed, "sdpa", bf16=False)),
        "grad_norm": float(ref_g.norm()),
        "torch": torch.__version__,
    }
    return out


def test_packed_varlen_gradients_match_padded_within_bf16_error():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, __file__, "--child"], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(r, indent=1))
    floor = r["padded_sdpa_bf16"]["grad_rel"]
    assert r["grad_norm"] > 0
    # the float32 packed path checks the comparison itself: reassociation only (test_packing.py)
    assert r["packed_sdpa_fp32"]["grad_rel"] < 1e-4, r
    for key in ("packed_varlen_bf16", "packed_varlen_bf16_ckpt"):
        assert r[key]["grad_rel"] <= 3 * floor + 1e-3, (key, r)
        assert r[key]["lp_max_abs"] <= 3 * r["padded_sdpa_bf16"]["lp_max_abs"] + 1e-3, (key, r)


if __name__ == "__main__" and sys.argv[1:] == ["--child"]:
    print(json.dumps(_child()))
