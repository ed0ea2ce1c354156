"""The rows' boundaries of a packed micro-batch reach every layer's attention from the trainer,
computed once per micro-batch (trainer/batch.py, trainer/algo.py), instead of being derived in
each layer from the position ids (trainer/attention.py's `row_bounds`). On the H200 the
derivation was a host sync per layer and, in a compiled layer, a graph break whose resumed frame
recompiled for every packed length (benchmarks/README.md, issue 25, 2026-12-04).

torch's varlen kernel is CUDA-only, so these CPU tests attend through a probe registered with
transformers like tandem_varlen and built on the same `row_bounds`: a block-diagonal causal mask
made from the boundaries with tensor ops only (no host sync), then sdpa. Its logprobs must equal
the sdpa path's (fp32, the same reassociation-only tolerance as tests/test_packing.py), every
layer must have been handed the micro-batch's own boundaries, and a layer compiled by dynamo over
three packed lengths must trace without a graph break. tests/gpu/test_compiled_layers_cuda.py
checks the real kernel compiled on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from test_packing import LP_ATOL, _samples

from rollout import builtin_task
from trainer import algo, attention
from trainer.batch import collate
from trainer.model import decoder_layers
from trainer.update import micro

PROBE = "tandem_probe"


def _probe(seen: list):
    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cu, longest = attention.row_bounds(kwargs["position_ids"], kwargs)
        seen.append((cu, longest, "cu_seq_lens_q" in kwargs))
        n = query.shape[2]
        row = torch.searchsorted(cu[1:].long(), torch.arange(n), right=True)  # each token's row
        mask = (row[:, None] == row[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
        reps = query.shape[1] // key.shape[1]
        key, value = (t.repeat_interleave(reps, dim=1) for t in (key, value))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2), None

    return attend


def _model(impl: str):
    tok = builtin_task.build_tokenizer()
    m = builtin_task.build_model(len(tok), seed=1, hidden=32, layers=2, pad_id=tok.pad_token_id)
    m.config._attn_implementation = impl
    return m.float()


def _packed(rows: int | None = None):
    samples = _samples() if rows is None else (_samples() * 3)[:rows]
    batch = collate(samples)
    return micro(batch, torch.arange(len(batch)), packed=True)


def test_every_layer_attends_with_the_micro_batch_own_row_bounds():
    from transformers import AttentionInterface

    seen: list = []
    AttentionInterface.register(PROBE, _probe(seen))
    c = _packed()
    lengths = c.position_ids[0].eq(0).nonzero().flatten().tolist() + [c.position_ids.shape[1]]
    probe_lp, _ = algo.response_logprobs(_model(PROBE), c)
    sdpa_lp, _ = algo.response_logprobs(_model("sdpa"), c)
    assert torch.allclose(probe_lp, sdpa_lp, atol=LP_ATOL)  # the probe keeps the rows apart
    assert len(seen) == 2  # one call per layer
    for cu, longest, handed in seen:
        assert handed, "the layer derived the boundaries itself (a host sync per layer on GPU)"
        assert cu.tolist() == lengths and cu.dtype == torch.int32
        assert longest == max(b - a for a, b in zip(lengths, lengths[1:]))


def test_a_compiled_layer_traces_three_packed_lengths_without_a_graph_break():
    from torch._dynamo.utils import counters
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE, _probe([]))
    model = _model(PROBE)
    torch._dynamo.reset()
    counters.clear()
    for layer in decoder_layers(model):
        layer.compile(dynamic=True, backend="eager")  # dynamo's tracing is what is checked here
    lengths = set()
    for rows in (4, 7, 11):
        c = _packed(rows)
        lengths.add(c.position_ids.shape[1])
        lp, _ = algo.response_logprobs(model, c)
        lp.sum().backward()
    assert len(lengths) == 3
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch._dynamo.reset()
