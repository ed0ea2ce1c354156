"""What every torchrun that tandem starts (launch.local, the SLURM trainer job, the Ray driver)
has in its environment.

torchrun (torch >= 2.5) lends its rendezvous store to the ranks by default, and the keys a
restarted attempt's ranks write there (gloo's and NCCL's peer addresses) meet the dead attempt's
under the same names: a restarted rank that reads its peer's key before the peer has rewritten
it connects to a dead port and fails, or waits out the group's timeout
(pytorch/pytorch#135712; here, launch.local's restart test hung 15 minutes under load, and
tests/test_torchrun.py fails at once without this). With the store not shared, rank 0 of each
attempt serves a fresh one, as torchrun did before 2.5.
"""

from __future__ import annotations

ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
