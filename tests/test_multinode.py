"""Two "nodes" on one machine: two torchrun agents meeting by c10d rendezvous, the command shape
launch/slurm/trainer.sbatch runs on each node. Global rank and local rank differ on the second
agent (RANK=1, LOCAL_RANK=0), which a single-node run never shows."""

import torch

from conftest import STEPS, final_weights, free_port, run_folder, trainer_proc, uninterrupted_run


def test_two_nodes_by_rendezvous_train_like_two_ranks_on_one(experience):
    ref = uninterrupted_run(experience, "one_node_two_ranks")
    run = run_folder(experience, "two_nodes")
    rendezvous = ("--nnodes=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
                  "--rdzv_id=tandem-test")
    agents = [trainer_proc(run, experience / "model", 1, rendezvous=rendezvous) for _ in range(2)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    for a, out in zip(agents, outs):
        assert a.returncode == 0, out[-3000:]
    # rank 0 alone writes metrics: one line per step, not one per node
    assert len((run / "metrics.jsonl").read_text().splitlines()) == STEPS
    a, b = final_weights(ref), final_weights(run)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k
