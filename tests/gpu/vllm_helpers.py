"""What the GPU tests share: the trainer's logprobs of sampled responses, computed on the CPU."""
import torch


def trainer_logprobs(model, prompts, groups, temperature):
    """The trainer's logprobs (CPU, float32) of every sampled response, and the batch."""
    from protocol.experience import Sample
    from trainer import algo
    from trainer.batch import collate
    samples = [Sample(f"{i}/{k}", str(i), "p", "w", 0, prompts[i], c.token_ids, c.logprobs, 0.0,
                      c.finish_reason, temperature, "x", 0.0, 0.0)
               for i, g in enumerate(groups) for k, c in enumerate(g)]
    batch = collate(samples)
    with torch.no_grad():
        lp, _ = algo.response_logprobs(model.float(), batch)
    return lp, batch


def mean_abs(lp, behaviour, mask) -> float:
    return (((lp - behaviour).abs() * mask).sum() / mask.sum()).item()


PROMPTS = [[3 + (i * 7 + j) % 10 for j in range(3 + i % 4)] + [13] for i in range(16)]
