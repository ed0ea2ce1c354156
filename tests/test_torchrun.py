"""torchrun as tandem's launchers start it (launch/torchrun.py): a restart meets in a fresh store."""

from __future__ import annotations

import subprocess
import sys

from conftest import subprocess_env

from launch import torchrun

# Attempt 0: both ranks form a gloo group, then rank 1 dies. Attempt 1 (torchrun's restart):
# rank 1 comes up 3 s late, so rank 0 looks up rank 1's address before rank 1 has written it;
# in a store shared across attempts it finds attempt 0's, a dead port.
RANKS = r"""
import datetime, os, time
import torch, torch.distributed as dist
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 1:
    time.sleep(3)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
dist.all_reduce(torch.ones(1))
if attempt == 0 and rank == 1:
    os._exit(1)  # as a native crash would end it, once the group is up
dist.barrier()
print(f"attempt {attempt} rank {rank}: group up", flush=True)
dist.destroy_process_group()
os._exit(0)
"""


def test_a_restarted_attempt_forms_its_group_with_the_launchers_environment(tmp_path):
    """With launch/torchrun.py's environment both ranks of the restarted attempt form their group
    (about 10 s). Without it (torchrun's default, a store shared across attempts) rank 0 is
    refused by rank 1's old address: "Gloo connectFullMesh failed ... Connection refused", every
    time on this box."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
        + [str(script)],
        env={**subprocess_env(), **torchrun.ENV, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    # the two ranks share one pipe: their lines may run together, so each is looked for as text
    assert "attempt 1 rank 0: group up" in out and "attempt 1 rank 1: group up" in out, out[-3000:]
