"""Attention for packed micro-batches on GPU without flash_attn installed: torch's own varlen
FlashAttention (`torch.nn.attention.varlen.varlen_attn`), registered with transformers as
"tandem_varlen". Rows are cut where the position ids restart at 0, so each row attends to
itself only, causally, with no (N x N) mask and no work across row boundaries.

transformers builds no mask for an implementation it has no mask function for, so this kernel
serves packed rows only (one row of position ids, no attention mask); a padded batch is refused.
`attn_implementation` (moved here from trainer/sft.py, which packs too) picks transformers' own.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch

NAME = "tandem_varlen"


def available(device: torch.device) -> bool:
    """torch's varlen kernel: CUDA only (FlashAttention-2 inside torch)."""
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return True


def cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cumulative row starts and the total, int32; the longest row) of one packed row."""
    pos = position_ids[0]
    starts = torch.nonzero(pos == 0).flatten()
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def row_bounds(position_ids: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, int]:
    """The rows' boundaries as the caller computed them once per micro-batch (transformers'
    flash-attention names, `cu_seq_lens_q` and `max_length_q`: trainer/algo.py passes them), else
    derived here from the position ids: a host sync (`.max()` to an int) in every layer, and in a
    compiled layer a graph break whose resumed frame recompiled for each packed length until
    dynamo gave up (H200, 2026-12-04: the compiled 1.5B step ran slower than eager)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return cu_seqlens(position_ids)
    return cu, kwargs["max_length_q"]  # the keys' are the same: no cache, queries = keys


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: query (1, Hq, N, D), key/value (1, Hkv, N, D);
    returns (1, N, Hq, D) and no weights."""
    from torch.nn.attention.varlen import varlen_attn

    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1:
        raise ValueError(f"attn_implementation={NAME} runs packed rows only (position ids, no attention mask)")
    if dropout:
        raise ValueError(f"attn_implementation={NAME}: no attention dropout")
    cu, longest = row_bounds(position_ids, kwargs)
    out_dtype, query, key, value = _half(query, key, value)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, H, D)
    options = _OPTIONS or _varlen_options(varlen_attn)
    if "enable_gqa" not in options and k.shape[1] != q.shape[1]:
        # torch < 2.12 (2.11 on the GPU image): no grouped-query heads in the kernel, so each
        # key/value head is repeated for its query heads (what enable_gqa does without copying)
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    kw: dict = {"enable_gqa": True} if "enable_gqa" in options else {}
    if "window_size" in options:
        kw["window_size"] = (-1, 0)  # causal: (-1, 0) = no limit to the left, none to the right
    else:
        kw["is_causal"] = True  # torch 2.10's spelling
    if "scale" in options:
        kw["scale"] = scaling
    elif scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-6 * scaling:
        raise ValueError(f"attn_implementation={NAME}: this torch's varlen_attn has no scale= (needs 1/sqrt(D))")
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kw).unsqueeze(0).to(out_dtype), None


def _half(*qkv: torch.Tensor) -> tuple:
    """(the caller's dtype, q, k, v in a dtype FlashAttention takes). Under autocast a float32
    model's rotary embedding (float32 cos/sin) promotes q and k to float32, which the kernel
    refuses ("only support fp16 and bf16"): they go in autocast's dtype, and the output back in
    the caller's, as transformers does for flash_attention_2. FSDP's bf16 parameters (the
    trainer) arrive in bf16 and pass unchanged. Without autocast a float32 call is refused
    rather than silently run at lower precision."""
    dtype = qkv[0].dtype
    if dtype in (torch.float16, torch.bfloat16):
        return (dtype, *qkv)
    if not torch.is_autocast_enabled("cuda"):
        raise ValueError(
            f"attn_implementation={NAME}: {dtype} inputs outside autocast; FlashAttention runs in "
            "fp16/bf16 only (use bf16 parameters, autocast, or model.attn_implementation=sdpa)"
        )
    half = torch.get_autocast_dtype("cuda")
    return (dtype, *(t.to(half) for t in qkv))


@functools.cache
def _varlen_options(fn) -> frozenset[str]:
    """The keyword options of this torch's varlen_attn: its signature grew from 2.10 (is_causal)
    to 2.11 (scale, window_size) to 2.12 (enable_gqa)."""
    return frozenset(inspect.signature(fn).parameters)


def attn_implementation(name: str, device: torch.device) -> str:
    """The attention kernel. Packing relies on transformers turning restarting position ids
    into a block-diagonal mask (sdpa, eager, flex) or varlen calls (flash_attention_2)."""
    if name == "auto":
        has_flash = importlib.util.find_spec("flash_attn") is not None
        name = "flash_attention_2" if device.type == "cuda" and has_flash else "sdpa"
    if name != "flash_attention_2":
        from transformers import masking_utils

        if not hasattr(masking_utils, "find_packed_sequence_indices"):
            import transformers

            raise RuntimeError(
                f"model.attn_implementation={name}: transformers "
                f"{transformers.__version__} cannot mask packed sequences apart; "
                "upgrade transformers or use flash_attention_2"
            )
    return name


_OPTIONS: frozenset[str] = frozenset()  # set by register(), outside any compiled frame


def register() -> str:
    global _OPTIONS
    from torch.nn.attention.varlen import varlen_attn
    from transformers import AttentionInterface

    _OPTIONS = _varlen_options(varlen_attn)
    AttentionInterface.register(NAME, varlen_attention)
    return NAME
