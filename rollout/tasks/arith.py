"""A GSM8K-format task that ships with tandem: multi-step arithmetic word problems.

    python -m rollout.tasks.arith --local_save_dir data [--model model --size gpu]

Each problem starts from a small integer and applies 1, 2 or 3 operations (the tier) of +, -,
* or /, every intermediate value a whole number; the worked solution is GSM8K's, one sentence per
operation with a calculator annotation, then the answer:

    Mia has 7 shells. She finds 5 more shells. Then she gives away 3 of them. How many shells
    does Mia have now?
    ->  Mia finds 5 more, so she has 7+5=<<7+5=12>>12 shells.
        She gives away 3, so she has 12-3=<<12-3=9>>9 shells.
        #### 9

Written as verl's `examples/data_preprocess/gsm8k.py` writes GSM8K: RL rows with data_source
`openai/gsm8k` (so verl's own rule reward, `verl.utils.reward_score.gsm8k`, scores them: 1 for
the right number after '#### ', else 0), the question followed by verl's instruction, ability
`math`, the number as `reward_model.ground_truth`; plus SFT rows (prompt, response). The files
are rollout.preprocess's four (`{sft,rl}_{train,val}.parquet`); the validation split holds out
whole questions.

The tokenizer is a byte-level BPE trained here on the generated text (digits split one per
token, as Qwen2's pre-tokenizer does) with a Qwen2-style chat template (<|im_start|>role ...
<|im_end|>, eos <|im_end|>, pad <|endoftext|>); the model is a random-init Qwen2 of a named size
(MODEL_SIZES), built by rollout.builtin_task.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from rollout import builtin_task, preprocess

DATA_SOURCE = "openai/gsm8k"  # verl's default_compute_score picks its GSM8K rule reward for it
ABILITY = "math"
# verl's examples/data_preprocess/gsm8k.py appends this to every question
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'
TIERS = (1, 2, 3)
MAX_VALUE = 999  # every number in a problem stays below this
# Tokens, with the template and the instruction: a tier-3 prompt is ~70, its solution ~75.
MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH = 160, 128

# Model shapes (rollout.builtin_task.build_model): tiny for CPU tests (< 1M parameters with the
# ~550-token vocabulary), gpu for the H200 experiment (benchmarks/learn_gpu.py; ~27M).
MODEL_SIZES = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=256, max_positions=512),
    "gpu": dict(hidden=512, layers=8, heads=8, kv_heads=8, intermediate=1536, max_positions=512),
}

NAMES = [
    ("Mia", "she"),
    ("Liam", "he"),
    ("Ava", "she"),
    ("Noah", "he"),
    ("Emma", "she"),
    ("Lucas", "he"),
    ("Zoe", "she"),
    ("Omar", "he"),
    ("Nina", "she"),
    ("Ravi", "he"),
    ("Sara", "she"),
    ("Tom", "he"),
    ("Lena", "she"),
    ("Ben", "he"),
    ("Ivy", "she"),
    ("Jack", "he"),
    ("Maya", "she"),
    ("Leo", "he"),
    ("Rosa", "she"),
    ("Sam", "he"),
]
ITEMS = [
    "apples",
    "shells",
    "marbles",
    "stickers",
    "pencils",
    "cookies",
    "coins",
    "books",
    "cards",
    "stamps",
    "beads",
    "eggs",
    "flowers",
    "toy cars",
    "crayons",
    "buttons",
]
# (question clause, solution clause) per operation; {p} is the pronoun, {b} the operand
PHRASES = {
    "+": [
        ("{P} finds {b} more {item}.", "{P} finds {b} more"),
        ("Then {p} buys {b} more {item}.", "{P} buys {b} more"),
        ("A friend gives {o} {b} {item}.", "{P} gets {b} more"),
    ],
    "-": [
        ("Then {p} gives away {b} of them.", "{P} gives away {b}"),
        ("{P} loses {b} {item}.", "{P} loses {b}"),
        ("Then {p} uses {b} of the {item}.", "{P} uses {b}"),
    ],
    "*": [
        ("Then {p} trades them for {b} times as many {item}.", "{P} trades for {b} times as many"),
        ("Then {p} ends up with {b} times as many {item}.", "{P} ends up with {b} times as many"),
    ],
    "/": [
        ("{P} shares them equally among {b} friends, and keeps only one share.", "{P} keeps one of {b} equal shares"),
        ("Then {p} splits the {item} into {b} equal bags and keeps one bag.", "{P} keeps one of {b} equal bags"),
    ],
}


def _operation(rng: random.Random, value: int) -> tuple[str, int]:
    """A random operation that keeps `value` (2..MAX_VALUE) a whole number in (0, MAX_VALUE):
    + is possible below MAX_VALUE - 20 and - above 2, so one always is."""
    ops = ["+", "-", "*", "/"]
    rng.shuffle(ops)
    for op in ops:
        if op == "+" and value < MAX_VALUE - 20:
            return op, rng.randint(2, 20)
        if op == "-" and value > 2:
            return op, rng.randint(1, min(value - 1, 20))
        if op == "*" and value * 2 < MAX_VALUE:
            return op, rng.randint(2, min(9, (MAX_VALUE - 1) // value))
        if op == "/":
            divisors = [d for d in range(2, 10) if value % d == 0]
            if divisors:
                return op, rng.choice(divisors)
    raise AssertionError(f"no operation for {value}")


def _apply(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]


def make_problem(rng: random.Random, tier: int) -> tuple[str, str]:
    """(question, worked solution ending in '#### N') with `tier` operations."""
    (name, pronoun), item = rng.choice(NAMES), rng.choice(ITEMS)
    subs = {"p": pronoun, "P": pronoun.capitalize(), "o": {"she": "her", "he": "him"}[pronoun], "item": item}
    value = rng.randint(2, 30)
    question = [f"{name} has {value} {item}."]
    solution = []
    for _ in range(tier):
        op, b = _operation(rng, value)
        asked, told = rng.choice(PHRASES[op])
        result = _apply(value, op, b)
        question.append(asked.format(b=b, **subs))
        solution.append(
            f"{told.format(b=b, **subs)}, so {pronoun} has {value}{op}{b}=<<{value}{op}{b}={result}>>{result} {item}."
        )
        value = result
    question.append(f"How many {item} does {name} have now?")
    solution.append(f"#### {value}")
    return " ".join(question), "\n".join(solution)


def make_qa(num: int, seed: int = 0, tiers: tuple[int, ...] = TIERS) -> list[tuple[str, str]]:
    """`num` (question, solution) pairs, tiers in equal shares (round-robin), seeded."""
    if not tiers or any(t < 1 for t in tiers):
        raise ValueError(f"tiers {tiers!r}: each tier is a number of operations >= 1")
    rng = random.Random(seed)
    return [make_problem(rng, tiers[i % len(tiers)]) for i in range(num)]


def write_task(
    paths: dict[tuple[str, str], str], num: int = 20000, seed: int = 0, val_fraction: float = 0.05
) -> dict[str, int]:
    """The four parquets of rollout.preprocess (`paths[(kind, split)]`) in verl's GSM8K shape."""
    return preprocess.write_splits(
        make_qa(num, seed), paths, DATA_SOURCE, ABILITY, val_fraction, seed, INSTRUCTION, ground_truth_after="####"
    )


# --- tokenizer and model ----------------------------------------------------------------------
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2's pre-tokenizer pattern: words, single digits, punctuation runs, whitespace
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE trained on `texts` (it stops early when no pair is left to merge: the
    task's small vocabulary of words gives ~550 tokens), as a transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=IM_END, additional_special_tokens=[IM_START]
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_model(
    out_dir: str | Path, size: str = "tiny", seed: int = 0, corpus: int = 5000, vocab_size: int = 4096
) -> None:
    """An HF folder (config.json, generation_config.json, model.safetensors, tokenizer) loadable
    by transformers and vLLM: the tokenizer trained on `corpus` generated problems (with the
    chat template and instruction around them), the model random-init of MODEL_SIZES[size]."""
    if size not in MODEL_SIZES:
        raise ValueError(f"size {size!r}: choose one of {sorted(MODEL_SIZES)}")
    texts = [
        f"{IM_START}user\n{q}{INSTRUCTION}{IM_END}\n{IM_START}assistant\n{a}{IM_END}\n"
        for q, a in make_qa(corpus, seed=seed + 1)
    ]  # the task's distribution, other draws
    tok = train_tokenizer(texts, vocab_size)
    builtin_task.write_model(out_dir, seed=seed, tokenizer=tok, **MODEL_SIZES[size])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rollout.tasks.arith", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--local_save_dir",
        "--local_dir",
        required=True,
        help="folder for {sft,rl}_{train,val}.parquet (verl's flag names)",
    )
    p.add_argument("--rows", type=int, default=20000, help="problems generated (default 20000)")
    p.add_argument(
        "--val_fraction", type=float, default=0.05, help="fraction of distinct questions held out (default 0.05)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="also write the tokenizer and a random-init model here")
    p.add_argument("--size", default="tiny", choices=sorted(MODEL_SIZES), help="model shape")
    args = p.parse_args(argv)
    if args.rows < 2 or not 0 < args.val_fraction < 1:
        p.error("--rows must be at least 2 and --val_fraction in (0, 1)")
    paths = {
        (k, s): str(Path(args.local_save_dir) / f"{k}_{s}.parquet") for k in preprocess.KINDS for s in preprocess.SPLITS
    }
    counts = write_task(paths, args.rows, args.seed, args.val_fraction)
    print(f"wrote {counts['train']} train and {counts['val']} validation problems to {args.local_save_dir}")
    if args.model:
        write_model(args.model, args.size, args.seed)
        print(f"wrote the {args.size} model and its tokenizer to {args.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
