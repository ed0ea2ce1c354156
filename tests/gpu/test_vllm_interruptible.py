"""Interruptible generation on vLLM: a batch in flight moves to newly published weights between
segments, and every token keeps the logprob of the policy that sampled it.

The worker starts its engine in vLLM's default multiprocess mode with CUDA graphs, as in
production; the trainer's logprobs are computed on the CPU (see conftest.py).
Run on the device machine: python -m pytest -m gpu tests/gpu -rA
"""

import pytest
import torch
from vllm_helpers import mean_abs, needs_gpus

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

SEGMENT = 3


def test_interruptible_generation_resumes_on_new_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from buffer.weights.fs import WeightStore
    from protocol.config import build
    from protocol.experience import Sample
    from rollout import builtin_task
    from rollout.config import WorkerConfig
    from rollout.worker import RolloutWorker
    from trainer import algo
    from trainer.batch import collate

    # hidden 256 / 4 heads: head_dim 64, which every vLLM attention backend supports.
    for seed in (0, 1):
        builtin_task.write_model(tmp_path / f"m{seed}", seed=seed, hidden=256)
    builtin_task.write_parquet(tmp_path / "t.parquet", builtin_task.make_rows(32, 3))
    models = [AutoModelForCausalLM.from_pretrained(tmp_path / f"m{s}", dtype=torch.float32) for s in (0, 1)]
    store = WeightStore(str(tmp_path / "run"))
    store.publish_hf_folder(tmp_path / "m0", 0, 0, keep=5)
    cfg = build(
        WorkerConfig,
        {
            "root": str(tmp_path / "run"),
            "worker.id": "w",
            "train_files": f"[{tmp_path / 't.parquet'}]",
            "actor_rollout_ref.rollout.name": "vllm",
            "dtype": "float32",
            "gpu_memory_utilization": "0.3",
            "max_response_length": "9",
            "actor_rollout_ref.rollout.n": "4",
            "prompts_per_batch": "16",
            "interruptible": "true",
            "segment_tokens": str(SEGMENT),
            "actor_rollout_ref.rollout.temperature": "0.9",
        },
    )
    worker = RolloutWorker(cfg)
    worker.start()
    try:
        store.publish_hf_folder(tmp_path / "m1", 1, 1, keep=5)  # appears while the batch runs
        batch = worker.generate_batch()
        assert worker.version == 1 and worker.versions_loaded == [0, 1]
        assert all(v == 0 for vs in batch.versions for v in vs)  # tagged with the oldest version
        long = [(p, c) for p, g in zip(batch.prompts, batch.groups) for c in g if len(c.token_ids) > SEGMENT]
        assert len(long) >= 8, "too few responses outlived the first segment to test anything"
        assert worker.resumed_on_new_weights >= len(long)
        samples = [
            Sample(
                f"s{i}",
                f"g{i}",
                "p",
                "w",
                0,
                p.token_ids,
                c.token_ids,
                c.logprobs,
                0.0,
                c.finish_reason,
                0.9,
                "x",
                0.0,
                0.0,
            )
            for i, (p, c) in enumerate(long)
        ]
        b = collate(samples)
        with torch.no_grad():
            lp = [algo.response_logprobs(m, b)[0] for m in models]
        first = torch.zeros_like(b.response_mask)
        first[:, :SEGMENT] = 1
        head, rest = b.response_mask * first, b.response_mask * (1 - first)
        d = {
            (v, part): mean_abs(lp[v], b.behaviour_logprobs, m)
            for v in (0, 1)
            for part, m in (("head", head), ("rest", rest))
        }
        print("mean |trainer - vLLM| logprob per token:", {f"v{v} {p}": f"{x:.1e}" for (v, p), x in d.items()})
        assert d[0, "head"] < 1e-2 < d[1, "head"]  # the first segment was sampled by v0
        assert d[1, "rest"] < 1e-2 < d[0, "rest"]  # the rest by v1, after the in-place reload
        assert worker.finish_batch(batch) >= 0.0
        worker.writer.flush()
        assert worker.writer.samples_written == 64
    finally:
        worker.engine.close()
