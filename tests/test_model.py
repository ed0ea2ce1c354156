"""trainer/model.py: what build_actor hands the trainer."""

import socket

import pytest
import torch
import torch.distributed as dist

from rollout import builtin_task
from trainer.model import build_actor, decoder_layers


@pytest.fixture
def one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("ckpt,every", [(False, 1), (True, 1), (True, 2)])
def test_gradient_checkpointing_recomputes_each_layer_in_backward(tmp_path, one_rank, ckpt, every):
    """enable_gradient_checkpointing=true must recompute every decoder layer's forward during
    backward (one more forward call per layer); before the fix the model stayed in eval mode and
    transformers skipped checkpointing silently. With trainer.checkpoint_every=2 only every other
    layer recomputes (layer 0 of the two). The reference model is frozen and in eval mode."""
    builtin_task.write_model(tmp_path / "m", seed=0)
    model = build_actor(str(tmp_path / "m"), torch.device("cpu"), gradient_checkpointing=ckpt, checkpoint_every=every)
    calls = {"n": 0}
    for layer in decoder_layers(model):  # forward hooks do not fire in the recompute: count calls

        def counted(*args, _forward=layer.forward, **kwargs):
            calls["n"] += 1
            return _forward(*args, **kwargs)

        layer.forward = counted
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    logits = model(input_ids=ids).logits
    forward_calls = calls["n"]
    logits.float().pow(2).mean().backward()
    layers = len(decoder_layers(model))
    assert forward_calls == layers
    assert calls["n"] - forward_calls == (-(-layers // every) if ckpt else 0)
    ref = build_actor(str(tmp_path / "m"), torch.device("cpu"), trainable=False)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())


def test_compile_layers_compiles_each_decoder_layer_before_sharding(tmp_path, one_rank):
    """trainer.compile_layers=true reaches build_actor for the actor, the reference and the critic:
    each decoder layer is compiled in place (lazily: nothing runs here, so no compile is paid on
    CPU; tests/gpu/test_compiled_layers_cuda.py checks the compiled maths on CUDA), the rest not.
    trainer.checkpoint_every reaches the actor and the critic. On CPU the optimizer stays
    torch's default (fused only on CUDA, trainer.model.adamw)."""
    from protocol.config import build
    from trainer.config import TrainerConfig
    from trainer.main import Trainer

    builtin_task.write_model(tmp_path / "m", seed=0)
    for flag in (True, False):
        model = build_actor(str(tmp_path / "m"), torch.device("cpu"), compile_layers=flag)
        assert [layer._compiled_call_impl is not None for layer in decoder_layers(model)] == [flag] * 2
        assert model._compiled_call_impl is None  # the head and the embeddings stay eager
    cfg = build(
        TrainerConfig,
        {
            "root": str(tmp_path / "run"),
            "actor_rollout_ref.model.path": str(tmp_path / "m"),
            "trainer.compile_layers": "true",
            "actor_rollout_ref.actor.use_kl_loss": "true",
            "algorithm.adv_estimator": "gae",
            "actor_rollout_ref.model.enable_gradient_checkpointing": "true",
            "critic.model.enable_gradient_checkpointing": "true",
            "trainer.checkpoint_every": "2",
        },
    )
    trainer = Trainer(cfg, torch.device("cpu"))
    try:
        for m in (trainer.model, trainer.ref_model, trainer.critic.model):
            assert all(layer._compiled_call_impl is not None for layer in decoder_layers(m)), m
        for m in (trainer.model, trainer.critic.model):  # trainer.checkpoint_every reaches both
            assert [layer.gradient_checkpointing for layer in decoder_layers(m)] == [True, False], m
        assert not trainer.optimizer.defaults.get("fused")
    finally:
        trainer.close()


def test_compiled_graphs_counts_each_compile_and_the_step_line_names_them():
    """trainer.model.compiled_graphs reads dynamo's own counter: one graph for the first call,
    none for another length (dynamic shapes), one more on a recompile (here a new dtype fails a
    guard). The trainer's console line names a step's compiled graphs (a recompile after step 1)."""
    from trainer.metrics import rl_line
    from trainer.model import compiled_graphs

    f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=True)  # eager: no codegen, ~1 s
    start = compiled_graphs()
    f(torch.ones(3))
    f(torch.ones(7))
    assert compiled_graphs() == start + 1
    f(torch.ones(3, dtype=torch.float64))
    assert compiled_graphs() == start + 2
    m = {"step": 5, "total": 9, "weights/version": 4, "reward/mean": 0.5, "staleness/mean": 0.0, "samples/step": 8,
         "tokens/step": 100, "time/step_s": 16.4, "time/wait_s": 0.0}  # fmt: skip
    assert "compiled" not in rl_line(m) and "compiled" not in rl_line(m | {"perf/compiled_graphs": 0})
    assert rl_line(m | {"perf/compiled_graphs": 2}).endswith("| compiled 2 graphs")


def test_one_rank_reduces_gradients_once_per_optimizer_step(tmp_path, one_rank):
    """With one rank, update.optimize accumulates a mini-batch's passes unsharded and has FSDP
    reduce once, at its last pass (trainer.update.gradient_sync: per pass the reduce only
    copies). Seen from the loss function: no sharded gradient exists before any pass of a
    mini-batch, where reducing every pass leaves the first pass's. The gradient each optimizer
    step sees equals one backward of the summed loss: float32 on CPU sums in another order, and
    1e-5 of a tensor's largest gradient leaves room for that (~1e-7 relative) and none for a pass
    lost or counted twice."""
    from trainer import update

    builtin_task.write_model(tmp_path / "m", seed=0)
    ids = torch.randint(0, 14, (3, 7), generator=torch.Generator().manual_seed(0))  # vocabulary 14

    def run(passes: list) -> tuple[list, list]:
        model = build_actor(str(tmp_path / "m"), torch.device("cpu"))
        seen, grads = [], []

        def loss_fn(rows, mb):
            seen.append(all(p.grad is None for p in model.parameters()))
            logits = model(input_ids=ids[rows]).logits.float()
            return logits.pow(2).mean(-1).sum(), [float(len(rows))]

        class Recording(torch.optim.SGD):  # the real SGD step, its gradients kept
            def step(self, closure=None):
                grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
                return super().step(closure)

        mbs = [update.MiniBatch(passes, 21, 3), update.MiniBatch(passes, 21, 3)]
        totals, _ = update.optimize(model, Recording(model.parameters(), lr=0.1), mbs, 0.1, 1e9, loss_fn)
        assert totals.tolist() == [6.0]
        return grads, seen

    split, seen = run([torch.tensor([0]), torch.tensor([1]), torch.tensor([2])])
    assert seen == [True] * 6, seen  # reducing every pass: [True, False, False] twice
    whole, _ = run([torch.tensor([0, 1, 2])])
    assert len(split) == len(whole) == 2
    for a, b in zip(split, whole):
        for k in a:
            scale = b[k].abs().max().item()
            assert scale > 0 and (a[k] - b[k]).abs().max().item() <= 1e-5 * scale, k
