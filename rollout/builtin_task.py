"""The built-in task, tokenizer and tiny model, so the whole pipeline runs offline on a CPU.

Task: the prompt is a string of digits; the answer is a fixed function of it (copy or reverse)
followed by end-of-sequence. The reward gives partial credit per position, so a randomly
initialised model starts near 1/vocab and can climb by RL alone. Everything is generated
locally: a character-level tokenizer built with `tokenizers`, a Qwen2-architecture model built
from a small config, and a verl-format parquet of prompts.
"""
from __future__ import annotations

import random
from pathlib import Path

DATA_SOURCES = {"tandem/copy": lambda s: s, "tandem/reverse": lambda s: s[::-1]}
SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHARS = list("0123456789=")
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}={% endif %}")


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """Fraction of answer positions right; extra or missing characters count as wrong."""
    target = str(ground_truth)
    hits = sum(a == b for a, b in zip(solution_str, target))
    return hits / max(len(target), len(solution_str))


def make_rows(num: int, digits: int, task: str = "tandem/reverse", seed: int = 0) -> list[dict]:
    """verl RL dataset rows for `num` random digit strings of length `digits`."""
    if task not in DATA_SOURCES:
        raise ValueError(f"task {task!r}: choose one of {sorted(DATA_SOURCES)}")
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        question = "".join(rng.choice("0123456789") for _ in range(digits))
        rows.append({
            "data_source": task,
            "prompt": [{"role": "user", "content": question}],
            "ability": "digits",
            "reward_model": {"style": "rule", "ground_truth": DATA_SOURCES[task](question)},
            "extra_info": {"split": "train", "index": i},
        })
    return rows


def write_parquet(path: str | Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(vocab_size: int, seed: int = 0, hidden: int = 64, layers: int = 2):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 4,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=1, pad_token_id=0)
    return Qwen2ForCausalLM(config)


def write_model(out_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> None:
    """An HF model folder (config, safetensors, tokenizer) with random initial weights."""
    tok = build_tokenizer()
    model = build_model(len(tok), seed, hidden, layers)
    model.generation_config.top_k = None  # the sampler must not truncate what logprobs describe
    tmp = Path(f"{out_dir}.tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.replace(out_dir)
