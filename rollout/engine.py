"""Generation engines behind one interface (rollout/engine_types.py): transformers (CPU, the
embedded default, here) and vLLM (rollout/vllm_engine.py); `build_engine` picks one.

An engine samples `n` completions per prompt with the log-probability of every sampled token
under the sampling distribution (temperature applied), and loads new HF-named weights in place.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rollout.engine_types import Completion, Engine, SamplingSettings


def _dtype(name: str):
    return {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class HFEngine:
    """transformers `generate` with sampling; the CPU path of the product."""

    def __init__(self, model_dir: str, dtype: str = "auto", device: str = "auto"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_dtype(dtype) or "auto")
        self.model.to(self.device).eval()
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.adapter: str | None = None  # PEFT's name of the live adapter (adapter-only versions)

    def _left_pad(self, prompts: list[list[int]]):
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingSettings) -> list[list[Completion]]:
        from transformers import GenerationConfig

        torch.manual_seed(params.seed)
        ids, mask = self._left_pad(prompts)
        sampling = (
            dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0))
            if params.temperature > 0
            else dict(do_sample=False)
        )  # greedy (validation)
        gen = GenerationConfig(
            **sampling,
            max_new_tokens=params.max_tokens,
            num_return_sequences=params.n,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        new_tokens = out.sequences[:, ids.shape[1] :]
        # out.scores are the processed logits the sampler drew from (temperature/top-p applied),
        # so their log-softmax is the behaviour policy mu of each token.
        logprobs = torch.stack(out.scores, dim=1).float().log_softmax(-1)
        token_lp = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        results: list[list[Completion]] = []
        for i in range(len(prompts)):
            group = []
            for j in range(params.n):
                row = i * params.n + j
                toks = new_tokens[row].tolist()
                hit = self.eos_id in toks
                stop = toks.index(self.eos_id) + 1 if hit else len(toks)
                group.append(Completion(toks[:stop], token_lp[row, :stop].tolist(), "stop" if hit else "length"))
            results.append(group)
        return results

    def load_files(self, paths: list[str]) -> int:
        from buffer.weights.fs import read_tensors

        return self.load_weights(read_tensors(paths))

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        state = self.model.state_dict()
        loaded = set()
        for name, tensor in tensors:
            if name not in state:
                raise KeyError(f"weight {name!r} is not a parameter of the running model")
            state[name].copy_(tensor.to(state[name].dtype))
            loaded.add(name)
        missing = set(state) - loaded - ({"lm_head.weight"} if self.tied else set())
        if missing:
            raise KeyError(f"weight version lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        return len(loaded)

    @torch.no_grad()
    def load_adapter(self, folder: str, version: int) -> int:
        """Put the adapter-only version in `folder` (PEFT's layout, verified) on the base as
        adapter `v<version>` and drop the one before: the first through PeftModel.from_pretrained,
        later ones through load_adapter + set_adapter + delete_adapter. Every tensor of the file
        must then be the model's adapter exactly (PEFT only warns about keys it did not match, and
        a silently unloaded tensor would be a stale policy). Returns the tensors loaded."""
        from peft import PeftModel, get_peft_model_state_dict
        from safetensors.torch import load_file

        from protocol.weights import ADAPTER_WEIGHTS, ManifestError

        name, old = f"v{version}", self.adapter
        if old is None:
            self.model = PeftModel.from_pretrained(self.model, folder, adapter_name=name, is_trainable=False)
        else:
            self.model.load_adapter(folder, adapter_name=name, is_trainable=False)
            self.model.set_adapter(name, inference_mode=True)
            self.model.delete_adapter(old)
        self.model.eval()
        self.adapter = name
        published = load_file(f"{folder}/{ADAPTER_WEIGHTS}")
        held = get_peft_model_state_dict(self.model, adapter_name=name)
        if set(held) != set(published):
            raise ManifestError(
                f"{folder}: the adapter's tensors {sorted(set(published) ^ set(held))[:3]} do not match "
                "the running model's adapter layers"
            )
        for key, t in published.items():
            # in the dtype PEFT keeps it in (it may upcast a bf16 adapter): the same cast both sides
            if not torch.equal(held[key], t.to(held[key].device, held[key].dtype)):
                raise ManifestError(f"{folder}: {key} did not load as published")
        return len(published)

    def close(self) -> None:
        self.model = None


def build_engine(model_dir: str, cfg, device: str, adapter: dict | None = None) -> Engine:
    """`cfg` is the worker's actor_rollout_ref.rollout section; `adapter`: the first version's
    WeightManifest.adapter when the run's versions are adapter-only (`model_dir` is then the
    base; vLLM sizes its LoRA slots by it)."""
    if cfg.name == "hf":
        return HFEngine(model_dir, cfg.dtype, device)
    from rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, cfg, lora_rank=0 if adapter is None else int(adapter["rank"]))
