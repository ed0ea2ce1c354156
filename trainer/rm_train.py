"""Train a tiny reward model on the built-in task, pairwise (Bradley-Terry), on a CPU in seconds.

    python -m trainer.rm_train --out runs/rm --steps 400

The model is a Qwen2 sequence classifier (one score per sequence, read at its last real token)
built from a small config with the built-in character tokenizer, so nothing is downloaded. Each
step draws prompts of the built-in task (rollout/builtin_task.py: copy `--digits` digits) and,
per prompt, two responses whose rule rewards differ (the right answer, answers with some
positions wrong, too short or too long, characters the policy may say that the task never asks
for); the loss is -log sigmoid(r_better - r_worse). A fifth of the task's distinct questions is
held out: the accuracy on their pairs (the better response scored higher) is the model's measure,
written with the folder's `rm_train.json`. The folder is an ordinary HF folder
(`AutoModelForSequenceClassification`), published whole (temporary name, then rename).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from buffer.storage import respect_umask
from rollout import builtin_task
from rollout.reward_model import build_classifier, reward_text  # what a reward server scores with

TASK = "tandem/copy"
ALPHABET = "01234"  # the built-in task's prompt digits
SAYABLE = "0123456789="  # what the tiny policy can emit besides eos: its responses hold these


@dataclass
class RMTrainConfig:
    out: str
    steps: int = 400
    batch_pairs: int = 64
    lr: float = 3e-3
    seed: int = 0
    digits: int = 3
    hidden: int = 64
    layers: int = 2
    heldout_fraction: float = 0.2
    eval_pairs: int = 2000


BOUNDS = {  # flag -> (type, low, high): what a few CPU minutes can train
    "steps": (int, 1, 100_000),
    "batch_pairs": (int, 1, 4096),
    "lr": (float, 1e-6, 1.0),
    "seed": (int, 0, 2**31 - 1),
    "digits": (int, 1, 16),
    "hidden": (int, 16, 1024),
    "layers": (int, 1, 24),
    "heldout_fraction": (float, 0.05, 0.5),
    "eval_pairs": (int, 10, 100_000),
}


def split_questions(digits: int, fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Every distinct question of `digits` digits of ALPHABET, shuffled: (train, held out)."""
    questions = ["".join(t) for t in itertools.product(ALPHABET, repeat=digits)]
    if len(questions) > 100_000:  # beyond that, draw instead of enumerating
        rng0 = random.Random(seed)
        questions = list({"".join(rng0.choice(ALPHABET) for _ in range(digits)) for _ in range(100_000)})
    random.Random(seed).shuffle(questions)
    cut = max(1, round(len(questions) * fraction))
    return questions[cut:], questions[:cut]


def candidate(answer: str, rng: random.Random) -> str:
    """One response to a question whose right answer is `answer`, of random quality: right,
    some positions changed, cut short, run long, or random characters the policy can say."""
    kind = rng.randrange(7)
    if kind == 0:
        return answer
    if kind >= 5:  # looks like an answer (right length, prompt digits), mostly of another question:
        # without these the model scored a string by itself and RL found one it liked for all
        return "".join(rng.choice(ALPHABET) for _ in answer) if kind == 5 else rng.choice(ALPHABET) * len(answer)
    if kind == 1:  # some positions wrong
        out = list(answer)
        for i in rng.sample(range(len(out)), rng.randint(1, len(out))):
            out[i] = rng.choice([c for c in SAYABLE if c != out[i]])
        return "".join(out)
    if kind == 2:  # cut short (eos early)
        return answer[: rng.randrange(len(answer))]
    if kind == 3:  # runs long
        return answer + "".join(rng.choice(SAYABLE) for _ in range(rng.randint(1, 2)))
    return "".join(rng.choice(SAYABLE) for _ in range(rng.randint(0, len(answer) + 1)))


def draw_pair(question: str, rng: random.Random) -> tuple[str, str]:
    """(better, worse): two responses to `question` whose rule rewards differ."""
    answer = builtin_task.DATA_SOURCES[TASK](question)
    while True:
        a, b = candidate(answer, rng), candidate(answer, rng)
        sa, sb = (builtin_task.compute_score(TASK, r, answer) for r in (a, b))
        if sa != sb:
            return (a, b) if sa > sb else (b, a)


def encode(tokenizer, question: str, responses: list[str]):
    """Right-padded token ids and attention mask of (question, response) rows."""
    messages = [{"role": "user", "content": question}]
    texts = [reward_text(tokenizer, messages, r) for r in responses]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def scores(model, tokenizer, rows: list[tuple[str, str]]):
    """The model's score of each (question, response) row, as one float tensor."""
    import torch

    ids, masks = [], []
    for q, r in rows:
        i, m = encode(tokenizer, q, [r])
        ids.append(i[0])
        masks.append(m[0])
    pad = tokenizer.pad_token_id
    width = max(len(i) for i in ids)
    input_ids = torch.stack([torch.cat([i, torch.full((width - len(i),), pad)]) for i in ids])
    mask = torch.stack([torch.cat([m, torch.zeros(width - len(m), dtype=m.dtype)]) for m in masks])
    return model(input_ids=input_ids, attention_mask=mask).logits[:, 0]


def pair_accuracy(model, tokenizer, questions: list[str], n: int, seed: int) -> float:
    """Fraction of `n` drawn (better, worse) pairs on `questions` that the model orders right."""
    import torch

    rng = random.Random(seed)
    right = 0
    model.eval()
    with torch.no_grad():
        for start in range(0, n, 256):
            pairs = [(q, *draw_pair(q, rng)) for q in (rng.choice(questions) for _ in range(min(256, n - start)))]
            s = scores(model, tokenizer, [(q, b) for q, b, _ in pairs] + [(q, w) for q, _, w in pairs])
            right += int((s[: len(pairs)] > s[len(pairs) :]).sum())
    model.train()
    return right / n


def train(cfg: RMTrainConfig, log=print) -> dict:
    """Train, measure on the held-out questions, publish the folder; the summary it wrote."""
    import torch
    import torch.nn.functional as F

    tok = builtin_task.build_tokenizer()
    model = build_classifier(tok, cfg.seed, cfg.hidden, cfg.layers)
    train_q, held_q = split_questions(cfg.digits, cfg.heldout_fraction, cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed + 1)
    start, losses = time.monotonic(), []
    for step in range(1, cfg.steps + 1):
        pairs = [(q, *draw_pair(q, rng)) for q in (rng.choice(train_q) for _ in range(cfg.batch_pairs))]
        s = scores(model, tok, [(q, b) for q, b, _ in pairs] + [(q, w) for q, _, w in pairs])
        loss = -F.logsigmoid(s[: len(pairs)] - s[len(pairs) :]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"rm_train: loss {losses[-1]} at step {step}; lower --lr")
        if step % 50 == 0 or step == cfg.steps:
            log(f"rm_train: step {step}/{cfg.steps} loss {sum(losses[-50:]) / len(losses[-50:]):.4f}")
    summary = {
        **asdict(cfg),
        "train_seconds": round(time.monotonic() - start, 2),
        "loss_first": losses[0],
        "loss_last": sum(losses[-20:]) / len(losses[-20:]),
        "heldout_questions": len(held_q),
        "heldout_pair_accuracy": pair_accuracy(model, tok, held_q, cfg.eval_pairs, cfg.seed + 2),
        "train_pair_accuracy": pair_accuracy(model, tok, train_q, cfg.eval_pairs, cfg.seed + 3),
    }
    publish(model, tok, cfg.out, summary)
    log(
        f"rm_train: held-out pair accuracy {summary['heldout_pair_accuracy']:.3f} "
        f"({len(held_q)} questions never trained on); wrote {cfg.out}"
    )
    return summary


def publish(model, tokenizer, out: str, summary: dict) -> None:
    """The HF folder at `out`, whole or not at all: written under a temporary name, renamed."""
    if os.path.exists(out):
        raise FileExistsError(f"rm_train: --out {out} exists; choose a new folder")
    tmp = Path(f"{out}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(tmp / "rm_train.json", "w") as f:
        json.dump(summary, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    respect_umask(str(tmp))  # safetensors writes 0600
    tmp.replace(out)


def _bounded(name: str):
    kind, low, high = BOUNDS[name]

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    return parse


HELP = {
    "steps": "optimizer steps",
    "batch_pairs": "(better, worse) pairs per step",
    "lr": "AdamW learning rate",
    "seed": "seed of the weights, the question split and the pairs",
    "digits": "digits per question of the copy task (3: the built-in task's)",
    "hidden": "hidden size of the classifier",
    "layers": "transformer layers of the classifier",
    "heldout_fraction": "fraction of the distinct questions held out for the accuracy",
    "eval_pairs": "pairs drawn for each accuracy",
}


def parse_args(argv) -> RMTrainConfig:
    p = argparse.ArgumentParser(
        prog="python -m trainer.rm_train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="HF folder to write (must not exist)")
    defaults = RMTrainConfig(out="")
    for name, (_, low, high) in BOUNDS.items():
        p.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=_bounded(name),
            default=getattr(defaults, name),
            help=f"{HELP[name]} (default {getattr(defaults, name)}; {low} to {high})",
        )
    return RMTrainConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        train(cfg)
    except (FileExistsError, FloatingPointError) as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
