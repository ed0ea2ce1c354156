"""Reward-model server: scores the workers' finished groups with a sequence classifier (issue 28).

    python -m rollout.reward_server --run ROOT --model DIR [--id ID] [--device cpu|cuda] \\
        [--host HOST] [--port PORT] [--config FILE.yaml] [--set key=value ...]

One process per GPU (or CPU, for tests). It loads `--model` (rollout/reward_model.py), listens on
gRPC with the run's token and TLS (buffer/reward/net_server.py) and announces its address and the
model's checksum in the run folder (ROOT/reward/<id>.json), refreshed every server.beat_s; the
workers find it there (or by reward_model.addresses). `--set` takes any key of the schema below
(reward_model.*, buffer.* for the token and TLS, server.*), as does a verl config file. SIGTERM or
SIGINT: withdraw the endpoint, finish the queued groups (server.drain_s), exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time

from buffer.channel import token
from buffer.reward.net_server import RewardService, serve
from buffer.run import setup_reward_server_run
from protocol.config import ConfigError, build
from protocol.reward import RewardEndpoint, model_checksum
from rollout.config import RewardServerConfig
from rollout.reward_model import RewardScorer, Row

log = logging.getLogger("rollout.reward_server")
STATS_S = 30.0


def parse_args(argv: list[str] | None) -> RewardServerConfig:
    p = argparse.ArgumentParser(
        prog="python -m rollout.reward_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--run", required=True, help="the run folder (root)")
    p.add_argument("--model", help="reward model folder (reward_model.model.path)")
    p.add_argument("--id", help="server id (server.id)")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (server.device)")
    p.add_argument("--host", help="address workers reach it at (server.host)")
    p.add_argument("--port", help="port (server.port; 0: a free one)")
    p.add_argument("--config", help="a YAML config (verl's shape)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any key of the schema")
    args = p.parse_args(argv)
    over: dict[str, str] = {"root": args.run}
    for flag, key in (("model", "reward_model.model.path"), ("id", "server.id"), ("device", "server.device")):
        if getattr(args, flag) is not None:
            over[key] = getattr(args, flag)
    for flag in ("host", "port"):
        if getattr(args, flag) is not None:
            over[f"server.{flag}"] = getattr(args, flag)
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            p.error(f"--set {item!r}: expected KEY=VALUE")
        over[key] = value
    try:
        return build(RewardServerConfig, over, args.config)
    except ConfigError as e:
        p.exit(2, f"{p.prog}: config error: {e}\n")


def argv(root: str, settings: list[str]) -> list[str]:
    """This command's flags for a launcher (SLURM job, pool member) that holds the settings as
    `key=value` words and at most one `--config FILE`: `--run ROOT [--config FILE] --set k=v ...`."""
    flags, i = ["--run", root], 0
    while i < len(settings):
        if settings[i] == "--config":
            flags += settings[i : i + 2]
            i += 2
            continue
        flags += ["--set", settings[i]]
        i += 1
    return flags


def device_of(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class RewardServerProcess:
    def __init__(self, cfg: RewardServerConfig, stop: threading.Event):
        self.cfg = cfg
        sc, rm = cfg.server, cfg.reward_model
        self.id = sc.id or f"reward-{socket.gethostname()}-{os.getpid()}"
        self.stop = stop  # set by SIGTERM/SIGINT, also while the model loads
        self.announcer = setup_reward_server_run(cfg)
        secret = token(cfg.buffer)  # before the model loads: a missing token fails at once
        self.device = device_of(sc.device)
        path = str(rm.model.path)
        t0 = time.monotonic()
        self.checksum = model_checksum(path)
        self.scorer = RewardScorer(path, self.device, rm.max_length, rm.rows(), rm.tokens())
        log.info(
            "reward model %s (checksum %s) on %s in %.1f s",
            path,
            self.checksum[:16],
            self.device,
            time.monotonic() - t0,
        )
        self.service = RewardService(
            self.scorer,
            Row,
            self.checksum,
            self.id,
            secret,
            threads=sc.threads,
            max_queued=sc.max_queued,
            gather_tokens=4 * rm.tokens(),
            info={"model": path, "max_length": self.scorer.max_length, "device": self.device},
        )
        self.host = sc.host or socket.gethostbyname(socket.gethostname())
        self.server, self.port = serve(self.service, cfg.buffer, self.host, sc.port)
        self.endpoint = RewardEndpoint(
            server_id=self.id,
            address=f"{self.host}:{self.port}",
            scorer=self.checksum,
            pid=os.getpid(),
            host=socket.gethostname(),
            started_at=time.time(),
            last_beat=time.time(),
            beat_s=sc.beat_s,
        )

    def _announce(self) -> None:
        self.endpoint.last_beat = time.time()
        try:
            self.announcer.announce(self.endpoint)
        except (OSError, RuntimeError) as e:  # a full disk, the trainer's service refusing or away: next beat
            log.warning("cannot announce at %s: %s", self.announcer.where(), e)

    def run(self) -> None:
        log.info(
            "reward server %s serving on %s, announced in %s", self.id, self.endpoint.address, self.announcer.where()
        )
        last_stats = time.monotonic()
        while not self.stop.is_set():
            self._announce()
            if time.monotonic() - last_stats >= STATS_S:
                log.info("reward server %s: %s", self.id, dict(self.service.stats))
                last_stats = time.monotonic()
            self.stop.wait(self.cfg.server.beat_s)
        self.shutdown()

    def shutdown(self) -> None:
        try:
            self.announcer.withdraw(self.id)  # workers stop picking it; calls under way finish
        except (OSError, RuntimeError) as e:  # its endpoint goes stale instead (DEAD_AFTER_BEATS)
            log.warning("cannot withdraw from %s: %s", self.announcer.where(), e)
        drained = self.service.drain(self.cfg.server.drain_s)
        if not drained:
            log.warning("reward server %s: groups still queued after server.drain_s; their workers retry", self.id)
        self.server.stop(2.0).wait(timeout=10)
        self.service.close()
        log.info("reward server %s stopped: %s", self.id, dict(self.service.stats))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s reward[%(process)d] %(message)s"
    )
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        log.info("%s received: withdrawing, then finishing the queued groups", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        process = RewardServerProcess(cfg, stop)
    except (OSError, ValueError) as e:  # the model folder, the token, the port
        print(f"python -m rollout.reward_server: {e}", file=sys.stderr)
        return 2
    process.run()  # a signal during the load: it never announces, and stops at once
    return 0


if __name__ == "__main__":
    sys.exit(main())
