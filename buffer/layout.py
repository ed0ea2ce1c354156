"""The on-disk layout of a run. Every path of a run folder is computed here and nowhere else,
and used only by the stores (buffer/experience/, buffer/weights/, buffer/control/) and
buffer/run.py: roles get stores from their Run and never see a path (tests/test_structure.py
checks it).

    ROOT/
      init_model/                  the built-in tiny model (HF folder), when launch.local made it
      data/train.parquet           a whole-task parquet in verl's RL format (tests, examples)
      data/{sft,rl}_{train,val}.parquet   the built-in task through rollout.preprocess, as
                                   launch.local writes it (rl_val: validation, --sft-steps: sft_*)
      sft/                         launch.local --sft-steps: the SFT output folder (below)
      experience/<worker>/<seq>.arrow     published shards (temporaries: .<seq>.arrow.tmp-<pid>;
                                   the gRPC server's: experience/.<worker>.<seq>.arrow.tmp-<pid>)
      quarantine/<worker>/<seq>.arrow     shards the trainer rejected, with <seq>.arrow.reason.txt
      archive/<worker>/<seq // 10000>/<seq>.arrow   consumed shards kept by retention mode
                                   'archive' (buckets: no folder ever holds more than 10,000)
      weights/v<version>/          published actor versions (HF safetensors + manifest.json)
      weights/LATEST               the newest complete version number, replaced atomically
                                   (with trainer.max_staleness=0 also the groups it trains on)
      sync/v<version>/<slot>       synchronous mode: the worker that claimed each of the
                                   version's group slots (buffer/control/sync.py)
      workers/<worker>.json        heartbeats
      reward/<server>.json         a reward-model server's address and model checksum, refreshed
                                   as its heartbeat (buffer/reward/fs.py)
      workers/<worker>.claim       the writer's durable claim of its next shard numbers
      validation/requests/v<version>.json  a version the trainer asked rollout.validate to
                                   evaluate; the version stays on disk while this exists
      validation/v<version>.json   its result (metrics per data_source, or why it was skipped)
      validation/validator.json    the validator's heartbeat
      control.json                 pool commands (protocol/control.py), as written by hand
      control.d/<id>.json          one pool command per file, created by launch.control
      pool/<supervisor>.json       a pool supervisor's applied commands, target and workers
      progress.json                the trainer's consumption count (for worker backpressure)
      run.json                     the run id (FsRunState, buffer/control/fs.py), stamped on every shard
      checkpoints/step_<N>/        trainer checkpoints (DCP shards, trainer_state.json, pool.arrow)
      metrics.jsonl                one JSON object per trainer step and per validation result
      tensorboard/, swanlog/       trainer.logger backends' files (tensorboard, swanlab)
      report/                      launch.report's plots, index.html and data.json
      logs/<process>.log           per-process logs under launch.local
      remote/<id>/                 launch.local --remote-workers: the own folder of each worker
                                   and of the validator (a run folder layout of their own: weight
                                   cache, shard claim, logs, data); nothing of the run's
      logs/slurm-<role>-%j.out     SLURM job output (launch.submit; %j/%A_%a filled in by SLURM)
      env/<node>.json              versions and checks recorded by launch.check_env on each node
      .check_env/                  launch.check_env's scratch files (removed after each check)
      DONE                         written by the trainer when it has finished its steps
      trainer.lock                 locked by the running trainer (one per run): its host and pid
      trainer.stop                 asks the trainer to checkpoint and exit (SLURM's time-limit
                                   signal, or by hand); the trainer removes it

An SFT output folder (`trainer.sft`'s trainer.default_local_dir) uses the same names for what it
shares with a run: checkpoints/, weights/v<step>/ (an HF folder per saved step), metrics.jsonl,
tensorboard/, and hf -> weights/v<last step> (a symlink: the final HF folder).
"""

from __future__ import annotations

import dataclasses
import re

ARCHIVE_BUCKET = 10_000  # shards per archive folder
SHARD_SUFFIX = ".arrow"
TMP_MARK = ".tmp-"
_VERSION_DIR = re.compile(r"^v(\d{6,})\Z")
_CHECKPOINT_DIR = re.compile(r"^step_(\d{8,})\Z")
_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_worker_id(worker_id: str) -> str:
    if not isinstance(worker_id, str) or not _WORKER_ID.fullmatch(worker_id):  # "w0\n" too
        raise ValueError(f"worker id {worker_id!r}: use letters, digits, '_', '.', '-' (max 128)")
    return worker_id


@dataclasses.dataclass(frozen=True)
class RunLayout:
    root: str

    def _p(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    # inputs made by launch.local for the built-in task
    @property
    def init_model(self) -> str:
        return self._p("init_model")

    @property
    def train_parquet(self) -> str:
        return self._p("data", "train.parquet")

    def prepared_parquet(self, kind: str, split: str) -> str:
        """rollout.preprocess's outputs: kind 'sft' or 'rl', split 'train' or 'val'."""
        return self._p("data", f"{kind}_{split}.parquet")

    @property
    def sft_dir(self) -> str:
        return self._p("sft")

    @property
    def hf_model(self) -> str:
        """An SFT folder's final HF model (a symlink to its last weight version)."""
        return self._p("hf")

    # experience
    @property
    def experience_dir(self) -> str:
        return self._p("experience")

    def worker_shard_dir(self, worker_id: str) -> str:
        return self._p("experience", check_worker_id(worker_id))

    def shard(self, worker_id: str, seq: int) -> str:
        return self._p("experience", check_worker_id(worker_id), f"{seq:09d}{SHARD_SUFFIX}")

    def shard_tmp(self, worker_id: str, seq: int, pid: int | str) -> str:
        return self._p("experience", check_worker_id(worker_id), f".{seq:09d}{SHARD_SUFFIX}{TMP_MARK}{pid}")

    def spool_tmp(self, worker_id: str, seq: int, pid: int | str) -> str:
        """Where the gRPC server receives a shard: beside the worker folders, so a refused push
        never creates experience/<worker>/."""
        return self._p("experience", f".{check_worker_id(worker_id)}.{seq:09d}{SHARD_SUFFIX}{TMP_MARK}{pid}")

    def outbox_dir(self, worker_id: str) -> str:
        """A gRPC worker's own folder: the shards it pushed that the trainer has not
        acknowledged yet (re-sent by a restarted worker)."""
        return self._p("outbox", check_worker_id(worker_id))

    def outbox_shard(self, worker_id: str, seq: int) -> str:
        return self._p("outbox", check_worker_id(worker_id), f"{seq:09d}{SHARD_SUFFIX}")

    def outbox_tmp(self, worker_id: str, seq: int, pid: int | str) -> str:
        return self._p("outbox", check_worker_id(worker_id), f".{seq:09d}{SHARD_SUFFIX}{TMP_MARK}{pid}")

    @staticmethod
    def shard_seq(name: str) -> int | None:
        """Sequence number of a published shard file name, None for anything else."""
        base = name.rsplit("/", 1)[-1]
        if base.startswith(".") or not base.endswith(SHARD_SUFFIX):
            return None
        stem = base[: -len(SHARD_SUFFIX)]
        return int(stem) if stem.isdigit() else None

    @staticmethod
    def parse_shard_key(key: str) -> tuple[str, int] | None:
        worker, _, seq = key.rpartition("/")
        return (worker, int(seq)) if worker and seq.isdigit() else None

    @property
    def quarantine_dir(self) -> str:
        return self._p("quarantine")

    def quarantine_shard(self, worker_id: str, seq: int, dup: int = 0) -> str:
        """Where a rejected shard goes; `dup` > 0 when that name is already taken."""
        name = f"{seq:09d}{SHARD_SUFFIX}" + (f".{dup}" if dup else "")
        return self._p("quarantine", check_worker_id(worker_id), name)

    @staticmethod
    def quarantine_reason(shard_path: str) -> str:
        return shard_path + ".reason.txt"

    @property
    def archive_dir(self) -> str:
        return self._p("archive")

    def archive_shard(self, worker_id: str, seq: int) -> str:
        # The archive only grows; buckets keep every folder listable on Lustre/NFS. (experience/
        # needs none: retention keeps it to the unconsumed shards plus one checkpoint interval.)
        return self._p(
            "archive", check_worker_id(worker_id), f"{seq // ARCHIVE_BUCKET:05d}", f"{seq:09d}{SHARD_SUFFIX}"
        )

    # weights
    @property
    def weights_dir(self) -> str:
        return self._p("weights")

    def version_dir(self, version: int) -> str:
        return self._p("weights", f"v{version:06d}")

    def version_tmp(self, version: int, pid: int) -> str:
        return self._p("weights", f".v{version:06d}{TMP_MARK}{pid}")

    @staticmethod
    def version_of(name: str) -> int | None:
        m = _VERSION_DIR.match(name.rsplit("/", 1)[-1])
        return int(m.group(1)) if m else None

    @property
    def latest_pointer(self) -> str:
        return self._p("weights", "LATEST")

    def manifest(self, version: int) -> str:
        return self._p("weights", f"v{version:06d}", "manifest.json")

    # synchronous rollouts: per version, one file per claimed group slot
    @property
    def sync_dir(self) -> str:
        return self._p("sync")

    def sync_version_dir(self, version: int) -> str:
        return self._p("sync", f"v{version:06d}")

    def sync_claim(self, version: int, slot: int) -> str:
        return self._p("sync", f"v{version:06d}", f"{slot:06d}")

    # validation: requests from the trainer, results from rollout.validate
    @property
    def validation_dir(self) -> str:
        return self._p("validation")

    @property
    def validation_requests_dir(self) -> str:
        return self._p("validation", "requests")

    def validation_request(self, version: int) -> str:
        return self._p("validation", "requests", f"v{version:06d}.json")

    def validation_result(self, version: int) -> str:
        return self._p("validation", f"v{version:06d}.json")

    @staticmethod
    def validation_version(name: str) -> int | None:
        """Version of a request or result file name, None for anything else."""
        base = name.rsplit("/", 1)[-1]
        return RunLayout.version_of(base[:-5]) if base.endswith(".json") else None

    @property
    def validator_heartbeat(self) -> str:
        return self._p("validation", "validator.json")

    # reward-model servers (buffer/reward/fs.py)
    @property
    def reward_dir(self) -> str:
        return self._p("reward")

    def reward_endpoint(self, server_id: str) -> str:
        """A reward server's endpoint (protocol.reward.RewardEndpoint), refreshed as a heartbeat."""
        return self._p("reward", f"{check_worker_id(server_id)}.json")

    # status, metrics and logs
    @property
    def workers_dir(self) -> str:
        return self._p("workers")

    def heartbeat(self, worker_id: str) -> str:
        return self._p("workers", f"{check_worker_id(worker_id)}.json")

    def worker_lock(self, worker_id: str) -> str:
        """Held (fcntl) by the one live writer of a worker id for its whole life."""
        return self._p("workers", f"{check_worker_id(worker_id)}.lock")

    def seq_claim(self, worker_id: str) -> str:
        """ShardWriter's claim of its shard numbers, written before each shard is published."""
        return self._p("workers", f"{check_worker_id(worker_id)}.claim")

    @property
    def control(self) -> str:
        return self._p("control.json")

    @property
    def control_dir(self) -> str:
        return self._p("control.d")

    def control_command(self, command_id: str) -> str:
        return self._p("control.d", f"{check_worker_id(command_id)}.json")

    @property
    def pool_dir(self) -> str:
        return self._p("pool")

    def pool_state(self, supervisor_id: str) -> str:
        return self._p("pool", f"{check_worker_id(supervisor_id)}.json")

    @property
    def progress(self) -> str:
        return self._p("progress.json")

    @property
    def run_info(self) -> str:
        return self._p("run.json")

    @property
    def tensorboard_dir(self) -> str:
        return self._p("tensorboard")

    @property
    def swanlab_dir(self) -> str:
        return self._p("swanlog")

    @property
    def metrics(self) -> str:
        return self._p("metrics.jsonl")

    @property
    def report_dir(self) -> str:
        return self._p("report")

    @staticmethod
    def heartbeat_worker(name: str) -> str | None:
        """The worker id of a heartbeat file name, None for anything else (e.g. temporaries)."""
        base = name.rsplit("/", 1)[-1]
        if not base.endswith(".json"):
            return None
        try:
            return check_worker_id(base[: -len(".json")])
        except ValueError:
            return None

    def log(self, process: str) -> str:
        return self._p("logs", f"{process}.log")

    def remote_root(self, role: str) -> str:
        """launch.local --remote-workers: the own folder of a worker or the validator."""
        return self._p("remote", check_worker_id(role))

    def slurm_output(self, role: str) -> str:
        """sbatch --output pattern of a role's jobs (SLURM fills in %j, or %A_%a for arrays)."""
        return self._p("logs", f"slurm-{check_worker_id(role)}-%j.out")

    @property
    def env_dir(self) -> str:
        return self._p("env")

    def env_report(self, node: str) -> str:
        return self._p("env", f"{check_worker_id(node)}.json")

    @property
    def check_scratch(self) -> str:
        return self._p(".check_env")

    # trainer checkpoints: step_<N>/ appears (by rename) only when every rank has written
    @property
    def checkpoints_dir(self) -> str:
        return self._p("checkpoints")

    def checkpoint(self, step: int) -> str:
        return self._p("checkpoints", f"step_{step:08d}")

    def checkpoint_tmp(self, step: int, owner: str) -> str:
        """Where `owner` (the trainer's "<host>-<pid>") writes a checkpoint before the commit."""
        return self._p("checkpoints", f".step_{step:08d}{TMP_MARK}{owner}")

    @staticmethod
    def checkpoint_step(name: str) -> int | None:
        m = _CHECKPOINT_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
        return int(m.group(1)) if m else None

    @property
    def done_marker(self) -> str:
        return self._p("DONE")

    @property
    def trainer_lock(self) -> str:
        return self._p("trainer.lock")

    @property
    def trainer_stop(self) -> str:
        return self._p("trainer.stop")
