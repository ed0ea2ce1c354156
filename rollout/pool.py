"""Elastic rollout pool: a supervisor that starts and drains workers as the control file says.

    python -m rollout.pool root=RUN pool.id=node1 pool.initial_workers=1 pool.gpus=[0,1] \\
        data.train_files=[train.parquet] actor_rollout_ref.rollout.name=vllm

Keys under `pool.` configure the supervisor; every other key is passed to each worker (and
validated as a worker config before anything starts). `add N` raises the target, `remove N`
lowers it; the newest workers are drained (SIGTERM: finish the batch, flush, exit 0). Applied
command ids and the target are saved before they take effect, so a command is applied once
even across supervisor restarts. One worker per GPU when `pool.gpus` is set.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from buffer.layout import RunLayout
from buffer.storage import atomic_write_json, filesystem, is_local, read_json
from protocol import control
from protocol.config import F, ConfigError, build, split_argv, usage
from rollout.config import WorkerConfig

log = logging.getLogger("rollout.pool")


@dataclasses.dataclass
class PoolSection:
    id: str = F("pool", "supervisor id, unique per node (names its workers <id>-w<k>)")
    initial_workers: int = F(1, "workers started when the supervisor first starts", ge=0)
    max_workers: int = F(64, "upper bound on the target, whatever the commands say", ge=1)
    gpus: list[int] = F(doc="GPU indices to bind workers to, one each (empty: no GPUs)", factory=list)
    poll_interval: float = F(1.0, "seconds between reads of the control file", gt=0)
    drain_timeout_s: float = F(300.0, "seconds a draining worker may take before SIGKILL", gt=0)
    max_restarts: int = F(3, "restarts of crashed workers before the supervisor gives up", ge=0)


@dataclasses.dataclass
class PoolConfig:
    root: str = F(doc="run folder")
    pool: PoolSection = F(factory=PoolSection)


def _die_with_parent() -> None:
    """In the child: get SIGTERM (drain) if the supervisor dies, instead of running orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclasses.dataclass
class Member:
    worker_id: str
    gpu: int | None
    proc: subprocess.Popen
    draining_since: float | None = None


class Pool:
    def __init__(self, cfg: PoolConfig, worker_args: list[str]):
        self.cfg = cfg.pool
        self.root = cfg.root
        self.fs, root_path = filesystem(cfg.root)
        self.layout = RunLayout(root_path)
        self.worker_args = worker_args
        self.members: list[Member] = []
        self.restarts = 0
        self.stopping = False
        self._wake = threading.Event()
        self._observer = None
        self.state = read_json(self.fs, self.layout.pool_state(self.cfg.id)) or {
            "applied": [], "target": self.cfg.initial_workers, "next_index": 0}

    # --- commands ----------------------------------------------------------------------------
    def read_commands(self) -> list[control.Command]:
        try:
            text = self.fs.cat_file(self.layout.control).decode()
        except FileNotFoundError:
            return []
        try:
            return control.parse(text, where=self.layout.control)
        except control.ControlError as e:
            if self.state.get("last_error") != str(e):  # say it once, not every poll
                log.error("ignoring the control file: %s", e)
                self.state["last_error"] = str(e)
            return []

    def apply_new_commands(self) -> None:
        applied = set(self.state["applied"])
        for cmd in self.read_commands():
            if cmd.id in applied:
                continue
            delta = cmd.count if cmd.action == "add" else -cmd.count
            limit = min(self.cfg.max_workers, len(self.cfg.gpus) or self.cfg.max_workers)
            target = max(0, min(limit, self.state["target"] + delta))
            log.info("command %s: %s %d -> target %d workers", cmd.id, cmd.action, cmd.count, target)
            self.state["target"] = target
            self.state["applied"].append(cmd.id)
            applied.add(cmd.id)
            self.save()  # persisted before it takes effect: applied exactly once

    def save(self) -> None:
        self.state["workers"] = [{"worker_id": m.worker_id, "pid": m.proc.pid, "gpu": m.gpu,
                                  "state": "draining" if m.draining_since else "running"}
                                 for m in self.members]
        self.state["updated"] = time.time()
        atomic_write_json(self.fs, self.layout.pool_state(self.cfg.id), self.state)

    # --- workers -----------------------------------------------------------------------------
    def _free_gpu(self) -> int | None:
        used = {m.gpu for m in self.members}
        return next((g for g in self.cfg.gpus if g not in used), None)

    def start_worker(self) -> None:
        index = self.state["next_index"]
        self.state["next_index"] = index + 1
        worker_id = f"{self.cfg.id}-w{index}"
        gpu = self._free_gpu()
        env = dict(os.environ)
        if self.cfg.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        cmd = [sys.executable, "-m", "rollout.worker", f"root={self.root}", f"worker.id={worker_id}",
               *self.worker_args]
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
        self.members.append(Member(worker_id, gpu, proc))
        log.info("started %s (pid %d%s)", worker_id, proc.pid, f", GPU {gpu}" if gpu is not None else "")

    def drain(self, member: Member) -> None:
        if member.draining_since is None and member.proc.poll() is None:
            member.proc.send_signal(signal.SIGTERM)
            member.draining_since = time.monotonic()
            log.info("draining %s (pid %d)", member.worker_id, member.proc.pid)

    def reap(self) -> None:
        for m in list(self.members):
            code = m.proc.poll()
            if code is None:
                if m.draining_since and time.monotonic() - m.draining_since > self.cfg.drain_timeout_s:
                    log.error("%s did not drain in %.0f s; killing it", m.worker_id, self.cfg.drain_timeout_s)
                    m.proc.kill()
                continue
            self.members.remove(m)
            if m.draining_since is not None or code == 0:
                log.info("%s exited with code %d", m.worker_id, code)
            else:
                self.restarts += 1
                log.error("%s crashed with code %d (restart %d of %d)", m.worker_id, code,
                          self.restarts, self.cfg.max_restarts)
                if self.restarts > self.cfg.max_restarts:
                    raise RuntimeError(f"rollout workers crashed {self.restarts} times; see their logs")

    def reconcile(self) -> None:
        self.reap()
        live = [m for m in self.members if m.draining_since is None]
        for _ in range(self.state["target"] - len(live)):
            if self.cfg.gpus and self._free_gpu() is None:
                break  # a draining worker still holds its GPU; retry next round
            self.start_worker()
        for m in live[self.state["target"]:][::-1]:
            self.drain(m)
        self.save()

    # --- lifecycle ---------------------------------------------------------------------------
    def _watch(self) -> None:
        """Filesystem events wake the loop early on this node; polling covers other nodes."""
        if not is_local(self.fs):
            return
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer
        wake = self._wake

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event):
                wake.set()
        self._observer = Observer()
        self._observer.schedule(Handler(), self.layout.root, recursive=False)
        self._observer.daemon = True
        self._observer.start()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.fs.makedirs(self.layout.root, exist_ok=True)
        self._watch()
        try:
            while not self.stopping and not self.fs.exists(self.layout.done_marker):
                self.apply_new_commands()
                self.reconcile()
                self._wake.wait(self.cfg.poll_interval)
                self._wake.clear()
        finally:
            self.shutdown()

    def _on_signal(self, signum, _frame) -> None:
        log.info("%s received: draining all workers", signal.Signals(signum).name)
        self.stopping = True
        self._wake.set()

    def shutdown(self) -> None:
        for m in self.members:
            self.drain(m)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        for m in self.members:
            try:
                m.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("%s did not drain in time; killing it", m.worker_id)
                m.proc.kill()
                m.proc.wait(timeout=30)
        self.members = []
        self.save()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)


def parse(argv: list[str]) -> tuple[PoolConfig, list[str]]:
    """Split `pool.*` (and root) from the worker's keys; validate both before starting."""
    overrides, yaml_file, wants_help = split_argv(argv)
    if wants_help:
        print(usage(PoolConfig, "python -m rollout.pool", __doc__.split("\n\n")[0]))
        print("\nEvery other key is a worker key: see python -m rollout.worker --help")
        raise SystemExit(0)
    if yaml_file:
        raise ConfigError("--config: give the worker's YAML to the workers with worker keys instead")
    mine = {k: v for k, v in overrides.items() if k == "root" or k.startswith("pool.")}
    theirs = {k: v for k, v in overrides.items() if k not in mine}
    cfg = build(PoolConfig, mine)
    build(WorkerConfig, {**theirs, "root": cfg.root})  # fail now, not in every worker
    if "worker.id" in theirs or "id" in theirs:
        raise ConfigError("worker.id: set by the pool (<pool.id>-w<k>); set pool.id instead")
    return cfg, [f"{k}={v}" for k, v in theirs.items()]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s pool[%(process)d] %(message)s")
    try:
        cfg, worker_args = parse(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"python -m rollout.pool: config error: {e}", file=sys.stderr)
        return 2
    Pool(cfg, worker_args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
