"""verl's update semantics, shared by the actor and the critic: mini-batches, epochs, micro-batches.

A trainer step holds `data.train_batch_size` prompt groups, numbered 0..G-1 by rank 0, which
deals group i to rank i % world (a group never spans ranks). Group i belongs to mini-batch
i // ppo_mini_batch_size (mini-batch sizes count prompts, as verl's, each bringing its rollout.n
samples), so a rank may hold no rows of some mini-batch. For `ppo_epochs` epochs each mini-batch
is one optimizer step; with `shuffle` every epoch deals a rank's rows into its mini-batches in a
new random order (verl shuffles within each data-parallel rank too). Inside a mini-batch,
micro-batches by sample count or token budget.

FSDP's all-gathers and reduce-scatters must pair up across ranks, so every rank runs the same
number of micro-batch passes in each mini-batch: shorter lists are padded with None, a pass over
row 0 with weight 0. The loss of every pass is normalised by the mini-batch's token and sequence
counts over all ranks (verl's global_batch_info), so the accumulated gradient is that of the
mini-batch's global mean whatever the split.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from trainer.batch import Batch
from trainer.lora import hf_model
from trainer.sft_data import micro_batches as first_fit


@dataclasses.dataclass
class MiniBatch:
    passes: list[torch.Tensor | None]  # per micro-batch: row indices into the rank's batch
    tokens: int  # response tokens of the mini-batch over all ranks
    seqs: int  # sequences of the mini-batch over all ranks


def micro_spans(lengths: list[int], cfg) -> list[tuple[int, int]]:
    """[start, stop) spans over rows with `lengths` (prompt + response tokens): at most
    cfg.ppo_micro_batch_size_per_gpu rows, or with cfg.use_dynamic_bsz at most
    cfg.ppo_max_token_len_per_gpu padded tokens (rows x longest row; at least one row)."""
    spans, start = [], 0
    while start < len(lengths):
        stop = start + 1
        if cfg.use_dynamic_bsz:
            while (
                stop < len(lengths)
                and (stop + 1 - start) * max(lengths[start : stop + 1]) <= cfg.ppo_max_token_len_per_gpu
            ):
                stop += 1
        else:
            stop = min(len(lengths), start + cfg.ppo_micro_batch_size_per_gpu)
        spans.append((start, stop))
        start = stop
    return spans


def balanced(lengths: list[int], budget: int, at_least: int = 1) -> list[list[int]]:
    """Indices into `lengths` in micro-batches of at most `budget` tokens each, as even as the
    rows allow: verl's dynamic batching (ceil(total / budget) micro-batches, balanced), not first
    fit's full ones and a remainder (first fit left a 1,590-token fifth micro-batch beside four
    of ~16,300: trainer25, 4B, 2026-12-04, the step the compiled layers stalled ~15 s in, and a
    pass of fixed costs for few tokens). Longest first into the lightest bin (LPT); one more bin
    while one overflows, up to first fit's count; at least `at_least` (the most any rank needs:
    smaller micro-batches rather than a padding pass). A row over the budget goes alone."""
    alone = [[i] for i, n in enumerate(lengths) if n > budget]
    rest = [i for i, n in enumerate(lengths) if n <= budget]
    if not rest:
        return alone
    fit = first_fit(lengths, rest, budget, None)
    least = min(len(rest), max(at_least - len(alone), -(-sum(lengths[i] for i in rest) // budget)))
    for k in range(least, max(least, len(fit)) + 1):
        bins, heaviest = _lightest_first(lengths, rest, k)
        if heaviest <= budget:
            return alone + bins
    return alone + fit  # LPT overflowed even at first fit's count (rare): first fit's bins


def _lightest_first(lengths: list[int], rows: list[int], k: int) -> tuple[list[list[int]], int]:
    """`rows` longest first, each into the bin holding the fewest tokens: (bins, heaviest bin's
    tokens). Ties go to the lower bin, so the split is the same on every run."""
    heap = [(0, b) for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins, max(load for load, _ in heap) if heap else 0


def micro_batches(rows: torch.Tensor, lengths: list[int], cfg, packed: bool, at_least: int = 1) -> list[torch.Tensor]:
    """A mini-batch's rows cut into micro-batches. Packed with use_dynamic_bsz: the token budget
    counts real tokens, the micro-batches balanced (`balanced`, at least `at_least` of them);
    otherwise contiguous spans (`micro_spans`)."""
    if packed and cfg.use_dynamic_bsz:
        local = balanced(lengths, cfg.ppo_max_token_len_per_gpu, at_least)
        return [rows[torch.tensor(sorted(b))] for b in local]
    return [rows[a:b] for a, b in micro_spans(lengths, cfg)]


def plan(row_sets: list[torch.Tensor], batch: Batch, cfg, packed: bool = False) -> list[MiniBatch]:
    """One MiniBatch per set of rows, its micro-batch passes padded to the most any rank has.
    Collective: two all-reduces for the whole plan."""
    lengths = batch.attention_mask.sum(1).tolist()
    response = batch.response_mask.sum(1)
    passes = [micro_batches(rows, [lengths[i] for i in rows.tolist()], cfg, packed) for rows in row_sets]
    device = batch.input_ids.device
    count = torch.tensor([len(p) for p in passes], device=device)
    sizes = torch.tensor(
        [[float(response[rows].sum()), len(rows)] for rows in row_sets], dtype=torch.float64, device=device
    )
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    dist.all_reduce(sizes)
    if packed and cfg.use_dynamic_bsz:  # as many micro-batches as the busiest rank: fewer pads
        for j, (rows, n) in enumerate(zip(row_sets, count.tolist())):
            if len(passes[j]) < n:
                spread = micro_batches(rows, [lengths[i] for i in rows.tolist()], cfg, packed, int(n))
                passes[j] = spread if len(spread) <= n else passes[j]  # never more: passes pair up
    return [
        MiniBatch(p + [None] * (int(n) - len(p)), int(s[0]), int(s[1]))
        for p, n, s in zip(passes, count.tolist(), sizes.tolist())
    ]


def micro(batch: Batch, rows: torch.Tensor | None, packed: bool) -> Batch:
    """The micro-batch of `rows` (None: a padding pass over row 0), padded to its longest row or
    packed into one row (use_remove_padding)."""
    c = batch.select(rows if rows is not None else _DUMMY).trimmed()
    return c.packed() if packed else c


def epochs(
    group_index: torch.Tensor, mini_batch_size: int, num_groups: int, ppo_epochs: int, shuffle: bool, seed: list[int]
) -> list[torch.Tensor]:
    """Row sets of every optimizer step of the step, epoch by epoch. `group_index` (B,): the
    step-wide number of each row's group; `seed`: entropy for the shuffle (differs per step,
    rank and model, the same on resume)."""
    if len(group_index) and int(group_index.max()) >= num_groups:
        raise ValueError(
            f"group number {int(group_index.max())} outside the step's {num_groups} groups (data.train_batch_size)"
        )
    num_mini = num_groups // mini_batch_size
    mini_of_row = group_index // mini_batch_size
    base = [torch.nonzero(mini_of_row == k).flatten() for k in range(num_mini)]
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence(seed).generate_state(1)[0]))
    out = []
    for _ in range(ppo_epochs):
        if not shuffle:
            out += base
            continue
        order = torch.randperm(len(group_index), generator=gen)
        out += list(torch.split(order, [len(b) for b in base]))
    return out


def infer(fn: Callable[[Batch], torch.Tensor], batch: Batch, passes: list, packed: bool = False) -> torch.Tensor:
    """fn's (b, r) output for every row, no gradient, as one (B, R) tensor (zeros past a row's
    response). Collective through the model's FSDP all-gathers: all ranks, same passes."""
    out = torch.zeros(batch.response_mask.shape, device=batch.input_ids.device)
    with torch.no_grad():
        for rows in passes:
            part = fn(micro(batch, rows, packed))
            if rows is not None:
                out[rows, : part.shape[1]] = part
    return out


_DUMMY = torch.tensor([0])  # the row a padding pass runs (every rank holds at least one group)


def optimize(
    model,
    optimizer,
    minibatches: list[MiniBatch],
    lr: float,
    grad_clip: float,
    loss_fn: Callable[[torch.Tensor, MiniBatch], tuple[torch.Tensor, list]],
) -> tuple[torch.Tensor, list[float]]:
    """One optimizer step per mini-batch, gradients accumulated over its passes.
    loss_fn(rows, minibatch) -> (loss, [statistics...]); returns the statistics summed over this
    rank's passes (float64) and the gradient norm of each step."""
    for group in optimizer.param_groups:
        group["lr"] = lr  # a function of the trainer step: nothing to restore on resume
    totals, norms = None, []
    sync = gradient_sync(model)
    for mb in minibatches:
        for i, rows in enumerate(mb.passes):
            sync(i == len(mb.passes) - 1)
            weight = 1.0 if rows is not None else 0.0
            loss, stats = loss_fn(rows if rows is not None else _DUMMY, mb)
            (loss * weight).backward()
            stats = weight * torch.tensor([float(s) for s in stats], dtype=torch.float64)
            totals = stats if totals is None else totals + stats
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        norms.append(norm)
    return totals, norms


def gradient_sync(model) -> Callable[[bool], None]:
    """set(reduce) before each pass's backward. With one rank FSDP's reduce-scatter moves no data
    between ranks but still copies ~30 bytes per parameter and pass (bf16 gradient cast into an
    fp32 buffer, copied out, added to the sharded gradient: ~6 ms per billion parameters at an
    H200's 4.8 TB/s, an estimate), so the passes accumulate unsharded in the reduce dtype (fp32 on
    GPU: the same sum) and reduce once, at the mini-batch's last pass (10 bytes per parameter and
    pass). Several ranks reduce every pass: deferring would hold an unsharded fp32 gradient of the
    whole model on each rank."""
    inner = hf_model(model)
    if not isinstance(inner, FSDPModule) or dist.get_world_size() > 1:
        return lambda reduce: None
    return inner.set_requires_gradient_sync


def all_sum(values: torch.Tensor, device) -> torch.Tensor:
    """Sum over ranks (gloo has no AVG); float64 on the collective's device (NCCL: GPU)."""
    values = values.to(device)
    dist.all_reduce(values)
    return values.cpu()


def gather_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x: (C, B_r, R_r) on this rank -> ((C, B, R), first row of this rank): the ranks' rows in
    rank order, B = sum of B_r, R = max R_r, zero padded. Collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shape = torch.tensor(x.shape[1:], device=x.device)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    shapes = [tuple(s.tolist()) for s in shapes]
    b_max, r_max = max(s[0] for s in shapes), max(s[1] for s in shapes)
    padded = x.new_zeros((x.shape[0], b_max, r_max))
    padded[:, : x.shape[1], : x.shape[2]] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    rows = torch.cat([p[:, :b, :] for p, (b, _) in zip(parts, shapes)], dim=1)
    return rows, sum(b for b, _ in shapes[:rank])
