"""A reward function for tests/test_reward_learning.py: the score of the tiny reward model in
$TANDEM_TEST_RM_DIR (trainer/rm_train.py's folder) for (question, response). It never reads the
ground truth: the rule reward is measured beside it, not trained on."""

import functools
import os


@functools.cache
def _model():
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = os.environ["TANDEM_TEST_RM_DIR"]
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    return model, AutoTokenizer.from_pretrained(path)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    import torch

    from trainer.rm_train import scores

    model, tok = _model()
    with torch.no_grad():
        return float(scores(model, tok, [(extra_info["question"], solution_str)])[0])
