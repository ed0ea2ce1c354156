"""Two "nodes" on one machine: two torchrun agents meeting by c10d rendezvous, the command shape
launch/slurm/trainer.sbatch runs on each node. Global rank and local rank differ on the second
agent (RANK=1, LOCAL_RANK=0), which a single-node run never shows."""
import os
import socket
import subprocess
import sys

import torch

from conftest import STEPS, GROUPS, final_weights, run_folder, trainer_proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(root, model, port):
    """One node's torchrun: 1 rank here, 2 nodes in all, rendezvous at 127.0.0.1:port."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
         "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=tandem-test",
         "-m", "trainer.main", f"root={root}", f"actor_rollout_ref.model.path={model}",
         f"trainer.total_training_steps={STEPS}", f"data.train_batch_size={GROUPS}",
         "trainer.max_staleness=1000", "actor_rollout_ref.actor.optim.lr=1e-2",
         "trainer.data_timeout_s=60", "buffer.poll_interval=0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_two_nodes_by_rendezvous_train_like_two_ranks_on_one(experience):
    model = experience / "model"
    ref = run_folder(experience, "one_node_two_ranks")
    p = trainer_proc(ref, model, 2)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]

    run = run_folder(experience, "two_nodes")
    port = _free_port()
    agents = [_agent(run, model, port) for _ in range(2)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    for a, out in zip(agents, outs):
        assert a.returncode == 0, out[-3000:]
    # rank 0 alone writes metrics: one line per step, not one per node
    assert len((run / "metrics.jsonl").read_text().splitlines()) == STEPS
    a, b = final_weights(ref), final_weights(run)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k
