"""vLLM engine on a GPU: logprobs agree with the trainer's, weights reload in place.

Run on the device machine: python -m pytest -m gpu tests/gpu -rA
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _model(path, seed):
    # hidden 256 / 4 heads: head_dim 64, which every vLLM attention backend supports.
    from rollout import builtin_task
    tok = builtin_task.build_tokenizer()
    model = builtin_task.build_model(len(tok), seed=seed, hidden=256, layers=2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from buffer.weights import WeightStore
    from rollout.config import RolloutSamplingConfig
    from rollout.vllm_engine import VLLMEngine
    base = tmp_path_factory.mktemp("vllm")
    old = _model(base / "v0", seed=0)  # built on the CPU before CUDA is touched (NOTES pitfall)
    new = _model(base / "v1src", seed=1)
    store = WeightStore(str(base / "run"))
    store.publish_hf_folder(base / "v1src", 1, 1, keep=2)
    cfg = RolloutSamplingConfig(name="vllm", dtype="float32", gpu_memory_utilization=0.3)
    engine = VLLMEngine(str(base / "v0"), cfg)
    yield engine, store, old, new
    engine.close()


def _trainer_logprobs(model, prompts, groups, temperature):
    from protocol.experience import Sample
    from trainer import algo
    from trainer.batch import collate
    samples = [Sample(f"{i}/{k}", str(i), "p", "w", 0, prompts[i], c.token_ids, c.logprobs, 0.0,
                      c.finish_reason, temperature, "x", 0.0, 0.0)
               for i, g in enumerate(groups) for k, c in enumerate(g)]
    batch = collate(samples).to("cuda")
    with torch.no_grad():
        lp, _ = algo.response_logprobs(model.to("cuda").float(), batch)
    return lp, batch


def _generate(engine, prompts, temperature=0.8):
    from rollout.engine import SamplingSettings
    return engine.generate(prompts, SamplingSettings(n=4, temperature=temperature, top_p=1.0,
                                                     max_tokens=8, seed=1))


PROMPTS = [[3 + (i * 7 + j) % 10 for j in range(3 + i % 4)] + [13] for i in range(16)]


def test_vllm_logprobs_match_the_trainer(setup):
    engine, _, old, _ = setup
    groups = _generate(engine, PROMPTS)
    assert len(groups) == 16 and all(len(g) == 4 for g in groups)
    assert all(len(c.token_ids) == len(c.logprobs) >= 1 for g in groups for c in g)
    lp, batch = _trainer_logprobs(old, PROMPTS, groups, 0.8)
    diff = ((lp - batch.behaviour_logprobs).abs() * batch.response_mask).sum() / batch.response_mask.sum()
    print(f"mean |trainer - vLLM| logprob per token: {diff.item():.2e}")
    assert diff.item() < 1e-2


def test_in_place_reload_switches_to_the_published_weights(setup):
    engine, store, old, new = setup
    loaded = engine.load_weights(store.tensors(1))
    assert loaded == len(store.manifest(1).tensors)
    groups = _generate(engine, PROMPTS)
    lp_new, batch = _trainer_logprobs(new, PROMPTS, groups, 0.8)
    lp_old, _ = _trainer_logprobs(old, PROMPTS, groups, 0.8)
    mask = batch.response_mask
    d_new = ((lp_new - batch.behaviour_logprobs).abs() * mask).sum() / mask.sum()
    d_old = ((lp_old - batch.behaviour_logprobs).abs() * mask).sum() / mask.sum()
    print(f"after reload: |new - vLLM| {d_new.item():.2e}, |old - vLLM| {d_old.item():.2e}")
    assert d_new.item() < 1e-2 < d_old.item()
