"""A reward model's scores of (prompt messages, response) rows: what a reward server runs (issue 28).

The model is an HF sequence classifier with one output (`AutoModelForSequenceClassification`,
num_labels=1: the score is read at each row's last real token). A row is re-tokenised with the
reward model's own tokenizer (or `input_tokenizer`, verl's reward_model.model.input_tokenizer),
never the policy's token ids: `reward_text` puts the prompt messages through that tokenizer's
chat template with the generation prompt, then the response as the policy said it (no chat
template: the contents and the response concatenated). Rows are truncated to `max_length` tokens
from the left (the classifier reads the last token: the response's end must stay), sorted by
length and scored in micro-batches of at most `micro_batch_rows` rows and `token_budget` padded
tokens, under torch.no_grad.

`build_tiny_reward_model(dir)` writes a random-init Qwen2 classifier with the built-in task's
tokenizer (tests; trainer/rm_train.py trains one).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from rollout import builtin_task

log = logging.getLogger(__name__)


def reward_text(tokenizer, messages: list[dict], response: str) -> str:
    """What the reward model reads for one row. verl's RM worker appends the response as an
    assistant turn (with the template's end-of-turn); here it follows the generation prompt as
    the policy said it, which is how trainer/rm_train.py trains (and the same text up to the
    end-of-turn token for templates whose assistant turn is generation prompt + content)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + response
    return "".join(str(m.get("content", "")) for m in messages) + response


def build_classifier(tokenizer, seed: int = 0, hidden: int = 64, layers: int = 2, max_positions: int = 128):
    """A random-init Qwen2 sequence classifier (one label) for `tokenizer`'s vocabulary; its
    pad id lets it find each row's last real token."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        num_labels=1,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForSequenceClassification(config)


def build_tiny_reward_model(folder: str | Path, seed: int = 0) -> str:
    """A random-init tiny reward model (HF folder) with the built-in task's tokenizer."""
    tok = builtin_task.build_tokenizer()
    model = build_classifier(tok, seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@dataclasses.dataclass
class Row:
    index: int
    ids: list[int]


def micro_batches(rows: list[Row], max_rows: int, token_budget: int) -> list[list[Row]]:
    """Rows sorted by length, cut into batches of at most `max_rows` rows whose padded size
    (rows x longest) stays within `token_budget`; a row longer than the budget goes alone."""
    out: list[list[Row]] = []
    batch: list[Row] = []
    for row in sorted(rows, key=lambda r: len(r.ids)):
        if batch and (len(batch) >= max_rows or (len(batch) + 1) * len(row.ids) > token_budget):
            out.append(batch)
            batch = []
        batch.append(row)
    if batch:
        out.append(batch)
    return out


class RewardScorer:
    """One loaded reward model: `score(messages, responses)` -> a float per response."""

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        max_length: int | None = None,
        micro_batch_rows: int = 64,
        token_budget: int = 16384,
        input_tokenizer: str | None = None,
    ):
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        self.device = device
        self.micro_batch_rows, self.token_budget = micro_batch_rows, token_budget
        self.tokenizer = AutoTokenizer.from_pretrained(input_tokenizer or model_path)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        config = AutoConfig.from_pretrained(model_path)
        if config.num_labels != 1:  # before the weights: a head of another size would not load
            raise ValueError(
                f"reward_model.model.path: {model_path} has {config.num_labels} labels; "
                "a reward model has one output (num_labels=1)"
            )
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path, config=config, dtype=dtype)
        # None: as many tokens as the model has positions
        self.max_length = max_length or int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.pad = self.model.config.pad_token_id
        if self.pad is None:
            self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            self.model.config.pad_token_id = self.pad  # how the classifier finds the last real token
        self.model.to(device).eval()

    def encode(self, messages: list[dict], response: str) -> list[int]:
        ids = self.tokenizer(reward_text(self.tokenizer, messages, response), add_special_tokens=False)["input_ids"]
        return ids[-self.max_length :]  # from the left: the score is read at the last token

    def score(self, messages: list[dict], responses: list[str]) -> list[float]:
        rows = [Row(i, self.encode(messages, r)) for i, r in enumerate(responses)]
        return self.score_rows(rows)

    def score_rows(self, rows: list[Row]) -> list[float]:
        """Scores of token rows, in the rows' `index` order (indices 0..len-1)."""
        import torch

        out = [0.0] * len(rows)
        with torch.no_grad():
            for batch in micro_batches(rows, self.micro_batch_rows, self.token_budget):
                width = max(len(r.ids) for r in batch)
                ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for k, r in enumerate(batch):  # right padding: the last real token is found by the pad id
                    ids[k, : len(r.ids)] = torch.tensor(r.ids, dtype=torch.long)
                    mask[k, : len(r.ids)] = 1
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
                for k, value in enumerate(logits[:, 0].float().cpu().tolist()):
                    out[batch[k].index] = value
        return out
