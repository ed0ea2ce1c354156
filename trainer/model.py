"""The actor (an HF causal LM) and the critic (the same backbone with a scalar value head),
sharded with FSDP2, one `fully_shard` unit per decoder layer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of an HF causal LM (Qwen2/Llama-style: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__}: no model.layers to shard; only decoder-only HF causal LMs are supported"
        )
    return list(layers)


def build_actor(
    model_path: str,
    device: torch.device,
    gradient_checkpointing: bool = False,
    trainable: bool = True,
    value_head: bool = False,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    lora=None,
    compile_layers: bool = False,
    checkpoint_every: int = 1,
):
    """`compile_layers`: torch.compile each decoder layer in place before it is sharded (as
    torchtitan compiles each block before FSDP2), with dynamic shapes: packed micro-batches vary
    in length every step and must not recompile for each.
    `value_head`: the critic as verl builds it, AutoModelForTokenClassification with one label
    (the backbone's weights, a new linear `score` head, no dropout); its logits are (B, T, 1).
    `attn_implementation` None: transformers' default for the model (sdpa for Qwen2).
    `lora` (trainer.lora.LoraSpec): PEFT adapters on the frozen base, added before sharding so
    each decoder layer's FSDP unit holds its adapters beside its frozen weights.
    `checkpoint_every` k (with `gradient_checkpointing`): only layers 0, k, 2k, ... recompute
    their forward in backward; the others keep their activations (trainer.checkpoint_every)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    extra = {"trust_remote_code": trust_remote_code, "attn_implementation": attn_implementation}
    if value_head:
        config = AutoConfig.from_pretrained(model_path, num_labels=1, trust_remote_code=trust_remote_code)
        config.classifier_dropout = 0.0  # not every config class declares it (Qwen2's does not)
        model = AutoModelForTokenClassification.from_pretrained(model_path, config=config, dtype=torch.float32, **extra)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **extra)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for i, layer in enumerate(decoder_layers(model)):
            layer.gradient_checkpointing = i % checkpoint_every == 0  # read per call by the layer
    # from_pretrained returns the model in eval mode, and transformers' decoder layers checkpoint
    # only `if self.gradient_checkpointing and self.training`: without train() the flag above
    # did nothing (the same peak memory with and without it, trainer25 on H200, 2026-12-02).
    # No dropout either way (Qwen's attention_dropout is 0, the critic's classifier_dropout 0).
    model.train(trainable)
    if not trainable:  # the reference policy: frozen
        model.requires_grad_(False)
    if lora is not None:
        from trainer import lora as lora_mod

        model = lora_mod.apply(model, lora, value_head=value_head)
    model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # On GPU: bf16 compute with fp32 master weights and fp32 gradient reduction.
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    from trainer.lora import hf_model

    for layer in decoder_layers(hf_model(model)):
        if compile_layers:
            layer.compile(dynamic=True)  # lazy: compiled at its first call
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(hf_model(model), mesh=mesh, mp_policy=mp)  # a PeftModel wrapper owns no parameters
    return model


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (dynamo's own counter). A rise in a
    step after the first is a recompile: a micro-batch outside the shape class the layers were
    compiled for (trainer25 on H200, 2026-12-04: one step of ~15 s among steps of ~1.5 s)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def log_recompiles() -> None:
    """Have torch log why it recompiles (the failed guard), as TORCH_LOGS=recompiles would, unless
    the user set TORCH_LOGS: the reason, not only the slow step, reaches the trainer's log."""
    import os

    if not os.environ.get("TORCH_LOGS"):
        torch._logging.set_logs(recompiles=True)


def adamw(params, lr: float, weight_decay: float, betas) -> torch.optim.AdamW:
    """AdamW over `params`; on CUDA the fused kernel (one launch for every tensor instead of
    torch's default foreach steps: the optimizer's element-wise work was part of the ~45% of a
    step's GPU time spent outside matrix multiplies, benchmarks/README.md). CPU keeps the
    default, so CPU results do not change."""
    params = list(params)
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), fused=fused or None)


def packed_attention(device: torch.device) -> str:
    """The attention kernel for packed micro-batches: varlen flash attention on GPU (flash_attn's
    when installed, else torch's own, trainer/attention.py), else sdpa with transformers'
    block-diagonal mask (trainer/sft.py's choice, which also refuses a transformers that cannot
    keep packed rows apart)."""
    import importlib.util

    from trainer import attention

    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is None and attention.available(device):
        return attention.register()
    return attention.attn_implementation("auto", device)
