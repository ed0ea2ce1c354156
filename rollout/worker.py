"""Rollout worker: sample groups, score them, publish experience shards, reload weights in place.

    python -m rollout.worker root=RUN data.train_files=[RUN/data/train.parquet] worker.id=w0

Loop: between batches, load the newest weight version in place if there is one; draw
`prompts_per_batch` prompts; sample `n` responses each; score; append each group to the shard
writer (which publishes atomically by count or age). SIGTERM/SIGINT (what SLURM sends first)
finish the current batch, flush, and exit 0.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
import zlib

from buffer.backpressure import wait_for_room
from buffer.layout import RunLayout
from buffer.storage import atomic_write_json, filesystem, read_json
from buffer.weights import WeightStore
from buffer.writer import ShardWriter
from protocol.config import parse_cli
from protocol.experience import Sample
from rollout import reward
from rollout.config import WorkerConfig
from rollout.dataset import Prompt, PromptStream, load_prompts
from rollout.engine import Completion, SamplingSettings, build_engine

log = logging.getLogger("rollout.worker")


class RolloutWorker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.id = cfg.worker.id or f"{socket.gethostname()}-{os.getpid()}"
        self.fs, root_path = filesystem(cfg.root)
        self.layout = RunLayout(root_path)
        self.layout.heartbeat(self.id)  # validates the id before any work
        self.store = WeightStore(cfg.root)
        self.writer = ShardWriter(cfg.root, self.id, cfg.buffer,
                                  resume=read_json(self.fs, self.layout.heartbeat(self.id)))
        self.score = reward.resolve(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
        self.stopping = False
        self.version: int | None = None
        self.versions_loaded: list[int] = []
        self.batches = 0
        self.tokens = 0
        self.gen_seconds = 0.0
        self.seed = cfg.worker.seed * 1_000_003 + zlib.crc32(self.id.encode())

    def _on_signal(self, signum, _frame) -> None:
        log.info("%s received: finishing the current batch, then flushing", signal.Signals(signum).name)
        self.stopping = True

    def start(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.version = self.store.wait_latest(self.cfg.worker.weights_timeout_s)
        model_dir = self.layout.version_dir(self.version)
        log.info("worker %s starting engine %s from %s", self.id,
                 self.cfg.actor_rollout_ref.rollout.name, model_dir)
        self.engine = build_engine(model_dir, self.cfg.actor_rollout_ref.rollout, self.cfg.worker.device)
        self.versions_loaded.append(self.version)
        self.prompts = PromptStream(
            load_prompts(self.cfg.data.train_files, self.engine.tokenizer, self.cfg.data.prompt_key,
                         self.cfg.data.max_prompt_length),
            self.cfg.data.shuffle, self.seed)

    def maybe_reload(self) -> None:
        latest = self.store.latest()
        if latest is None or latest == self.version:
            return
        t0 = time.monotonic()
        try:
            count = self.engine.load_weights(self.store.tensors(latest))
        except FileNotFoundError as e:  # pruned while we read: the next batch sees a newer one
            log.warning("weight version %d vanished while loading (%s); retrying later", latest, e)
            return
        self.version = latest
        self.versions_loaded.append(latest)
        log.info("loaded weights v%d in place: %d tensors in %.3f s", latest, count, time.monotonic() - t0)

    def _samples(self, prompt: Prompt, group: list[Completion], started: float) -> list[Sample]:
        """Scored samples of one group; the shard writer assigns their group and sample ids."""
        out = []
        for c in group:
            text = self.engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            r = self.score(prompt.data_source, text, prompt.ground_truth, prompt.extra_info)
            out.append(Sample(
                sample_id="", group_id="", prompt_id=prompt.prompt_id,
                worker_id=self.id, weight_version=self.version, prompt_ids=prompt.token_ids,
                response_ids=c.token_ids, behaviour_logprobs=c.logprobs, reward=r,
                finish_reason=c.finish_reason,
                temperature=self.cfg.actor_rollout_ref.rollout.temperature,
                data_source=prompt.data_source, created_at=started, finished_at=time.time()))
        return out

    def run_batch(self) -> float:
        rc = self.cfg.actor_rollout_ref.rollout
        prompts = self.prompts.take(rc.prompts_per_batch)
        params = SamplingSettings(n=rc.n, temperature=rc.temperature, top_p=rc.top_p,
                                  max_tokens=self.cfg.data.max_response_length,
                                  seed=self.seed + self.batches)
        started = time.time()
        t0 = time.monotonic()
        groups = self.engine.generate([p.token_ids for p in prompts], params)
        self.gen_seconds += time.monotonic() - t0
        rewards = []
        for prompt, group in zip(prompts, groups):
            samples = self._samples(prompt, group, started)
            self.tokens += sum(len(s.response_ids) for s in samples)
            rewards += [s.reward for s in samples]
            self.writer.add_group(samples)
        self.batches += 1
        return sum(rewards) / len(rewards)

    def heartbeat(self, state: str) -> None:
        atomic_write_json(self.fs, self.layout.heartbeat(self.id), {
            "worker_id": self.id, "host": socket.gethostname(), "pid": os.getpid(),
            "state": state, "weight_version": self.version,
            "versions_loaded": self.versions_loaded, "batches": self.batches,
            "samples_written": self.writer.samples_written,
            "shards_written": self.writer.shards_written, "next_seq": self.writer.seq,
            "tokens_per_s": self.tokens / self.gen_seconds if self.gen_seconds else 0.0,
            "last_beat": time.time()})

    def should_stop(self) -> bool:
        if self.stopping:
            return True
        if self.cfg.worker.max_batches and self.batches >= self.cfg.worker.max_batches:
            return True
        return self.fs.exists(self.layout.done_marker)

    def run(self) -> None:
        self.start()
        self.heartbeat("running")
        while not self.should_stop():
            wait_for_room(self.fs, self.layout, self.cfg.buffer.max_backlog_samples,
                          self.cfg.buffer.backlog_timeout_s, self.should_stop)
            if self.should_stop():
                break
            self.maybe_reload()
            mean_reward = self.run_batch()
            self.heartbeat("running")
            log.info("batch %d: weights v%d, reward %.3f, %d samples written, %.0f tok/s",
                     self.batches, self.version, mean_reward, self.writer.samples_written,
                     self.tokens / max(self.gen_seconds, 1e-9))
        self.writer.flush()
        self.heartbeat("stopped")
        log.info("worker %s stopped: %d samples in %d shards; weight versions loaded: %s",
                 self.id, self.writer.samples_written, self.writer.shards_written,
                 self.versions_loaded)
        self.engine.close()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(WorkerConfig, argv, "python -m rollout.worker",
                    "Rollout worker: samples groups of responses, scores them, and publishes "
                    "experience shards to the run folder; reloads new weight versions in place.")
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s rollout[%(process)d] %(message)s")
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    RolloutWorker(cfg).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
