"""What the GPU tests share.

They run the vLLM engine as production does: vLLM's default multiprocess mode, its engine
processes started fresh. The pytest process never touches CUDA (the trainer-side logprobs that
the tests compare against are computed on the CPU in float32), so vLLM may start its processes
either way and no test depends on the order the files run in.
"""

import pytest
import torch


def needs_gpus(count: int):
    # device_count() is NVML-based: it does not initialise CUDA in this process.
    found = torch.cuda.device_count()
    return pytest.mark.skipif(found < count, reason=f"needs {count} CUDA GPU(s), found {found}")


def trainer_logprobs(model, prompts, groups, temperature):
    """The trainer's logprobs (CPU, float32) of every sampled response, and the batch."""
    from protocol.experience import Sample
    from trainer import algo
    from trainer.batch import collate

    samples = [
        Sample(
            f"{i}/{k}",
            str(i),
            "p",
            "w",
            0,
            prompts[i],
            c.token_ids,
            c.logprobs,
            0.0,
            c.finish_reason,
            temperature,
            "x",
            0.0,
            0.0,
        )
        for i, g in enumerate(groups)
        for k, c in enumerate(g)
    ]
    batch = collate(samples)
    with torch.no_grad():
        lp, _ = algo.response_logprobs(model.float(), batch)
    return lp, batch


def mean_abs(lp, behaviour, mask) -> float:
    return (((lp - behaviour).abs() * mask).sum() / mask.sum()).item()


PROMPTS = [[3 + (i * 7 + j) % 10 for j in range(3 + i % 4)] + [13] for i in range(16)]
