"""Attention for packed micro-batches on GPU without flash_attn installed: torch's own varlen
FlashAttention (`torch.nn.attention.varlen.varlen_attn`), registered with transformers as
"tandem_varlen". Rows are cut where the position ids restart at 0, so each row attends to
itself only, causally, with no (N x N) mask and no work across row boundaries.

transformers builds no mask for an implementation it has no mask function for, so this kernel
serves packed rows only (one row of position ids, no attention mask); a padded batch is refused.
`attn_implementation` (moved here from trainer/sft.py, which packs too) picks transformers' own.
"""

from __future__ import annotations

import importlib.util

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


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: query (1, Hq, N, D), key/value (1, Hkv, N, D);
    returns (1, N, Hq, D) and no weights."""
    from torch.nn.attention.varlen import varlen_attn

    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1:
        raise ValueError(f"attn_implementation={NAME} runs packed rows only (position ids, no attention mask)")
    if dropout:
        raise ValueError(f"attn_implementation={NAME}: no attention dropout")
    cu, longest = cu_seqlens(position_ids)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, H, D)
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0), enable_gqa=True)
    return out.unsqueeze(0), None


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


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)
    return NAME
