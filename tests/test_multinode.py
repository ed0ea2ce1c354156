"""Two "nodes" on one machine: two torchrun agents meeting by c10d rendezvous, the command shape
launch/slurm/trainer.sbatch runs on each node. Global rank and local rank differ on the second
agent (RANK=1, LOCAL_RANK=0), which a single-node run never shows."""

from conftest import (
    CRITIC,
    REORDER_REL_BOUND,
    STEPS,
    final_weights,
    free_port,
    ids_by_step,
    run_folder,
    trainer_proc,
    weight_distances,
)


def test_two_nodes_by_rendezvous_train_like_two_ranks_on_one(experience, critic_reference):
    ref = critic_reference  # the resume test's reference run: 2 ranks on one node, with a critic
    run = run_folder(experience, "two_nodes")
    rendezvous = (
        "--nnodes=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        "--rdzv_id=tandem-test",
    )
    agents = [
        trainer_proc(run, experience / "model", 1, "trainer.log_sample_ids=true", *CRITIC, rendezvous=rendezvous)
        for _ in range(2)
    ]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    for a, out in zip(agents, outs):
        assert a.returncode == 0, out[-3000:]
    # rank 0 alone writes metrics: one line per step, not one per node
    assert len((run / "metrics.jsonl").read_text().splitlines()) == STEPS
    assert ids_by_step(run) == ids_by_step(ref)  # the same samples at every step
    # Same 2 ranks and the same split: the runs agree to the bit where this was written; the
    # bound is the one for a changed order of fp32 sums, should gloo over TCP sum differently.
    differ, moved, worst = weight_distances(final_weights(ref), final_weights(run), experience / "model")
    assert moved > 1e-2 and differ < REORDER_REL_BOUND * moved, (differ, moved, worst)
