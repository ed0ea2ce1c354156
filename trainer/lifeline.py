"""Trainer ranks die with their torchrun agent.

torchrun starts each rank in a session of its own, so a kill of the job's process group (kill -9,
a batch system ending the job step) reaches only the agent; the ranks, reparented to init, would
go on training and publishing beside the trainer a user restarts. A parent-death signal
(Linux prctl PR_SET_PDEATHSIG) ends a rank the moment its agent dies. SIGKILL: nothing is lost
that a restart needs, since checkpoints and weight versions are committed by a rename.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


def die_with_agent() -> None:
    """Under torchrun: get SIGKILL when the agent (this process's parent) dies."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # started directly: the parent is a shell, whose exit must not end the run
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        log.warning("no libc.so.6: this rank will not die with its torchrun agent")
        return
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        log.warning(
            "prctl(PR_SET_PDEATHSIG) failed (errno %d): this rank will not die with its torchrun agent",
            ctypes.get_errno(),
        )
        return
    if parent == 1 or os.getppid() != parent:  # the agent died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
