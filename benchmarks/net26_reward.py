"""net26's reward: a dense learning signal for a random-init model of a real vocabulary.

The built-in task scores a random-init 0.5B at 0 on every sample (its tokens almost never fall
among the task's 14 characters), so GRPO's advantages, the gradients and every delta are zero.
Here a response's score is the share of its tokens with an even id (`<id>` in the text of
`builtin_task.build_tokenizer(vocab_size)`): about 0.5 with a binomial spread (±0.06 at 64
tokens) inside every group, so every step moves the weights as a real task's would at the same
learning rate, and the model can learn it. Set as `custom_reward_function.path`.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"<(\d+)>")


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    ids = [int(m) for m in _TOKEN.findall(solution_str)]
    return sum(1 for i in ids if i % 2 == 0) / len(ids) if ids else 0.0
