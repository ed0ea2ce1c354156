"""The entrypoint of a tandem Ray job (rendered by launch.ray_jobs): starts the role's processes on
the node or nodes Ray gives the job, and takes every one of them down with the job.

    python -m launch.ray_driver trainer --nodes 4 --gpus-per-node 8 --cpus-per-node 32 \\
        --nproc-per-node 8 --rdzv-id ID --port auto --placement-strategy STRICT_SPREAD \\
        -- root=/shared/run actor_rollout_ref.model.path=/shared/models/base

One node: the role's processes are this entrypoint's children, on the node and with the GPUs Ray
reserved for the entrypoint (entrypoint resources; Ray sets CUDA_VISIBLE_DEVICES). Several nodes
(trainer, sft): a placement group of one bundle per node ({CPU, GPU}; STRICT_SPREAD puts each on
its own node) and one NodeAgent actor per bundle, each running torchrun for its node; node 0's
agent gives its IP and a free port, the c10d rendezvous of all of them.

Stopping (`ray job stop`): Ray sends SIGTERM to this process (and to its children); it is
forwarded to every process of the role on every node, and this process waits for them; Ray's
SIGKILL comes RAY_JOB_STOP_WAIT_TIME_S later (launch.submit's --stop-timeout).
Every child also gets SIGTERM if its parent dies first (prctl PR_SET_PDEATHSIG), so none is left
running when this process or an agent is killed.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from launch import torchrun

log = logging.getLogger("launch.ray_driver")
MODULES = {
    "rollout": "rollout.worker",
    "reward": "rollout.reward_server",
    "validate": "rollout.validate",
    "trainer": "trainer.main",
    "sft": "trainer.sft",
}


@dataclasses.dataclass
class Proc:
    argv: list[str]
    gpu: int | None = None  # rollout: this worker's GPU, an index into the node's visible ones

    def env(self, visible: str) -> dict[str, str]:
        """Its environment's changes, given the CUDA_VISIBLE_DEVICES Ray set for this process."""
        if self.gpu is None:
            return {}
        gpus = [g for g in visible.split(",") if g]
        return {"CUDA_VISIBLE_DEVICES": gpus[self.gpu] if self.gpu < len(gpus) else str(self.gpu)}


def parse_args(argv):
    """The plan (this module's options), and the role's key=value arguments after `--`."""
    p = argparse.ArgumentParser(
        prog="python -m launch.ray_driver", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("role", choices=sorted(MODULES))
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--cpus-per-node", type=int, default=1)
    p.add_argument("--tasks-per-node", type=int, default=1, help="rollout/reward: workers (servers) per node")
    p.add_argument("--worker-prefix", default="w", help="rollout/reward: worker (server) ids <prefix>[-t<k>]")
    p.add_argument("--nproc-per-node", type=int, default=1, help="trainer/sft: ranks per node")
    p.add_argument(
        "--max-restarts", type=int, default=2, help="trainer/sft: torchrun's restarts of every rank after one dies"
    )
    p.add_argument("--rdzv-id", default="tandem", help="trainer/sft: torchrun's rendezvous id")
    p.add_argument("--port", default="auto", help="several nodes: rendezvous port on node 0")
    p.add_argument("--placement-strategy", default="STRICT_SPREAD")
    p.add_argument(
        "--placement-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the cluster to have every node's bundle free",
    )
    cut = argv.index("--") if "--" in argv else len(argv)
    plan = p.parse_args(argv[:cut])
    plan.args = argv[cut + 1 :]  # the role's own key=value arguments, after --
    return plan


def node_procs(plan, node_rank: int, rendezvous: str | None) -> list[Proc]:
    """The processes of one node of the role. `rendezvous` HOST:PORT: node 0's (several nodes)."""
    py, module = sys.executable, MODULES[plan.role]
    if plan.role in ("trainer", "sft"):
        meet = (
            ["--standalone"]
            if plan.nodes == 1
            else [
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={rendezvous}",
                f"--rdzv_id={plan.rdzv_id}",
                f"--rdzv_conf=is_host={int(node_rank == 0)}",
            ]
        )  # node 0 serves the store, whatever its name
        return [
            Proc(
                [
                    py,
                    "-m",
                    "torch.distributed.run",
                    f"--nnodes={plan.nodes}",
                    f"--nproc_per_node={plan.nproc_per_node}",
                    f"--max-restarts={plan.max_restarts}",
                    *meet,
                    "-m",
                    module,
                    *plan.args,
                ]
            )
        ]
    if plan.role == "validate":
        return [Proc([py, "-m", module, *plan.args])]
    total = plan.nodes * plan.tasks_per_node
    procs = []
    for k in range(plan.tasks_per_node):
        index = node_rank * plan.tasks_per_node + k
        worker_id = plan.worker_prefix + (f"-t{index}" if total > 1 else "")
        gpu = k if plan.gpus_per_node else None
        if plan.role == "reward":  # rollout.reward_server's flags: --run ROOT --set k=v ...
            from rollout import reward_server

            root = next(a.split("=", 1)[1] for a in plan.args if a.startswith("root="))
            settings = [a for a in plan.args if not a.startswith("root=")]
            argv = [*reward_server.argv(root, settings), "--set", f"server.id={worker_id}"]
            procs.append(Proc([py, "-m", module, *argv], gpu=gpu))
        else:
            procs.append(Proc([py, "-m", module, *plan.args, f"worker.id={worker_id}"], gpu=gpu))
    return procs


def _die_with_parent() -> None:
    try:  # PR_SET_PDEATHSIG: SIGTERM (a worker flushes) when the starting thread's process dies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


class Group:
    """The role's processes on this node: started together, signalled together, waited for."""

    def __init__(self, procs: list[Proc]):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.procs = []
        for p in procs:
            env = {**os.environ, **torchrun.ENV, **p.env(visible)}  # torchrun.ENV: read by torchrun only
            self.procs.append(subprocess.Popen(p.argv, env=env, preexec_fn=_die_with_parent))
            log.info("started pid %d: %s", self.procs[-1].pid, " ".join(p.argv))

    def terminate(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def wait(self, stopping) -> list[int]:
        """Every process's exit code; `stopping()` true: SIGTERM them (once) and keep waiting."""
        signalled = False
        while None in self.codes():
            if stopping() and not signalled:
                self.terminate()
                signalled = True
            time.sleep(0.2)
        return self.codes()


class NodeAgent:
    """A Ray actor on one bundle of the placement group: runs the role's processes of its node."""

    def __init__(self):
        self.group: Group | None = None
        self.stopped = False

    def endpoint(self, port: str) -> tuple[str, int]:
        import ray

        if port == "auto":  # a free port now; torchrun binds it moments later
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), int(port)

    def run(self, procs: list[Proc]) -> list[int]:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        if self.stopped:
            return []
        self.group = Group(procs)
        return self.group.wait(lambda: self.stopped)

    def terminate(self) -> None:
        self.stopped = True  # run() forwards it (it is the processes' parent thread)


def exit_code(codes: list[int], stopping: bool) -> int:
    if stopping:
        return 0  # Ray records the job STOPPED; the processes have ended (or are killed by Ray)
    return next((c for c in codes if c), 0)


def run_here(plan, stopping) -> int:
    codes = Group(node_procs(plan, 0, None)).wait(stopping)
    log.info("%s processes exited with %s", plan.role, codes)
    return exit_code(codes, stopping())


def run_nodes(plan, stopping) -> int:
    """Several nodes: one bundle and one NodeAgent each; node 0's address is the rendezvous."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from launch import ray_driver as me  # by name, not __main__: the actors import it themselves

    ray.init()  # the job's cluster: RAY_ADDRESS, set by Ray's job supervisor
    bundle = {"CPU": plan.cpus_per_node, **({"GPU": plan.gpus_per_node} if plan.gpus_per_node else {})}
    pg = placement_group([bundle] * plan.nodes, strategy=plan.placement_strategy)
    log.info(
        "waiting up to %.0f s for %d bundles %s (%s)",
        plan.placement_timeout,
        plan.nodes,
        bundle,
        plan.placement_strategy,
    )
    if not pg.wait(timeout_seconds=plan.placement_timeout):
        log.error(
            "the cluster did not give %d x %s (%s) in %.0f s: `ray status` shows what is "
            "free; STRICT_SPREAD needs that many distinct nodes",
            plan.nodes,
            bundle,
            plan.placement_strategy,
            plan.placement_timeout,
        )
        return 1
    agent = ray.remote(me.NodeAgent)
    agents = [
        agent.options(
            num_cpus=plan.cpus_per_node,
            num_gpus=plan.gpus_per_node,
            max_concurrency=2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i),
        ).remote()
        for i in range(plan.nodes)
    ]
    try:
        host, port = ray.get(agents[0].endpoint.remote(plan.port), timeout=300)
    except ray.exceptions.RayError as e:  # GetTimeoutError too
        log.error("node 0's agent gave no rendezvous address in 300 s: %s", str(e).splitlines()[0])
        return 1
    log.info("%d nodes x %d ranks, rendezvous %s:%d", plan.nodes, plan.nproc_per_node, host, port)
    refs = [a.run.remote(me.node_procs(plan, i, f"{host}:{port}")) for i, a in enumerate(agents)]
    codes: dict[int, list[int]] = {}
    signalled = False
    while len(codes) < len(refs):
        done, _ = ray.wait([r for i, r in enumerate(refs) if i not in codes], timeout=0.5)
        for r in done:
            try:
                codes[refs.index(r)] = ray.get(r)
            except ray.exceptions.RayError as e:  # its actor or node died
                log.error("node %d: %s", refs.index(r), str(e).splitlines()[0])
                codes[refs.index(r)] = [-1]
        failed = any(c for cs in codes.values() for c in cs)
        if (stopping() or failed) and not signalled:  # a failed node: the others would hang
            log.info("%s: stopping every node", "SIGTERM" if stopping() else f"a node failed {codes}")
            ray.get([a.terminate.remote() for a in agents], timeout=60)
            signalled = True
    remove_placement_group(pg)
    log.info("%s nodes exited with %s", plan.role, [codes[i] for i in range(len(refs))])
    return exit_code([c for cs in codes.values() for c in cs], stopping())


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s ray_driver[%(process)d] %(message)s"
    )
    plan = parse_args(sys.argv[1:] if argv is None else argv)
    got: list[int] = []

    def on_signal(signum, _frame):
        if not got:
            log.info("%s received: stopping the %s", signal.Signals(signum).name, plan.role)
        got.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stopping = lambda: bool(got)  # noqa: E731
    return run_here(plan, stopping) if plan.nodes == 1 else run_nodes(plan, stopping)


if __name__ == "__main__":
    sys.exit(main())
