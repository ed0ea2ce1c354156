"""trainer.algo.LinearLogSoftmax, the lm_head block fused with the log-softmax (issue 25), against
plain autograd over the same maths (the `_logprob_entropy` it replaced): the same logprobs,
entropy and gradients of h and the head's weight, for a differentiable entropy, a metric-only
one and none; float64 gradcheck; and the property it exists for: nothing (k, V)-sized is saved
for backward, and a metric-only entropy costs the backward no (k, V) work.

Tolerance: fp32, both sides compute the same sums in other orders (one exp of max-shifted logits
here, logsumexp + softmax there; in-place chains in backward), so they differ by reassociation
only. Measured over these cases (torch 2.13 CPU, max abs error over the scale): logprobs 0
(bitwise equal, as are the logprob-only gradients), entropy 2.3e-7 of the largest |logit| (the
plain lse - sum p z cancels two terms of the logits' size; the fused form subtracts the max
first and is the closer to float64 on a wider sweep: 5e-6 against 1.4e-5 abs), gradients with
the entropy term 7.0e-6 of the largest |gradient|. The tolerances are ~10x those (logprobs: a
few ulps, room for other CPUs' kernels); a dropped temperature, entropy term or one-hot is an
error of order 1e-2 to 1.
"""

from __future__ import annotations

import pytest
import torch
from test_packing import _model, _samples

from trainer import algo
from trainer.algo import LinearLogSoftmax
from trainer.batch import collate
from trainer.update import micro

V, H = 1000, 32
LP_RTOL, ENT_RTOL, GRAD_RTOL = 1e-6, 3e-6, 7e-5  # of the largest |logprob|, |logit|, |gradient|


def _inputs(k: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(k, H, generator=g, dtype=dtype)
    w = torch.randn(V, H, generator=g, dtype=dtype) * 0.5  # logits of order 1-10, up to ~40 at t=0.5
    targets = torch.randint(0, V, (k,), generator=g)
    temps = (torch.rand(k, generator=g, dtype=dtype) + 0.5).to(dtype)  # in [0.5, 1.5): never 1
    return h, w, targets, temps


def _plain(h, w, targets, temps) -> torch.Tensor:
    """The maths in plain autograd ops: (k, 2) [log pi(target), entropy]."""
    logits = (h @ w.t()).to(torch.promote_types(h.dtype, torch.float32)) / temps.unsqueeze(1)
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return torch.stack([target - lse, entropy], dim=1)


def _run(fn, h, w, targets, temps, g_lp, g_ent, entropy_grad: bool):
    """(out, grad h, grad w, max |logit|) of loss = sum(g_lp lp) + sum(g_ent entropy), the entropy
    detached when it is a metric only (as response_logprobs does)."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(h, w, targets, temps)
    ent = out[:, 1] if entropy_grad else out[:, 1].detach()
    (out[:, 0] * g_lp + ent * g_ent).sum().backward()
    return out.detach(), h.grad, w.grad, float((h @ w.t() / temps.unsqueeze(1)).detach().abs().max())


def _assert_close(got, want, rtol: float, scale: float, what: str) -> None:
    err = float((got - want).abs().max())
    assert err <= rtol * scale, (what, err, rtol * scale)


@pytest.mark.parametrize("k", [1, 5, 64, 257])
@pytest.mark.parametrize(
    "entropy_grad, ent_weight", [(True, 1.0), (False, 1.0), (True, 0.0)], ids=["entropy", "metric", "logprob_only"]
)
def test_fused_matches_plain_autograd(k, entropy_grad, ent_weight):
    h, w, targets, temps = _inputs(k, seed=k)
    g = torch.Generator().manual_seed(100 + k)
    g_lp, g_ent = torch.randn(k, generator=g), ent_weight * torch.randn(k, generator=g)
    fused = _run(
        lambda *a: LinearLogSoftmax.apply(*a, True, entropy_grad), h, w, targets, temps, g_lp, g_ent, entropy_grad
    )
    plain = _run(_plain, h, w, targets, temps, g_lp, g_ent, entropy_grad)
    out, want, logit_max = fused[0], plain[0], plain[3]
    _assert_close(out[:, 0], want[:, 0], LP_RTOL, float(want[:, 0].abs().max()), "logprob")
    _assert_close(out[:, 1], want[:, 1], ENT_RTOL, logit_max, "entropy")
    for name, got, ref in (("grad_h", fused[1], plain[1]), ("grad_w", fused[2], plain[2])):
        _assert_close(got, ref, GRAD_RTOL, float(ref.abs().max()), name)


def test_without_entropy_the_column_is_zeros_and_logprobs_unchanged():
    h, w, targets, temps = _inputs(9)
    with_ent = LinearLogSoftmax.apply(h, w, targets, temps, True, True)
    without = LinearLogSoftmax.apply(h, w, targets, temps, False, True)
    assert torch.equal(without[:, 0], with_ent[:, 0])
    assert torch.equal(without[:, 1], torch.zeros(9))


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_gradcheck_float64(entropy_grad):
    h, w, targets, temps = _inputs(3, seed=1, dtype=torch.float64)
    h, w = h.requires_grad_(), (w[:11] * 4).detach().requires_grad_()  # V = 11, peaked softmax
    targets = targets % 11

    def fn(h, w):  # a metric-only entropy has no gradient by design: check the logprob column alone
        out = LinearLogSoftmax.apply(h, w, targets, temps, True, entropy_grad)
        return out if entropy_grad else out[:, 0]

    assert fn(h, w).dtype == torch.float64  # the Function keeps float64 (its "fp32" is at least fp32)
    assert torch.autograd.gradcheck(fn, (h, w), eps=1e-6, atol=1e-8, rtol=1e-6)


def _saved_numels(fn) -> list[int]:
    """The number of elements of every tensor autograd saves for backward while `fn` runs."""
    sizes: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        fn()
    return sizes


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_no_vocab_sized_tensor_is_saved_for_backward(entropy_grad):
    k = 256  # k*V = 256,000, above the weight's V*H = 32,000 and h's k*H = 8,192
    h, w, targets, temps = (t.requires_grad_() if t.is_floating_point() and t.dim() == 2 else t for t in _inputs(k))
    fused = _saved_numels(lambda: LinearLogSoftmax.apply(h, w, targets, temps, True, entropy_grad))
    # the inputs (weight the largest, the parameter itself: no copy) and per-row (k,) vectors
    assert max(fused) == V * H and sorted(fused)[:-2] == [k] * (len(fused) - 2)
    assert len(fused) == 4 + 1 + entropy_grad  # h, weight, targets, temps, lse (+ E_p[z])
    assert max(_saved_numels(lambda: _plain(h, w, targets, temps))) >= k * V  # what plain autograd keeps
    # Reference and pi_old passes: nothing saved at all.
    with torch.no_grad():
        assert _saved_numels(lambda: LinearLogSoftmax.apply(h, w, targets, temps, True, True)) == []
    frozen = (h.detach(), w.detach(), targets, temps)
    assert _saved_numels(lambda: LinearLogSoftmax.apply(*frozen, True, True)) == []


def _vocab_ops_in_backward(entropy_grad: bool, k: int = 64) -> int:
    """How many (k, V)-sized tensors the backward produces (a count of its element-wise passes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.n += isinstance(out, torch.Tensor) and out.numel() == k * V
            return out

    h, w, targets, temps = _inputs(k)
    h, w = h.requires_grad_(), w.requires_grad_()
    out = LinearLogSoftmax.apply(h, w, targets, temps, True, entropy_grad)
    ent = out[:, 1] if entropy_grad else out[:, 1].detach()
    loss = (out[:, 0] + ent).sum()
    with Count():
        loss.backward()
    return Count.n


def test_metric_only_entropy_makes_the_backward_cheaper():
    metric, differentiable = _vocab_ops_in_backward(False), _vocab_ops_in_backward(True)
    assert metric < differentiable, (metric, differentiable)


def test_response_logprobs_chunked_with_a_metric_entropy_matches_full_logits():
    """The tiny Qwen2 end to end (tests/test_packing.py covers a differentiable entropy): a
    metric-only entropy, chunked across blocks, gives the full-logits path's values and the
    logprob loss's gradients; without with_entropy the entropy is None."""
    model = _model()
    batch = collate(_samples())
    c = micro(batch, torch.arange(len(batch)), packed=True)
    grads = {}
    for chunk in (None, 4):
        model.zero_grad(set_to_none=True)
        lp, ent = algo.response_logprobs(model, c, with_entropy=True, entropy_grad=False, chunk=chunk)
        assert not ent.requires_grad
        (lp.sum() + ent.sum()).backward()
        grads[chunk] = (lp.detach(), ent, [p.grad.clone() for p in model.parameters()])
    assert torch.allclose(grads[4][0], grads[None][0], atol=1e-5)
    assert torch.allclose(grads[4][1], grads[None][1], atol=1e-5)
    for a, b in zip(grads[4][2], grads[None][2]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    lp, ent = algo.response_logprobs(model, c, chunk=4)
    assert ent is None and torch.allclose(lp, grads[None][0], atol=1e-5)


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_compiled_blocks_match_eager_and_compile_once(monkeypatch, entropy_grad):
    """compiled=True (trainer.compile_layers) sends each block's element-wise work through
    torch.compile: dynamo traces both functions whole (no graph break; the in-place chains
    functionalised) and the values and gradients are eager's; blocks of other lengths reuse the
    graphs (dynamic shapes: a micro-batch's last block is shorter), and a 1-row block stays eager
    (a size-1 dimension would be specialised: a recompile mid-run). Backend aot_eager: dynamo's
    tracing and functionalisation without inductor's C++ build (inductor itself, on CUDA, is
    tests/gpu/test_compiled_layers_cuda.py's). Tolerance: the same as the fused-vs-plain test
    above (functionalisation may reorder nothing but allocations: measured 0 difference)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(algo, "COMPILE_BACKEND", "aot_eager")
    before, graphs = int(counters["stats"]["unique_graphs"]), []
    for k in (64, 257, 5, 1):
        h, w, targets, temps = _inputs(k, seed=k)
        g = torch.Generator().manual_seed(100 + k)
        g_lp, g_ent = torch.randn(k, generator=g), torch.randn(k, generator=g)
        runs = [
            _run(
                lambda *a, c=c: LinearLogSoftmax.apply(*a, True, entropy_grad, c),
                h,
                w,
                targets,
                temps,
                g_lp,
                g_ent,
                entropy_grad,
            )  # fmt: skip
            for c in (False, True)
        ]
        graphs.append(int(counters["stats"]["unique_graphs"]))
        (out, gh, gw, _), (want, wh, ww, logit_max) = runs[1], runs[0]
        _assert_close(out[:, 0], want[:, 0], LP_RTOL, float(want[:, 0].abs().max()), "logprob")
        _assert_close(out[:, 1], want[:, 1], ENT_RTOL, logit_max, "entropy")
        _assert_close(gh, wh, GRAD_RTOL, float(wh.abs().max()), "grad_h")
        _assert_close(gw, ww, GRAD_RTOL, float(ww.abs().max()), "grad_w")
    assert not counters["graph_break"], dict(counters["graph_break"])
    # the first block built the graphs (forward and backward; the forward's already cached when
    # the other parametrisation ran first), the other lengths none
    assert graphs[0] > before and graphs[1:] == [graphs[0]] * 3, (before, graphs)
