"""The built-in task, tokenizer and tiny model, so the whole pipeline runs offline on a CPU.

Task: the prompt is a string of digits; the answer is a fixed function of it (copy or reverse).
The reward gives partial credit per position, so a randomly initialised model starts near
1/vocab and can climb by RL alone. The default recipe (copy 3 digits drawn from 0-4, group size
16, lr 1e-3) was tuned so that it passes a mean reward of 0.5 in about 60-80 steps with samples
two versions stale; with all ten digits, or eos in the target, learning was slow and flaky. Everything is generated
locally: a character-level tokenizer built with `tokenizers`, a Qwen2-architecture model built
from a small config, and a verl-format parquet of prompts. For SFT, the same task goes through
rollout.preprocess as (question, answer) pairs (`write_sft_and_rl`, or `--format qa`).
"""

from __future__ import annotations

import random
from pathlib import Path

from buffer.storage import respect_umask
from rollout import preprocess
from rollout.preprocess import write_parquet  # noqa: F401  (the task's files are written with it)

DATA_SOURCES = {"tandem/copy": lambda s: s, "tandem/reverse": lambda s: s[::-1]}
SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHARS = list("0123456789=")
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """Fraction of answer positions right; extra or missing characters count as wrong."""
    target = str(ground_truth)
    if not target and not solution_str:  # nothing asked, nothing said: right (not 0 / 0)
        return 1.0
    hits = sum(a == b for a, b in zip(solution_str, target))
    return hits / max(len(target), len(solution_str))


def make_qa(
    num: int, digits: int, task: str = "tandem/copy", seed: int = 0, alphabet: str = "01234"
) -> list[tuple[str, str]]:
    """`num` (question, answer) pairs: random strings of `digits` characters from `alphabet`."""
    if task not in DATA_SOURCES:
        raise ValueError(f"task {task!r}: choose one of {sorted(DATA_SOURCES)}")
    if not alphabet or set(alphabet) - set("0123456789"):
        raise ValueError(f"alphabet {alphabet!r}: use digits only")
    rng = random.Random(seed)
    questions = ["".join(rng.choice(alphabet) for _ in range(digits)) for _ in range(num)]
    return [(q, DATA_SOURCES[task](q)) for q in questions]


def make_rows(num: int, digits: int, task: str = "tandem/copy", seed: int = 0, alphabet: str = "01234") -> list[dict]:
    """verl RL dataset rows for `num` random strings of `digits` characters from `alphabet`."""
    return preprocess.rl_rows(make_qa(num, digits, task, seed, alphabet), task, "digits", "train")


def write_sft_and_rl(
    paths: dict[tuple[str, str], str],
    num: int = 2000,
    digits: int = 3,
    task: str = "tandem/copy",
    seed: int = 0,
    val_fraction: float = 0.2,
) -> dict:
    """The task as (question, answer) pairs through rollout.preprocess: SFT and RL files whose
    validation split holds out a fifth of the distinct questions (3 digits from 0-4: 125)."""
    return preprocess.write_splits(make_qa(num, digits, task, seed), paths, task, "digits", val_fraction, seed)


def build_tokenizer(vocab_size: int | None = None):
    """The task's character-level tokenizer. With `vocab_size`, ids past the task's characters
    decode as `<id>` (never produced by encoding: the pre-tokenizer splits every character):
    a model of a real shape's vocabulary (151,936) then writes text a reward can read."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = SPECIALS + CHARS
    names += [f"<{i}>" for i in range(len(names), vocab_size or 0)]
    vocab = {tok: i for i, tok in enumerate(names)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(
    vocab_size: int,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 128,
    eos_id: int = 1,
    pad_id: int = 0,
):
    """A random-init Qwen2 (tied embeddings, no bos); `intermediate` defaults to 4 x hidden."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    return Qwen2ForCausalLM(config)


def write_model(
    out_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2, *, tokenizer=None, **shape
) -> None:
    """An HF model folder (config, generation config, safetensors, tokenizer) with random
    initial weights: the built-in tokenizer unless one is given; `shape`: build_model's."""
    tok = tokenizer or build_tokenizer()
    model = build_model(len(tok), seed, hidden, layers, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, **shape)
    model.generation_config.top_k = None  # the sampler must not truncate what logprobs describe
    tmp = Path(f"{out_dir}.tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    respect_umask(str(tmp))  # safetensors writes 0600
    tmp.replace(out_dir)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m rollout.builtin_task",
        description="Write the built-in task as a verl-format parquet "
        "(and, with --model, the tiny initial model folder).",
    )
    p.add_argument("--out", required=True, help="parquet file to write")
    p.add_argument("--rows", type=int, default=2000, help="prompts (default 2000)")
    p.add_argument("--digits", type=int, default=3, help="digits per prompt (default 3)")
    p.add_argument("--task", default="tandem/copy", choices=sorted(DATA_SOURCES))
    p.add_argument("--alphabet", default="01234", help="digits the prompts are drawn from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--format",
        default="rl",
        choices=("rl", "qa"),
        help="rl: verl's RL format (default); qa: (question, answer) columns, the "
        "input of python -m rollout.preprocess",
    )
    p.add_argument("--model", help="also write the random-init tiny model + tokenizer here")
    args = p.parse_args(argv)
    if args.rows < 1 or args.digits < 1:
        p.error("--rows and --digits must be at least 1")
    if args.format == "qa":
        rows = [
            {"question": q, "answer": a}
            for q, a in make_qa(args.rows, args.digits, args.task, args.seed, args.alphabet)
        ]
    else:
        rows = make_rows(args.rows, args.digits, args.task, args.seed, args.alphabet)
    write_parquet(args.out, rows)
    print(f"wrote {args.rows} rows of {args.task} to {args.out}")
    if args.model:
        write_model(args.model, seed=args.seed)
        print(f"wrote the tiny model to {args.model}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
