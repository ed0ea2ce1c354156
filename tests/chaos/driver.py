"""Chaos driver (issue 15): a real CPU run, with faults injected at seeded random moments.

    python tests/chaos/driver.py --root RUN --logs LOGS --report REPORT.json --seed 7 [--disk-full]

A 2-rank torchrun trainer (gRPC server on) and two rollout workers on the built-in task: w0
publishes to the shared folder, w1 pushes over gRPC from a folder of its own (LOGS/w1-root: its
claim, its outbox of unacknowledged shards, its weight cache, as launch.local --remote-workers
gives each). After every fault the driver waits for the
trainer to take a new step, waits a random fraction of the time the trainer's last step took
(at most 3 s), and injects the next one (their order is shuffled by the seed):

    worker          kill -9 of a worker, restarted at once under the same id
    trainer         kill -9 of the trainer's whole process group (torchrun and its ranks);
                    restarted, it resumes from its newest checkpoint (trainer.resume_mode=auto)
    both            a worker and the trainer's process group at the same moment
    grpc_side       kill -9 of rank 0 alone: the gRPC server dies mid-stream; torchrun ends the
                    other rank; restarted like `trainer`
    second_trainer  a second trainer started on the same run folder; it must be refused
    disk_full       the run folder's filesystem filled to the last byte (--disk-full: ROOT is on a
                    small filesystem of its own) until the trainer and a worker say so, then freed

At the end (DONE, every process exited 0) it audits every shard written (experience/, archive/,
quarantine/) against the trainer's final timeline (the last metrics line of each step, with its
`samples/ids`) and its last checkpoint (the ledger of consumed shards and the pool of groups read
but not trained): samples trained twice, samples consumed but never trained (lost), a shard number
written twice, and whether the mean reward of the last 10 steps beats the first 10. The report is
JSON; the exit code is 0 only if nothing was doubled or lost and every fault was survived. Lost
includes the acknowledged-never: a shard number below a worker's highest that is nowhere on the
trainer (a gRPC shard pushed, never acknowledged, never re-sent) unless its worker declared it
lost (an empty shard marked tandem.declared_lost, counted as shards_declared_lost).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from conftest import descendants, fill_disk, free_port  # noqa: E402

from buffer.layout import RunLayout  # noqa: E402
from buffer.ledger import Ledger  # noqa: E402
from launch.local import BUILTIN_TRAINER, BUILTIN_WORKER  # noqa: E402
from protocol.experience import DECLARED_LOST_KEY, decode, from_table  # noqa: E402
from rollout import builtin_task  # noqa: E402

FAULTS = {"worker": 12, "trainer": 3, "both": 2, "grpc_side": 2, "second_trainer": 2}
TOKEN = "chaos-token"


class Failure(Exception):
    """Something the run must survive was not survived."""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_until(cond, what: str, timeout_s: float, check=lambda: None, note_every_s: float = 60) -> None:
    start = noted = time.monotonic()
    while not cond():
        check()
        now = time.monotonic()
        if now - start > timeout_s:
            raise Failure(f"timed out after {timeout_s:.0f} s waiting for {what}")
        if now - noted >= note_every_s:
            print(f"chaos: waiting for {what}: {now - start:.0f} s of {timeout_s:.0f}", flush=True)
            noted = now
        time.sleep(0.2)


class Proc:
    """A role's process in a session of its own, its output appended to a log file."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict):
        self.name, self.cmd, self.log, self.env = name, cmd, log, env
        self.p: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        with open(self.log, "ab") as out:
            out.write(f"\n===== chaos: start {self.starts} of {self.name}\n".encode())
            self.p = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        self.starts += 1

    def kill_group(self, timeout_s: float = 120) -> None:
        """SIGKILL the process group; the trainer's ranks, in sessions of their own, must die
        with their torchrun agent (trainer/lifeline.py)."""
        ranks = [pid for pid in descendants(self.p.pid) if alive(pid)]
        self.sigkill()
        self.p.wait(timeout=timeout_s)
        wait_until(
            lambda: not any(alive(pid) for pid in ranks), f"the ranks of {self.name} to die with their agent", 60
        )

    def sigkill(self) -> None:
        """SIGKILL the process group, which must still be there."""
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:  # e.g. it stopped on DONE just before the fault
            raise Failure(f"{self.name} had exited by itself (code {self.p.poll()}) when its fault came") from None

    def text(self) -> str:
        return self.log.read_text(errors="replace")


class Chaos:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.layout = RunLayout(str(Path(args.root).resolve()))
        self.logs = Path(args.logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.report: dict = {
            "seed": args.seed,
            "steps": args.steps,
            "faults": collections.Counter(),
            "second_trainers_refused": 0,
            "failures": [],
        }
        self.expected_exit: set[str] = set()
        port = free_port()
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            TOKENIZERS_PARALLELISM="false",
            TANDEM_GRPC_TOKEN=TOKEN,
        )
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        self.env = env
        root = self.layout.root
        self.trainer_args = [
            f"root={root}",
            f"actor_rollout_ref.model.path={self.layout.init_model}",
            f"trainer.total_training_steps={args.steps}",
            *BUILTIN_TRAINER,
            "trainer.save_freq=2",
            "trainer.log_sample_ids=true",
            # nothing dropped as stale: every consumed sample must then be trained
            "trainer.max_staleness=1000",
            "buffer.retention=archive",
            "buffer.transport=grpc",
            f"buffer.grpc_bind=127.0.0.1:{port}",
        ]
        self.trainer = Proc(
            "trainer",
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "-m",
                "trainer.main",
                *self.trainer_args,
            ],
            self.logs / "trainer.log",
            env,
        )
        self.own = {1: self.logs / "w1-root"}  # the gRPC worker's own folder
        self.workers = [
            Proc(
                f"w{i}",
                [
                    sys.executable,
                    "-m",
                    "rollout.worker",
                    f"root={self.own.get(i, root)}",
                    f"worker.id=w{i}",
                    f"worker.seed={i}",
                    f"data.train_files=[{self.layout.train_parquet}]",
                    "data.max_response_length=3",
                    *BUILTIN_WORKER,
                    f"buffer.transport={'fs' if i == 0 else 'grpc'}",
                    f"buffer.grpc_address=127.0.0.1:{port}",
                ],
                self.logs / f"worker-w{i}.log",
                env,
            )
            for i in range(2)
        ]

    # --- the run -------------------------------------------------------------------------------
    def steps(self) -> int:
        try:
            return Path(self.layout.metrics).read_text().count("\n")
        except FileNotFoundError:
            return 0

    def last_step(self) -> dict:
        """The trainer's last metrics line ({} while there is no whole one)."""
        try:
            return json.loads(Path(self.layout.metrics).read_text().splitlines()[-1])
        except (OSError, IndexError, ValueError):
            return {}

    def step_time(self) -> float:
        """Seconds the trainer's last step took by its own clock (waiting for experience
        included), within [0.1, 3]; 3 when unknown."""
        return min(max(float(self.last_step().get("time/step_s", 3.0)), 0.1), 3.0)

    def check(self) -> None:
        """Every process the driver did not kill is running, or has finished the run."""
        done = os.path.exists(self.layout.done_marker)
        for proc in [self.trainer, *self.workers]:
            code = proc.p.poll()
            if code is not None and proc.name not in self.expected_exit and not (done and code == 0):
                raise Failure(f"{proc.name} exited with code {code} by itself; see {proc.log}")

    def run(self) -> None:
        print(f"chaos seed {self.args.seed}", flush=True)
        builtin_task.write_model(self.layout.init_model)
        builtin_task.write_parquet(self.layout.train_parquet, builtin_task.make_rows(2000, 3))
        t0 = time.monotonic()
        for proc in [self.trainer, *self.workers]:
            proc.start()
        kinds = [k for k, n in FAULTS.items() for _ in range(n)] + (["disk_full"] if self.args.disk_full else [])
        self.rng.shuffle(kinds)
        wait_until(lambda: self.steps() >= 2, "the first steps", 900, self.check)
        for kind in kinds:
            seen = self.steps()
            wait_until(
                lambda seen=seen: self.steps() > seen or os.path.exists(self.layout.done_marker),
                f"a step after the last fault (before {kind})",
                900,
                self.check,
            )
            if os.path.exists(self.layout.done_marker):
                raise Failure(f"the run ended after {sum(self.report['faults'].values())} faults: give it more steps")
            # The random moment of the fault: anywhere in the next step (reading, training,
            # publishing, checkpointing). Scaled by the step's time, not a fixed 0-3 s: a fast
            # trainer took ~5 steps per fault that way and nearly finished before the last fault.
            time.sleep(self.rng.uniform(0, 1) * self.step_time())
            print(f"{time.monotonic() - t0:6.0f} s, step {self.steps()}: {kind}", flush=True)
            getattr(self, f"fault_{kind}")()
            self.report["faults"][kind] += 1
        self.report["step_at_last_fault"] = self.last_step().get("step")  # margin: steps left
        wait_until(lambda: self.trainer.p.poll() is not None, "the trainer to finish", 1800, self.check)
        if self.trainer.p.returncode != 0 or not os.path.exists(self.layout.done_marker):
            raise Failure(
                f"the trainer ended with code {self.trainer.p.returncode}, DONE "
                f"{'present' if os.path.exists(self.layout.done_marker) else 'missing'}"
            )
        for w in self.workers:  # they stop on DONE
            w.p.wait(timeout=600)
            if w.p.returncode != 0:
                raise Failure(f"{w.name} ended with code {w.p.returncode} after DONE; see {w.log}")
        self.report["duration_s"] = round(time.monotonic() - t0)

    # --- faults --------------------------------------------------------------------------------
    def _restart_trainer(self) -> None:
        self.expected_exit.discard("trainer")
        self.trainer.start()

    def fault_worker(self, worker: Proc | None = None) -> None:
        w = worker or self.rng.choice(self.workers)
        self.expected_exit.add(w.name)
        w.kill_group()
        self.expected_exit.discard(w.name)
        w.start()

    def fault_trainer(self) -> None:
        self.expected_exit.add("trainer")
        self.trainer.kill_group()
        self._restart_trainer()

    def fault_both(self) -> None:
        w = self.rng.choice(self.workers)
        self.expected_exit |= {"trainer", w.name}
        w.sigkill()
        self.trainer.kill_group()
        w.p.wait(timeout=60)
        self.expected_exit.discard(w.name)
        w.start()
        self._restart_trainer()

    def fault_grpc_side(self) -> None:
        """Rank 0 alone: it holds the gRPC server, the reader and the run lock."""
        self.expected_exit.add("trainer")
        ranks = [pid for pid in descendants(self.trainer.p.pid) if alive(pid) and _rank(pid) == 0]
        if not ranks:
            raise Failure("no live rank 0 under the trainer's torchrun")
        everyone = [pid for pid in descendants(self.trainer.p.pid) if alive(pid)]
        os.kill(ranks[0], signal.SIGKILL)
        self.trainer.p.wait(timeout=300)  # torchrun ends the other rank and exits
        wait_until(lambda: not any(alive(pid) for pid in everyone), "the other rank to end", 120)
        self._restart_trainer()

    def fault_second_trainer(self) -> None:
        wait_until(lambda: _lock_holder_alive(self.layout), "the trainer to hold its lock", 600, self.check)
        log = self.logs / "second-trainer.log"
        with open(log, "ab") as out:
            p = subprocess.run(
                [sys.executable, "-m", "trainer.main", *self.trainer_args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                timeout=600,
            )
        tail = log.read_text(errors="replace")[-4000:]
        if p.returncode == 0 or "held by the trainer pid" not in tail:
            raise Failure(f"a second trainer was not refused (exit {p.returncode}); see {log}")
        self.report["second_trainers_refused"] += 1

    def fault_disk_full(self) -> None:
        filler = os.path.join(os.path.dirname(self.layout.root), "filler")
        marks = {p.name: len(p.text()) for p in [self.trainer, *self.workers]}
        fill_disk(filler)
        said = lambda p: "disk full at" in p.text()[marks[p.name] :]  # noqa: E731
        try:
            wait_until(lambda: said(self.trainer), "the trainer to say 'disk full at'", 300, self.check)
            # a worker held by backpressure writes nothing, so it may have nothing to say: the
            # disk stays full until one does, or for at most a minute
            try:
                wait_until(lambda: any(map(said, self.workers)), "a worker to say it", 60, self.check)
            except Failure:
                pass
            self.report["disk_full_workers_said_so"] = sum(map(said, self.workers))
        finally:
            os.remove(filler)

    # --- the audit -----------------------------------------------------------------------------
    def audit(self) -> None:
        final: dict[int, dict] = {}
        for line in Path(self.layout.metrics).read_text().splitlines():
            row = json.loads(line)
            final[row["step"]] = row  # a later line of a step replaces an earlier one
        if sorted(final) != list(range(1, self.args.steps + 1)):
            raise Failure(f"final timeline has steps {sorted(final)[:5]}..., not 1..{self.args.steps}")
        trained = collections.Counter(i for row in final.values() for i in row["samples/ids"])
        shards: dict[str, list[str]] = {}
        declared_lost: set[str] = set()
        doubled_keys = []
        for folder in ("experience", "archive", "quarantine"):
            for path in Path(self.layout.root, folder).rglob("*.arrow*"):
                if path.name.endswith(".reason.txt") or ".tmp-" in path.name:
                    continue
                table = decode(path.read_bytes())
                meta = table.schema.metadata
                key = f"{meta[b'tandem.worker_id'].decode()}/{meta[b'tandem.shard_seq'].decode()}"
                if key in shards:
                    doubled_keys.append(key)
                shards[key] = [s.sample_id for s in from_table(table)]
                if DECLARED_LOST_KEY in meta:
                    declared_lost.add(key)
        last = sorted(Path(self.layout.checkpoints_dir).glob("step_*"))[-1]
        state = json.loads((last / "trainer_state.json").read_text())
        if state["step"] != self.args.steps:
            raise Failure(f"the last checkpoint is of step {state['step']}, not the final step")
        consumed = Ledger.from_json(state["consumed"])
        pooled = {s.sample_id for s in from_table(decode((last / "pool.arrow").read_bytes()))}
        written = {i for ids in shards.values() for i in ids}
        in_consumed = {i for key, ids in shards.items() if key in consumed for i in ids}
        lost = in_consumed - set(trained) - pooled
        r = self.report
        r.update(
            faults_total=sum(r["faults"].values()),
            shards=len(shards),
            samples_written=len(written),
            samples_trained=len(trained),
            samples_doubled=sum(1 for n in trained.values() if n > 1),
            samples_lost=len(lost),
            samples_trained_never_written=len(set(trained) - written),
            samples_read_not_yet_trained=len(pooled),
            samples_not_yet_read=len(written - in_consumed),
            shard_numbers_written_twice=len(doubled_keys),
            shard_numbers_missing=len(missing := _missing_numbers(shards, self._outbox_keys())),
            shards_declared_lost=len(declared_lost),
            samples_unacknowledged_at_end=self._outbox_samples(),
            quarantined_shards=len(list(Path(self.layout.quarantine_dir).rglob("*.reason.txt"))),
            restarts={p.name: p.starts - 1 for p in [self.trainer, *self.workers]},
        )
        rows = [final[s] for s in sorted(final)]
        r["reward_first10"] = sum(x["reward/mean"] for x in rows[:10]) / 10
        r["reward_last10"] = sum(x["reward/mean"] for x in rows[-10:]) / 10
        bad = {
            k: r[k]
            for k in (
                "samples_doubled",
                "samples_lost",
                "samples_trained_never_written",
                "shard_numbers_written_twice",
                "shard_numbers_missing",
                "quarantined_shards",
            )
            if r[k]
        }
        if bad:
            raise Failure(
                f"audit: {bad}; e.g. lost {sorted(lost)[:3]}, shard numbers twice {doubled_keys[:3]}, "
                f"missing (acknowledged never) {missing[:3]}"
            )
        if r["faults_total"] < self.args.min_faults:
            raise Failure(f"only {r['faults_total']} faults injected (want {self.args.min_faults})")
        if not r["reward_last10"] > r["reward_first10"]:
            raise Failure(f"reward did not rise: {r['reward_first10']:.3f} -> {r['reward_last10']:.3f}")

    def _outbox_keys(self) -> set[str]:
        """Shard keys ("worker/seq") still in a gRPC worker's outbox at the end: pushed
        concurrently (buffer.grpc_max_inflight), a later number may be acknowledged before
        them, so they sit below the worker's highest on the trainer without being lost."""
        return {f"{p.parent.name}/{int(p.stem)}" for own in self.own.values() for p in own.glob("outbox/*/*.arrow")}

    def _outbox_samples(self) -> int:
        """Samples a gRPC worker still held unacknowledged when the run ended (it stops pushing
        on DONE): never trained, as any not yet read; reported, not a loss."""
        return sum(
            len(from_table(decode(p.read_bytes()))) for own in self.own.values() for p in own.glob("outbox/*/*.arrow")
        )

    def stop_all(self) -> None:
        for proc in [self.trainer, *self.workers]:
            if proc.p is not None and proc.p.poll() is None:
                proc.kill_group()


def _missing_numbers(shards: dict[str, list[str]], unacknowledged: set[str]) -> list[str]:
    """Keys below their worker's highest written shard that are nowhere on the trainer nor
    still held, unacknowledged, in the worker's outbox."""
    seqs = collections.defaultdict(set)
    for key in shards:
        worker, _, seq = key.rpartition("/")
        seqs[worker].add(int(seq))
    keys = (f"{w}/{q}" for w, have in sorted(seqs.items()) for q in range(max(have)) if q not in have)
    return [k for k in keys if k not in unacknowledged]


def _rank(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return int(env[b"RANK"]) if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env else None
    except (OSError, ValueError):
        return None


def _lock_holder_alive(layout: RunLayout) -> bool:
    try:
        holder = json.loads(Path(layout.trainer_lock).read_text())
    except (OSError, ValueError):
        return False
    return alive(int(holder["pid"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="run folder (created; its parent holds the disk filler)")
    p.add_argument("--logs", required=True, help="folder for the processes' logs (not on --root's disk)")
    p.add_argument("--report", required=True, help="where to write the JSON report")
    p.add_argument("--seed", type=int, default=None, help="fault schedule seed (default: random)")
    p.add_argument(
        "--steps",
        type=int,
        default=150,
        help="trainer steps (default 150: room for every fault when the trainer is fast)",
    )
    p.add_argument("--min-faults", type=int, default=20)
    p.add_argument("--disk-full", action="store_true", help="fill --root's filesystem once")
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    chaos = Chaos(args)
    code = 1
    try:
        chaos.run()
        chaos.audit()
        code = 0
    except (Failure, subprocess.TimeoutExpired) as e:
        chaos.report["failures"].append(str(e))
        print(f"chaos: FAILED: {e}", file=sys.stderr, flush=True)
    finally:
        chaos.stop_all()
        Path(args.report).write_text(json.dumps(chaos.report, indent=1, sort_keys=True) + "\n")
        shutil.copy(chaos.layout.metrics, Path(args.logs) / "metrics.jsonl") if os.path.exists(
            chaos.layout.metrics
        ) else None
    print(json.dumps(chaos.report, sort_keys=True), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
