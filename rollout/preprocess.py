"""Turn a parquet of (question, answer) rows into SFT and RL parquet files, in the shape of verl's
examples/data_preprocess scripts.

    python -m rollout.preprocess --input qa.parquet --out-dir data --data-source openai/gsm8k \\
        --ground-truth-after '####'

Writes, in --out-dir:
  sft_train.parquet, sft_val.parquet   columns prompt, response (trainer.sft's default
                                       data.prompt_key / data.response_key), extra_info
  rl_train.parquet, rl_val.parquet     verl's RL format: data_source, prompt [{role: user,
                                       content}], ability, reward_model {style: rule,
                                       ground_truth}, extra_info {split, index,
                                       question, answer} (as verl's gsm8k.py)
The validation split holds out whole questions: none of its questions appears in a train file,
so a score on it measures what was learned, not what was memorised. Every file is written to a
temporary name and renamed.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path

KINDS = ("sft", "rl")
SPLITS = ("train", "val")


class PreprocessError(ValueError):
    pass


def read_pairs(path: str, question_key: str = "question", answer_key: str = "answer") -> list[tuple[str, str]]:
    """(question, answer) strings from a parquet; errors name the file, column and row."""
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # a missing or non-parquet file: pyarrow raises several types
        raise PreprocessError(f"--input {path}: not a readable parquet file: {e}") from None
    if not rows:
        raise PreprocessError(f"--input {path}: no rows (an empty file)")
    for key in (question_key, answer_key):
        if key not in rows[0]:
            raise PreprocessError(f"{path}: no column {key!r}; the file has columns {sorted(rows[0])}")
    pairs = []
    for i, row in enumerate(rows):
        q, a = row[question_key], row[answer_key]
        for key, value in ((question_key, q), (answer_key, a)):
            if not isinstance(value, str) or not value:
                raise PreprocessError(f"{path} row {i}: column {key!r} must be a non-empty string, got {value!r}")
        pairs.append((q, a))
    return pairs


def split_pairs(
    pairs: list[tuple[str, str]], val_fraction: float, seed: int = 0
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Hold out `val_fraction` of the distinct questions (seeded), with all their rows."""
    questions = sorted({q for q, _ in pairs})
    random.Random(seed).shuffle(questions)
    n_val = round(len(questions) * val_fraction)
    if val_fraction > 0 and not 0 < n_val < len(questions):
        raise PreprocessError(
            f"--val-fraction {val_fraction}: {len(questions)} distinct questions "
            "cannot be split into a non-empty train and validation set"
        )
    held = set(questions[:n_val])
    return [p for p in pairs if p[0] not in held], [p for p in pairs if p[0] in held]


def gsm8k_solution(answer: str) -> str:
    """verl's examples/data_preprocess/gsm8k.py extract_solution: the number after '#### ',
    commas removed."""
    found = re.search("#### (\\-?[0-9\\.\\,]+)", answer)
    if found is None:
        raise PreprocessError(f"answer {answer[:60]!r}: no '#### <number>' (GSM8K's final answer)")
    return found.group(0).split("#### ")[1].replace(",", "")


# What verl's examples/data_preprocess/<name>.py writes for a data source: its ability, the
# instruction appended to each question (after a space), and how the ground truth is cut out.
PRESETS = {
    "openai/gsm8k": {
        "ability": "math",
        "ground_truth": gsm8k_solution,
        "instruction": ' Let\'s think step by step and output the final answer after "####".',
    },
}


def ground_truth(answer: str, after) -> str:
    """The part of the answer the reward checks: all of it, what follows the last `after`
    marker (e.g. GSM8K's '#### 42'), or what the function `after` cuts out."""
    if after is None:
        return answer
    if callable(after):
        return after(answer)
    if after not in answer:
        raise PreprocessError(f"answer {answer[:60]!r}: no {after!r} marker (--ground-truth-after)")
    return answer.rsplit(after, 1)[1].strip()


def sft_rows(pairs: list[tuple[str, str]], split: str, instruction: str = "") -> list[dict]:
    return [
        {"prompt": q + instruction, "response": a, "extra_info": {"split": split, "index": i}}
        for i, (q, a) in enumerate(pairs)
    ]


def rl_rows(
    pairs: list[tuple[str, str]],
    data_source: str,
    ability: str,
    split: str,
    instruction: str = "",
    ground_truth_after: str | None = None,
) -> list[dict]:
    return [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": q + instruction}],
            "ability": ability,
            "reward_model": {"style": "rule", "ground_truth": ground_truth(a, ground_truth_after)},
            "extra_info": {"split": split, "index": i, "question": q, "answer": a},
        }
        for i, (q, a) in enumerate(pairs)
    ]


def write_parquet(path: str | Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)


def write_splits(
    pairs: list[tuple[str, str]],
    paths: dict[tuple[str, str], str],
    data_source: str,
    ability: str = "",
    val_fraction: float = 0.1,
    seed: int = 0,
    instruction: str = "",
    ground_truth_after: str | None = None,
) -> dict[str, int]:
    """Write the four files; `paths[(kind, split)]` for kind in KINDS, split in SPLITS.
    Returns the rows per split."""
    splits = dict(zip(SPLITS, split_pairs(pairs, val_fraction, seed)))
    for split, part in splits.items():
        write_parquet(paths[("sft", split)], sft_rows(part, split, instruction))
        write_parquet(paths[("rl", split)], rl_rows(part, data_source, ability, split, instruction, ground_truth_after))
    return {split: len(part) for split, part in splits.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rollout.preprocess", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--input", required=True, help="parquet of (question, answer) rows")
    p.add_argument("--out-dir", required=True, help="folder for the four parquet files")
    p.add_argument(
        "--data-source",
        required=True,
        help="data_source of the RL rows: picks the reward (verl's default_compute_score "
        "names, tandem/copy, or your custom_reward_function)",
    )
    p.add_argument(
        "--ability",
        help="ability column of the RL rows (default: verl's for the "
        "data source, e.g. math for openai/gsm8k, else empty)",
    )
    p.add_argument("--question-key", default="question")
    p.add_argument("--answer-key", default="answer")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="fraction of distinct questions held out for validation (default 0.1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--instruction",
        help="text appended to every question in both formats (default: verl's for the "
        "data source: for openai/gsm8k \" Let's think step by step and output the "
        'final answer after "####".", else none)',
    )
    p.add_argument(
        "--ground-truth-after",
        help="RL ground truth: the answer's text after the last such marker (default: "
        "verl's for the data source: for openai/gsm8k the number after '####' "
        "without commas; else the whole answer)",
    )
    args = p.parse_args(argv)
    if not 0 <= args.val_fraction < 1:
        p.error("--val-fraction must be in [0, 1)")
    paths = {(k, s): str(Path(args.out_dir) / f"{k}_{s}.parquet") for k in KINDS for s in SPLITS}
    preset: dict = PRESETS.get(args.data_source, {})
    ability = preset.get("ability", "") if args.ability is None else args.ability
    instruction = preset.get("instruction", "") if args.instruction is None else args.instruction
    after = preset.get("ground_truth") if args.ground_truth_after is None else args.ground_truth_after
    try:
        counts = write_splits(
            read_pairs(args.input, args.question_key, args.answer_key),
            paths,
            args.data_source,
            ability,
            args.val_fraction,
            args.seed,
            instruction,
            after,
        )
    except PreprocessError as e:
        print(f"rollout.preprocess: {e}", file=sys.stderr)
        return 2
    print(f"wrote {counts['train']} train and {counts['val']} validation rows as {', '.join(sorted(paths.values()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
