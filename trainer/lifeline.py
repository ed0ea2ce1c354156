"""Trainer ranks die with their torchrun agent, say where a native crash happened, and leave
without the interpreter's teardown.

torchrun starts each rank in a session of its own, so a kill of the job's process group (kill -9,
a batch system ending the job step) reaches only the agent; the ranks, reparented to init, would
go on training and publishing beside the trainer a user restarts. A parent-death signal
(Linux prctl PR_SET_PDEATHSIG) ends a rank the moment its agent dies. SIGKILL: nothing is lost
that a restart needs, since checkpoints and weight versions are committed by a rename.

A rank whose work is done leaves by `leave` (os._exit after flushing), not through CPython's
finalization: torch's C++ threads (gloo's workers, FSDP's pending work) that still hold tensors
take the GIL there, CPython 3.11 ends such a thread with pthread_exit, and its forced unwind
through a noexcept C++ frame is std::terminate: "terminate called without an active exception",
SIGABRT, a failed job after every step and checkpoint was committed (CI, 2026-12-05: trainer.sft's
rank 1 after "SFT done"; pytorch/pytorch#179291 describes the same race).
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
from typing import NoReturn

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


def trace_native_crashes() -> None:
    """On SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL (a heap corruption in a native library, say)
    print every thread's Python stack to stderr, the rank's log, before the process dies."""
    if faulthandler.is_enabled():  # already on (python -X faulthandler, pytest): keep its file
        return
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError) as e:  # a stderr without a file descriptor
        log.warning("no Python stacks on a native crash: stderr has no file descriptor (%s)", e)


def leave(code: int) -> NoReturn:
    """End this rank with `code` once its work is committed and its process group destroyed:
    logs and streams flushed, then os._exit, skipping the interpreter's teardown (module
    docstring). Only for a rank's normal end: an exception still unwinds the usual way."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said
            pass
    os._exit(code)
