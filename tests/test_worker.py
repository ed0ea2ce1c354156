"""Rollout worker internals with the real tiny model: interruptible generation on new weights."""

import pytest
import torch

from buffer.weights.fs import WeightStore
from protocol.config import build
from protocol.experience import Sample
from rollout import builtin_task
from rollout.config import WorkerConfig
from rollout.engine import HFEngine
from rollout.worker import RolloutWorker
from trainer import algo
from trainer.batch import collate


def _logprobs(model, prompt, response, temperature):
    s = Sample(
        "s", "g", "p", "w", 0, prompt, response, [0.0] * len(response), 0.0, "length", temperature, "x", 0.0, 0.0
    )
    with torch.no_grad():
        return algo.response_logprobs(model, collate([s]))[0][0].tolist()


def test_interruptible_generation_resumes_on_new_weights(tmp_path):
    builtin_task.write_model(tmp_path / "m0", seed=0)
    builtin_task.write_model(tmp_path / "m1", seed=1)
    builtin_task.write_parquet(tmp_path / "t.parquet", builtin_task.make_rows(20, 3))
    m0, m1 = HFEngine(str(tmp_path / "m0")).model, HFEngine(str(tmp_path / "m1")).model
    root = tmp_path / "run"
    store = WeightStore(str(root))
    store.publish_hf_folder(tmp_path / "m0", 0, 0, keep=5)
    cfg = build(
        WorkerConfig,
        {
            "root": str(root),
            "train_files": f"[{tmp_path / 't.parquet'}]",
            "worker.id": "w",
            "max_response_length": "6",
            "actor_rollout_ref.rollout.n": "3",
            "prompts_per_batch": "4",
            "interruptible": "true",
            "segment_tokens": "2",
            "actor_rollout_ref.rollout.temperature": "0.9",
        },
    )
    worker = RolloutWorker(cfg)
    worker.start()
    assert worker.version == 0
    store.publish_hf_folder(tmp_path / "m1", 1, 1, keep=5)  # appears while the batch is in flight
    batch = worker.generate_batch()
    assert worker.version == 1 and worker.versions_loaded == [0, 1]
    long = [(p, c) for p, g in zip(batch.prompts, batch.groups) for c in g if len(c.token_ids) > 2]
    assert long, "no response outlived the first segment; the test proves nothing"
    assert worker.resumed_on_new_weights >= len(long)
    assert all(v == 0 for vs in batch.versions for v in vs)  # tagged with the oldest version
    for prompt, c in long:
        # The first segment was sampled by v0, the rest by v1: each token's logprob is its own.
        # Cached decoding vs a full forward of the same fp32 weights: rounding of |logprob| <= ~3
        # (measured <= 4.8e-7); the other version's differ by >= 0.03 here, so 1e-4 tells them apart.
        lp0 = _logprobs(m0, prompt.token_ids, c.token_ids, 0.9)
        lp1 = _logprobs(m1, prompt.token_ids, c.token_ids, 0.9)
        assert c.logprobs[:2] == pytest.approx(lp0[:2], abs=1e-4)
        assert c.logprobs[2:] == pytest.approx(lp1[2:], abs=1e-4)
    # Scoring and publishing the batch keeps the per-sample versions.
    assert worker.finish_batch(batch) >= 0.0
    worker.writer.flush()
    assert worker.writer.samples_written == 12
