"""Rollout worker: sample groups, score them, publish experience shards, reload weights in place.

    python -m rollout.worker root=RUN data.train_files=[RUN/data/train.parquet] worker.id=w0

Loop: between batches, load the newest weight version in place if there is one; draw
`prompts_per_batch` prompts; sample `n` responses each; then, while the engine generates the next
batch, score and append each group to the shard writer (which publishes atomically by count or
age). With `interruptible`, weights also switch between segments of a batch. When the trainer
runs synchronously (trainer.max_staleness=0, announced in weights/LATEST) a worker draws only
the groups it claimed of the version it holds, flushes them, and waits for the next version
(buffer/control/sync.py). SIGTERM/SIGINT (what SLURM sends first) finish the current batch, flush, and
exit 0.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import signal
import socket
import sys
import time
import zlib
from typing import Any

from buffer.channel import Interrupted
from buffer.control import sync
from buffer.layout import check_worker_id
from buffer.run import setup_worker_run
from buffer.storage import is_disk_full
from buffer.weights.base import WeightSource
from buffer.weights.delta import BaseMissing
from buffer.writer import ShardWriter
from protocol.config import parse_cli
from protocol.experience import Sample
from protocol.weights import ManifestError
from rollout import reward
from rollout.config import WorkerConfig
from rollout.dataset import DatasetError, Prompt, PromptStream, data_sources, load_prompts
from rollout.engine import Completion, SamplingSettings, build_engine
from rollout.engine_types import engine_problem
from rollout.versions import ADAPTER, Refused, VersionGate, load_version

log = logging.getLogger("rollout.worker")

HISTORY_ROWS = 256  # heartbeat history bound: at this length every other row is dropped
NAMED_ERRORS = 16  # distinct reward errors (and skipped versions) named in the log; the rest counted
WAITING_BEAT_S = 5.0  # heartbeat period while held back by backpressure (launch.status: not silent)


MAX_REDRAWS = 8  # synchronous mode: whole batches dropped in a row before the worker gives up


def _bounded(rows: list, row: list) -> list:
    """Append `row`; at HISTORY_ROWS (even) keep every other row, the first and the newest
    included: the history spans the whole run, older parts at a coarser step, and a heartbeat
    stays a few kB (every worker reads all heartbeats for backpressure)."""
    rows.append(row)
    return rows[::2] + rows[-1:] if len(rows) >= HISTORY_ROWS else rows


def start_engine(
    store: WeightSource,
    rollout_cfg,
    device: str,
    timeout_s: float,
    who: str,
    gate: VersionGate,
    should_stop=lambda: False,
    skip=lambda version, error: log.warning("weight version %d is damaged (%s): skipped", version, error),
):
    """(engine, version): an engine built from the newest published version, waiting up to
    `timeout_s` for the trainer's first one; (None, None) when `should_stop()` says so first.
    A damaged version (manifest or files not as published) is handed to `skip` and the next
    older one still published is tried; when none is good, the next newer one is waited for.
    An adapter-only version is checked by `gate` (Refused) and applied to an engine built from
    the gate's base (actor_rollout_ref.model.path)."""
    deadline, bad = time.monotonic() + timeout_s, set[int]()
    while True:
        newest = store.wait_latest(max(deadline - time.monotonic(), 0.0), should_stop=should_stop)
        if newest is None:
            return None, None
        if bad and newest <= max(bad):  # every version there was damaged: wait for a new one
            if time.monotonic() > deadline:
                raise TimeoutError(f"{who}: no weight version newer than the damaged v{max(bad)} in {timeout_s:.0f} s")
            time.sleep(0.5)
            continue
        for version in range(newest, -1, -1):
            if version in bad or (version < newest and not store.exists(version)):
                break  # older ones are pruned (or known bad): wait for a newer one
            try:
                model_dir, manifest = store.fetch_manifest(version)
            except (ManifestError, FileNotFoundError) as e:  # damaged, or pruned while it loaded
                if not store.exists(version):
                    log.warning("weight version %d was pruned while loading; retrying", version)
                    break
                bad.add(version)
                skip(version, e)
                continue
            gate.check(version, manifest)  # Refused: never caught here
            try:
                return _engine_of(model_dir, manifest, rollout_cfg, device, gate, who), version
            except (OSError, ValueError):
                # The trainer keeps only its newest versions: this one may have been pruned
                # while the engine read it. Start again from the newest; else a real error.
                if store.exists(version):
                    raise
                log.warning("weight version %d was pruned while the engine loaded it; retrying", version)
                break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{who}: no usable weight version within {timeout_s:.0f} s (damaged: {sorted(bad)})")
        time.sleep(0.5)  # pruned while it loaded: LATEST names a newer one in a moment


def _engine_of(folder: str, manifest, rollout_cfg, device: str, gate: VersionGate, who: str):
    """The engine of a first version: built from its folder (full weights), or from the base
    with the adapter applied (an adapter-only version)."""
    if manifest.adapter is None:
        log.info("%s starting engine %s from %s", who, rollout_cfg.name, folder)
        return build_engine(folder, rollout_cfg, device)
    log.info(
        "%s starting engine %s from the base %s (checksum %s) with the adapter of v%d (rank %d)",
        who,
        rollout_cfg.name,
        gate.model_path,
        gate.base(),
        manifest.version,
        manifest.adapter["rank"],
    )
    engine = build_engine(gate.model_path, rollout_cfg, device, adapter=manifest.adapter)
    try:
        engine.load_adapter(folder, manifest.version)
    except BaseException:
        engine.close()
        raise
    return engine


@dataclasses.dataclass
class GeneratedBatch:
    prompts: list[Prompt]
    groups: list[list[Completion]]
    versions: list[list[int]]  # per completion: the oldest weight version that generated it
    started: float


class RolloutWorker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.id = cfg.worker.id or f"{socket.gethostname()}-{os.getpid()}"
        check_worker_id(self.id)  # before any work
        self.stopping = False
        self.stores = setup_worker_run(cfg)
        # from here on: the next line may already wait for an unreachable trainer
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.score = reward.resolve(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
        rm = cfg.reward_model
        # The run's reward servers (buffer/reward/): each finished group is scored there.
        self.reward_client = reward.model_client(self.stores, rm)
        self.scorer = ""  # the checksum of the reward model that scored the newest group
        self.groups_unscored = 0  # groups a stop cut off while waiting for their scores: not written
        # Before writing anything, waiting for weights or loading an engine: every row can be
        # scored (with a reward model, the rule reward is only recorded: a row without one gets 0).
        if self.reward_client is None:
            reward.check_data_sources(data_sources(cfg.data.train_files), cfg.custom_reward_function.path)
        self.store = self.stores.weights
        # full or adapter-only versions; the base an adapter must name (issue 27)
        self.gate = VersionGate(cfg.actor_rollout_ref.model.path)
        self.refused: dict | None = None  # why this worker refused a version (heartbeat, exit 2)
        self.engine: Any = None  # built by start()
        self.writer = ShardWriter(
            self.stores.sink(self.id), self.id, cfg.buffer, resume=self.stores.heartbeats.read(self.id)
        )
        self.version: int | None = None
        self.versions_loaded: list[int] = []
        # For launch.report: [version, unix time loaded] per load (weight-sync latency, version
        # over time) and per batch [unix time generated, version, samples, tokens, generate s].
        self.loads: list[list] = []
        self.history: list[list] = []
        self._last_beat = -math.inf
        self.batches = 0
        self.tokens = 0
        # Seconds generating, loading new weights in place (checksums included; the first
        # engine start is not a reload) and waiting for the trainer (backpressure, sync mode).
        self.gen_seconds = 0.0
        self.reload_seconds = 0.0
        self.arriving_wait_seconds = 0.0  # held at batch starts for a version still arriving
        self.reloads = 0
        self.reload_bytes = 0  # bytes of the published versions loaded (deltas or snapshots)
        self.last_reload: dict = {}  # version, bytes, seconds of the newest reload
        self.snapshot_asked: int | None = None  # the delta whose lost base made us ask for one
        self.wait_seconds = 0.0
        # Synchronous mode: the groups the trainer announced for the loaded version (none while
        # the trainer runs asynchronously: generate freely).
        self.rounds = sync.WorkerRounds(self.stores.sync, self.id)
        self.resumed_on_new_weights = 0  # responses continued on newer weights (interruptible)
        self.skipped: set[int] = set()  # damaged versions, never loaded (a few: the trainer moves on)
        self.versions_skipped = 0
        self.rewards_dropped = 0  # samples whose reward was not a finite float32
        # Synchronous mode: claimed groups of the loaded version whose every reward was dropped
        # (the trainer waits for each claimed group: drawn again), and redraws in a row.
        self.owed = 0
        self.redraws = 0
        self.reward_failures = 0  # samples scored 0 because the reward function raised
        self._reward_errors_named: set[str] = set()  # kinds logged, at most NAMED_ERRORS
        self.seed = cfg.worker.seed * 1_000_003 + zlib.crc32(self.id.encode())

    def _on_signal(self, signum, _frame) -> None:
        log.info("%s received: finishing the current batch, then flushing", signal.Signals(signum).name)
        self.stopping = True
        self.stores.interrupt()  # a call waiting for an unreachable trainer stops waiting

    def start(self) -> bool:
        """Wait for weights, load the engine and the prompts; False when a signal came first."""
        self.engine, self.version = start_engine(
            self.store,
            self.cfg.actor_rollout_ref.rollout,
            self.cfg.worker.device,
            self.cfg.worker.weights_timeout_s,
            f"worker {self.id}",
            self.gate,
            should_stop=lambda: self.stopping,
            skip=self._skip_version,
        )
        if self.engine is None:
            return False
        self.versions_loaded.append(self.version)
        self.loads = _bounded(self.loads, [self.version, time.time()])
        self.writer.run_id = self.stores.state.run_id()  # written before the first version
        if self.writer.run_id is None:
            log.warning(
                "%s: the run has weight versions but no run id (a trainer older than "
                "this worker?): a trainer that checks run ids refuses these shards",
                self.stores.state.where(),
            )
        # a newer version already named: claim nothing of the one loaded, the loop reloads first
        self.rounds.follow(self.store.pointer() or {}, self.version)
        self.prompts = PromptStream(
            load_prompts(
                self.cfg.data.train_files,
                self.engine.tokenizer,
                self.cfg.data.prompt_key,
                self.cfg.data.max_prompt_length,
            ),
            self.cfg.data.shuffle,
            self.seed,
        )
        return True

    def maybe_reload(self, wait_s: float = 0.0) -> bool:
        """Load the newest published version in place, if it is newer; True when loaded. A
        version still arriving (network source) is waited for up to `wait_s` (worker.arriving_wait_s
        at a batch's start; between segments never)."""
        pointer = self.store.pointer()
        if pointer is None or pointer["version"] == self.version or pointer["version"] in self.skipped:
            return False
        latest = pointer["version"]
        if wait_s > 0 and not self.rounds.on and not self.store.ready(latest):
            self._await_arrival(latest, wait_s)
        if not self.rounds.on and not self.store.ready(latest):
            # Still arriving (network source): generate on. A version fetched in the background
            # while the trainer published newer ones is still newer than ours: load it, or a
            # trainer that publishes faster than a version arrives is never caught up with.
            ready = self.store.newest_ready(self.version)
            if ready is None or ready in self.skipped:
                return False
            latest = ready
        t0 = time.monotonic()
        try:
            count = load_version(self.engine, self.store, self.gate, latest)  # Refused: not caught
        except BaseMissing as e:
            # Joined late, or our copy of its base is gone: the trainer publishes its next
            # version full when asked; until then generate on with the weights we have.
            if self.snapshot_asked != latest:
                log.warning("%s; asking the trainer for a full version (a snapshot)", e)
                self.store.request_snapshot(latest)
                self.snapshot_asked = latest
            return False
        except (FileNotFoundError, ManifestError) as e:
            # Pruned while we read (its folder gone, or newer versions published meanwhile): the
            # next batch sees a newer one. Still there: damaged, skipped; the current one stays.
            if self.store.exists(latest) and self.store.latest() == latest:
                self._skip_version(latest, e)
            else:
                log.warning("weight version %d vanished while loading (%s); retrying later", latest, e)
            return False
        self.version = latest
        self.owed = 0  # a newer version: the trainer no longer waits for the older one's groups
        self.rounds.follow(pointer, latest)
        self.versions_loaded.append(latest)
        self.loads = _bounded(self.loads, [latest, time.time()])
        t2 = time.monotonic()
        self.reload_seconds += t2 - t0
        self.reloads += 1
        nbytes = self.store.version_bytes(latest)
        self.reload_bytes += nbytes
        self.last_reload = {"version": latest, "bytes": nbytes, "seconds": t2 - t0}
        log.info(
            "loaded %s v%d in place: %d tensors in %.3f s (checksums and load)",
            "the adapter of" if self.gate.kind == ADAPTER else "weights",
            latest,
            count,
            t2 - t0,
        )
        return True

    def _skip_version(self, version: int, e: Exception) -> None:
        """A damaged version costs that version: never loaded, counted (versions_skipped), named."""
        self.skipped.add(version)
        self.versions_skipped += 1
        log.warning(
            "weight version %d is damaged (%s): skipped, staying on %s (%d versions skipped so far)",
            version,
            e,
            "no version yet" if self.version is None else f"v{self.version}",
            self.versions_skipped,
        )

    def _await_arrival(self, version: int, wait_s: float) -> None:
        """Wait (at most `wait_s`) until `version` has arrived. One target, never a newer one
        published meanwhile, so a worker on a slow link is held once per batch, not forever. The
        pointer is read again every 0.25 s: the source fetches one version at a time and starts
        the next one seen there once the one in flight is done."""
        t0 = time.monotonic()
        while not self.store.ready(version) and not self.should_stop():
            if time.monotonic() - t0 >= wait_s:
                log.info(
                    "weight version %d still arriving after %.1f s (worker.arriving_wait_s); "
                    "generating with v%d or the newest arrived",
                    version,
                    wait_s,
                    self.version,
                )
                break
            time.sleep(0.25)
            self.store.pointer()
        self.arriving_wait_seconds += time.monotonic() - t0

    def _rule(self, prompt: Prompt, text: str) -> float | None:
        """The rule reward of one response; None when its value cannot be recorded (dropped)."""
        try:
            return self.score(prompt.data_source, text, prompt.ground_truth, prompt.extra_info)
        except reward.RewardError as e:  # one bad value costs one sample, not the run
            self.rewards_dropped += 1
            log.warning(
                "dropped a sample of prompt %s: %s (%d dropped so far)", prompt.prompt_id, e, self.rewards_dropped
            )
            return None
        except Exception as e:  # noqa: BLE001 - a user's reward raising costs that sample's score only
            return self._reward_failed(prompt, e)

    def _samples(self, prompt: Prompt, group: list[Completion], versions: list[int], started: float) -> list[Sample]:
        """Scored samples of one group; the shard writer assigns their group and sample ids. With
        a reward model the rule reward is only recorded beside its score: one it cannot record
        counts as 0 there instead of dropping the sample."""
        out = []
        for c, version in zip(group, versions):
            text = self.engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            r = self._rule(prompt, text)
            if r is None and self.reward_client is None:
                continue
            out.append(
                Sample(
                    sample_id="",
                    group_id="",
                    prompt_id=prompt.prompt_id,
                    worker_id=self.id,
                    weight_version=version,
                    prompt_ids=prompt.token_ids,
                    response_ids=c.token_ids,
                    behaviour_logprobs=c.logprobs,
                    reward=0.0 if r is None else r,
                    finish_reason=c.finish_reason,
                    temperature=self.cfg.actor_rollout_ref.rollout.temperature,
                    data_source=prompt.data_source,
                    created_at=started,
                    finished_at=time.time(),
                )
            )
        return out

    def _model_scores(self, scored: list[tuple[Prompt, list[Sample]]], tag: str) -> list[tuple[Prompt, list[Sample]]]:
        """The reward model's scores in place of the rule rewards, as verl's reward managers use
        `rm_scores` whenever the batch has them (verl/workers/reward_manager/naive.py returns
        data.batch["rm_scores"] and never calls the rule function then; a combination is a custom
        manager's). The rule reward stays beside it (rule_reward), and the scorer's checksum.
        A group whose scoring was cut short by a stop comes back empty: not written, counted."""
        assert self.reward_client is not None
        todo = [
            (f"{self.id}/{tag}/{i}", p.messages, [self._text(s) for s in g]) for i, (p, g) in enumerate(scored) if g
        ]
        replies = iter(self.reward_client.score_groups(todo, should_stop=lambda: self.stopping))
        out: list[tuple[Prompt, list[Sample]]] = []
        for prompt, samples in scored:
            reply = next(replies) if samples else None
            if reply is None:
                self.groups_unscored += bool(samples)
                out.append((prompt, []))
                continue
            self.scorer = reply.scorer
            kept = []
            for s, value in zip(samples, reply.scores):
                try:
                    value = reward.check_value(value, prompt.data_source)
                except reward.RewardError as e:
                    self.rewards_dropped += 1
                    log.warning("dropped a sample of prompt %s: the reward model's %s", prompt.prompt_id, e)
                    continue
                kept.append(dataclasses.replace(s, rule_reward=s.reward, reward=value, scorer=reply.scorer))
            out.append((prompt, kept))
        return out

    def _text(self, s: Sample) -> str:
        return self.engine.tokenizer.decode(s.response_ids, skip_special_tokens=True)

    def _reward_failed(self, prompt: Prompt, e: Exception) -> float:
        """A reward function that raised scores the sample 0 (its group stays whole for the
        advantage); counted in the heartbeat, named in the log once per kind of error."""
        self.reward_failures += 1
        kind = f"{type(e).__name__}: {e}"[:200]
        if kind not in self._reward_errors_named and len(self._reward_errors_named) < NAMED_ERRORS:
            self._reward_errors_named.add(kind)
            log.warning(
                "the reward function raised %s on prompt %s (data_source %r): scored 0; "
                "later samples failing the same way are only counted (reward_failures)",
                kind,
                prompt.prompt_id,
                prompt.data_source,
                exc_info=e,
            )
        return 0.0

    def generate_batch(self, count: int | None = None) -> GeneratedBatch:
        """`count` prompts (default: prompts_per_batch), n responses each."""
        rc = self.cfg.actor_rollout_ref.rollout
        prompts = self.prompts.take(count or rc.prompts_per_batch)
        params = SamplingSettings(
            n=rc.n,
            temperature=rc.temperature,
            top_p=rc.top_p,
            max_tokens=self.cfg.data.max_response_length,
            seed=self.seed + self.batches,
        )
        started = time.time()
        t0 = time.monotonic()
        reloading = self.reload_seconds  # interruptible: loads between segments are not generating
        version = self.version
        if rc.interruptible:
            groups, versions = self._generate_interruptible(prompts, params, rc.segment_tokens)
        else:
            groups = self.engine.generate([p.token_ids for p in prompts], params)
            versions = [[self.version] * len(g) for g in groups]
        seconds = time.monotonic() - t0 - (self.reload_seconds - reloading)
        tokens = sum(len(c.token_ids) for g in groups for c in g)
        self.gen_seconds += seconds
        self.tokens += tokens
        self.batches += 1
        self.history = _bounded(
            self.history, [round(time.time(), 3), version, sum(map(len, groups)), tokens, round(seconds, 4)]
        )
        return GeneratedBatch(prompts, groups, versions, started)

    def _generate_interruptible(
        self, prompts: list[Prompt], params: SamplingSettings, segment: int
    ) -> tuple[list[list[Completion]], list[list[int]]]:
        """Generate in segments of `segment` tokens; between segments, load new weights and
        resume every unfinished response on them (the prefix is re-prefilled). Each token keeps
        the logprob of the policy that sampled it; a sample is tagged with its oldest version."""
        first = dataclasses.replace(params, max_tokens=min(segment, params.max_tokens))
        groups = self.engine.generate([p.token_ids for p in prompts], first)
        versions = [[self.version] * len(g) for g in groups]
        for round_ in range(1, -(-params.max_tokens // segment)):
            todo = [
                (i, k)
                for i, g in enumerate(groups)
                for k, c in enumerate(g)
                if c.finish_reason == "length" and len(c.token_ids) < params.max_tokens
            ]
            if not todo:
                break
            if self.maybe_reload():
                self.resumed_on_new_weights += len(todo)
            budget = min(segment, params.max_tokens - round_ * segment)
            step = dataclasses.replace(params, n=1, max_tokens=budget, seed=params.seed + round_)
            outs = self.engine.generate([prompts[i].token_ids + groups[i][k].token_ids for i, k in todo], step)
            for (i, k), [more] in zip(todo, outs):
                c = groups[i][k]
                groups[i][k] = Completion(c.token_ids + more.token_ids, c.logprobs + more.logprobs, more.finish_reason)
        return groups, versions

    def finish_batch(self, batch: GeneratedBatch) -> float:
        """Score and publish one generated batch; returns its mean reward."""
        rewards, empty = [], 0
        scored = [
            (p, self._samples(p, g, v, batch.started)) for p, g, v in zip(batch.prompts, batch.groups, batch.versions)
        ]
        if self.reward_client is not None:  # a finished group waits here for its scores, unwritten
            scored = self._model_scores(scored, f"{batch.started:.3f}")
        for _prompt, samples in scored:
            rewards += [s.reward for s in samples]
            if samples:
                self.writer.add_group(samples)
            else:  # every reward of the group dropped: nothing to write
                empty += 1
        if self.rounds.on:
            self.owed += empty  # read by the main thread once this batch's future is done
            self.redraws = self.redraws + 1 if empty == len(batch.groups) else 0
            self.writer.flush()  # the trainer waits for exactly these groups
        return sum(rewards) / len(rewards) if rewards else float("nan")

    def run_batch(self) -> float:
        return self.finish_batch(self.generate_batch())

    def _finished(self, pending: concurrent.futures.Future) -> float:
        """The finisher's result; while it waits (for reward servers, say) the heartbeat stays
        fresh, so that launch.status tells a waiting worker from a silent one."""
        while True:
            try:
                return pending.result(timeout=WAITING_BEAT_S)
            except concurrent.futures.TimeoutError:
                self.heartbeat("waiting")

    def _log_batch(self, mean_reward: float) -> None:
        self.heartbeat("running")
        log.info(
            "batch %d: weights v%d, reward %.3f, %d samples written, %.0f tok/s",
            self.batches,
            self.version,
            mean_reward,
            self.writer.samples_written,
            self.tokens / max(self.gen_seconds, 1e-9),
        )

    def claim(self) -> int:
        """Synchronous mode: claim this worker's share of the loaded version's groups."""
        return self.rounds.claim(self.version, self.cfg.actor_rollout_ref.rollout.prompts_per_batch)

    def _redraw(self) -> int:
        """Synchronous mode: how many claimed groups to draw again (with the next prompts)
        because every reward of theirs was dropped; the trainer waits for each claimed group.
        Fails after MAX_REDRAWS batches in a row dropped whole: the reward function is broken."""
        owed, self.owed = self.owed, 0
        if owed and self.redraws >= MAX_REDRAWS:
            raise RuntimeError(
                f"worker {self.id}: every reward of {MAX_REDRAWS} batches in a row was dropped "
                f"({self.rewards_dropped} samples so far): check custom_reward_function"
            )
        if owed:
            log.warning("every reward of %d claimed groups of v%s was dropped: drawing them again", owed, self.version)
        return owed

    def wait_for_next_version(self) -> None:
        self.heartbeat("waiting")
        self.wait_seconds += self.rounds.wait_newer(
            self._latest_usable, self.version, self.cfg.buffer.backlog_timeout_s, self._stop_while_waiting
        )

    def _latest_usable(self) -> int | None:
        """The newest version, unless it is one skipped as damaged (then: none newer yet)."""
        latest = self.store.latest()
        return self.version if latest in self.skipped else latest

    def heartbeat(self, state: str) -> None:
        try:
            self._write_heartbeat(state)
        except OSError as e:
            if not is_disk_full(e):
                raise
            log.warning(
                "disk full at %s: heartbeat skipped (the next one tries again)", self.stores.heartbeats.where(self.id)
            )
            self._last_beat = time.monotonic()  # while held back: one try (and line) per period

    def _write_heartbeat(self, state: str) -> None:
        self.stores.heartbeats.write(
            self.id,
            {
                "worker_id": self.id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "state": state,
                "weight_version": self.version,
                "versions_loaded": self.versions_loaded,
                "batches": self.batches,
                "samples_written": self.writer.samples_written,
                "shards_written": self.writer.shards_written,
                "next_seq": self.writer.seq,
                "tokens_per_s": self.tokens / self.gen_seconds if self.gen_seconds else 0.0,
                "generate_s": self.gen_seconds,
                "reload_s": self.reload_seconds,
                "reloads": self.reloads,
                "reload_bytes": self.reload_bytes,
                "last_reload": self.last_reload,
                "wait_s": self.wait_seconds,
                "arriving_wait_s": self.arriving_wait_seconds,
                "reload_fraction": self.reload_seconds / self.gen_seconds if self.gen_seconds else 0.0,
                "synchronous": self.rounds.on,
                "resumed_on_new_weights": self.resumed_on_new_weights,
                "rewards_dropped": self.rewards_dropped,
                "reward_failures": self.reward_failures,
                "versions_skipped": self.versions_skipped,
                "reward_model": None
                if self.reward_client is None
                else {
                    "scorer": self.scorer,
                    "retries": getattr(self.reward_client, "retries", 0),
                    "groups_unscored": self.groups_unscored,
                },
                "refused": self.refused,
                "loads": self.loads,
                "history": self.history,
                "last_beat": time.time(),
            },
        )
        self._last_beat = time.monotonic()

    def _stop_while_waiting(self) -> bool:
        """`should_stop` of the backpressure wait; it also keeps the heartbeat fresh, so that
        launch.status tells a worker held back by a full buffer from a silent one."""
        if time.monotonic() - self._last_beat >= WAITING_BEAT_S:
            self.heartbeat("waiting")
        return self.should_stop()

    def _flush_while_waiting(self) -> None:
        """The age-based flush goes on while backpressure holds the worker (else its last batch
        would sit unpublished); the heartbeat then counts what was published."""
        if self.writer.maybe_flush() is not None:
            self.heartbeat("running")

    def should_stop(self) -> bool:
        if self.stopping:
            return True
        if self.cfg.worker.max_batches and self.batches >= self.cfg.worker.max_batches:
            return True
        return self.stores.state.done()

    def run(self) -> None:
        """Generate until stopped; a refused version (rollout/versions.py) ends the worker: the
        heartbeat names the reason and both checksums, Refused goes on to run_role (exit 2)."""
        try:
            self._run()
        except Refused as e:
            self.refused = e.details
            log.error("worker %s refuses to go on: %s", self.id, e)
            self.heartbeat("stopped")
            if self.engine is not None:
                self.engine.close()
            raise

    def _run(self) -> None:
        if not self.start():
            self.writer.close()
            self.heartbeat("stopped")
            log.info("worker %s stopped before the first weight version appeared", self.id)
            return
        self.heartbeat("running")
        # The engine generates batch k+1 while one owned thread scores and publishes batch k.
        finisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="finish")
        pending = None
        try:
            while not self.should_stop():
                # the sink's backpressure (over gRPC: unacknowledged pushes); in sync mode, the claims
                if not self.rounds.on:
                    self.wait_seconds += self.writer.sink.wait_for_room(
                        self.cfg.buffer.max_backlog_samples,
                        self.cfg.buffer.backlog_timeout_s,
                        self._stop_while_waiting,
                        on_wait=self._flush_while_waiting,
                        group_size=self.cfg.actor_rollout_ref.rollout.n,
                    )
                if self.should_stop():
                    break
                self.maybe_reload(wait_s=self.cfg.worker.arriving_wait_s)
                count = self.claim() if self.rounds.on else None
                if count == 0:  # this version's groups are all claimed: publish ours, then wait
                    if pending is not None:
                        self._log_batch(self._finished(pending))
                        pending = None
                    count = self._redraw()
                    if count == 0:
                        self.wait_for_next_version()
                        continue
                batch = self.generate_batch(count)
                if pending is not None:
                    self._log_batch(self._finished(pending))
                pending = finisher.submit(self.finish_batch, batch)
            if pending is not None:
                self._log_batch(self._finished(pending))
        finally:
            finisher.shutdown(wait=True)
            if self.reward_client is not None:
                self.reward_client.close()
            self.writer.close()  # flush, also on failure; over gRPC wait for the acknowledgements
        self.heartbeat("stopped")
        log.info(
            "worker %s stopped: %d samples in %d shards; weight versions loaded: %s",
            self.id,
            self.writer.samples_written,
            self.writer.shards_written,
            self.versions_loaded,
        )
        self.engine.close()


def _ignore_stop_signals() -> None:
    """Once run() is over, SIGTERM/SIGINT have nothing left to stop: ignore them. Python puts a
    handler it installed back to SIG_DFL while the interpreter exits (before torch's teardown), so
    a SIGTERM then (a pool's repeated drain signal, SLURM's at the time limit) would kill a process
    that had finished cleanly, and its job would end FAILED (-15) instead of 0."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def run_role(role, config_cls, argv: list[str] | None, prog: str, description: str, tag: str) -> int:
    """Entry point of a process with an engine: config from the command line, logs to stdout
    tagged `tag`, torch threads from OMP_NUM_THREADS, then `role(cfg).run()`."""
    cfg = parse_cli(config_cls, argv, prog, description)
    if problem := engine_problem(cfg.actor_rollout_ref.rollout.name):
        print(f"{prog}: config error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, format=f"%(asctime)s %(levelname)s {tag}[%(process)d] %(message)s"
    )
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        process = role(cfg)
        try:
            process.run()
        finally:  # a clean stop (also by a signal): a background weight fetch is cancelled
            _ignore_stop_signals()
            process.stores.weights.close()
    except (DatasetError, reward.RewardError) as e:  # the dataset or the reward set-up
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except Refused as e:  # a weight version it must not sample from: restarting would not help
        print(f"{prog}: refused: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:  # a stop asked while the trainer was unreachable: a clean stop
        log.warning("%s", e)
        return 0
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_role(
        RolloutWorker,
        WorkerConfig,
        argv,
        "python -m rollout.worker",
        "Rollout worker: samples groups of responses, scores them, and publishes "
        "experience shards to the run folder; reloads new weight versions in place.",
        "rollout",
    )


if __name__ == "__main__":
    sys.exit(main())
