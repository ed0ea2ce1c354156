"""Validation role: measure the trainer's weight versions on held-out prompts, as verl does.

    python -m rollout.validate root=RUN data.val_files=[RUN/data/rl_val.parquet]

The trainer asks for versions (the initial weights, every `trainer.test_freq` steps, the last
step) by writing a validation request when it publishes them, and keeps them on disk until they
are answered. This process answers the open requests oldest first: it loads the version into its
engine in place, generates for every prompt of `data.val_files` with
`actor_rollout_ref.rollout.val_kwargs` (greedy, n=1 by default), scores with the workers' reward
function, and writes verl's metrics (`val-core/<data_source>/reward/mean@1`, `val-aux/...`,
computed by `verl.trainer.ppo.metric_utils.process_validation_metrics`) as the version's result.
A version no longer on disk is answered as skipped, with the reason. The process exits when the
trainer has finished (DONE) and no request is open; SIGTERM finishes the current version first
(and ends the wait for the first weights at once). A data_source without a reward function is
refused at start; a reward that is not a finite float32 drops its sample (counted as
`val-aux/rewards_dropped`), as in the workers.

With `reward_model.enable=true` the held-out responses are scored on the run's reward servers,
as the workers' are, and as verl validates: the model's score is `reward` (val-core/.../reward),
the rule reward and what it reports go beside it as `rule_reward` and `rule_<key>` (val-aux/...).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time

from buffer.run import setup_worker_run
from buffer.storage import is_disk_full
from protocol.validation import ValidationRequest, ValidationResult
from protocol.weights import ManifestError
from rollout import reward
from rollout.config import ValidatorConfig
from rollout.dataset import Prompt, data_sources, load_prompts
from rollout.engine import SamplingSettings
from rollout.versions import Refused, VersionGate, load_version
from rollout.worker import run_role, start_engine

log = logging.getLogger("rollout.validate")
NOTE_EVERY_S = 60.0  # a line while idle, naming what it waits for


def val_metrics(data_sources: list[str], uids: list[str], infos: dict[str, list]) -> dict[str, float]:
    """verl's validation metrics under verl's names (RayPPOTrainer._val_metrics_update): per
    data source and variable, mean@n (and std/best/worst/maj@k for n > 1); the core ones, of
    `acc` if the reward function reports it, else of `reward`, go under val-core/, the rest
    under val-aux/. `infos`: variable -> one value per sample."""
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    out = {}
    for source, var2metrics in process_validation_metrics(data_sources, uids, infos).items():
        core_var = "acc" if "acc" in var2metrics else "reward"
        for var, metrics in var2metrics.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metrics)
            for name, value in metrics.items():
                core = var == core_var and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                out[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{name}"] = float(value)
    return out


class Validator:
    def __init__(self, cfg: ValidatorConfig):
        self.cfg = cfg
        self.stores = setup_worker_run(cfg)
        self.store = self.stores.weights
        self.queue = self.stores.validation
        self.score = reward.resolve_details(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
        rm = cfg.reward_model
        self.reward_client = reward.model_client(self.stores, rm)
        # Before waiting for weights or loading an engine: every row can be scored (with a reward
        # model the rule reward is only reported: a row without one reports 0, as in the workers).
        if self.reward_client is None:
            sources = data_sources(cfg.data.val_files, "data.val_files")
            reward.check_data_sources(sources, cfg.custom_reward_function.path)
        self.stopping = False
        self.version: int | None = None  # the weights in the engine
        self.gate = VersionGate(cfg.actor_rollout_ref.model.path)  # full or adapter-only versions (issue 27)
        self.refused: dict | None = None  # why a version was refused (heartbeat; exit 2)
        self.answered: list[int] = []

    def _on_signal(self, signum, _frame) -> None:
        log.info("%s received: finishing the current version, then stopping", signal.Signals(signum).name)
        self.stopping = True
        self.stores.interrupt()  # a call waiting for an unreachable trainer stops waiting

    def start(self) -> bool:
        """Wait for weights, load the engine and the prompts; False when a signal came first."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.heartbeat("starting")
        self.engine, self.version = start_engine(
            self.store,
            self.cfg.actor_rollout_ref.rollout,
            self.cfg.validator.device,
            self.cfg.validator.weights_timeout_s,
            "validator",
            self.gate,
            should_stop=lambda: self.stopping,
        )
        if self.engine is None:
            return False
        data = self.cfg.data
        self.prompts: list[Prompt] = load_prompts(
            data.val_files, self.engine.tokenizer, data.prompt_key, data.max_prompt_length, field="data.val_files"
        )
        log.info("validator: %d prompts from %s", len(self.prompts), data.val_files)
        return True

    def sampling(self) -> SamplingSettings:
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        if not vk.do_sample:  # verl: greedy, whatever temperature says
            return SamplingSettings(
                n=vk.n, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=self.cfg.data.max_response_length, seed=0
            )
        return SamplingSettings(
            n=vk.n,
            temperature=vk.temperature,
            top_p=vk.top_p,
            top_k=vk.top_k,
            max_tokens=self.cfg.data.max_response_length,
            seed=self.cfg.validator.seed,
        )

    def load(self, version: int) -> str:
        """Put `version` into the engine in place; '' on success, else why it is not there."""
        if version == self.version:
            return ""
        self.version = None  # a failed load leaves a mix of weights
        try:
            load_version(self.engine, self.store, self.gate, version)  # Refused: not caught
        except (OSError, ManifestError) as e:
            return (
                f"weight version {version} is no longer on disk (pruned before validation: "
                f"more than trainer.keep_versions validations were pending): {e}"
            )
        self.version = version
        return ""

    def _rule_rows(self, version: int, p: Prompt, texts: list[str]) -> tuple[list[dict], int]:
        """The rule reward's rows ({"reward": value, **what it reports}) and how many were dropped
        (a value that is not a finite float32). With a reward model the rule is only reported:
        a sample it cannot score reports 0 and is kept, as in the workers."""
        rows, dropped = [], 0
        for text in texts:
            try:
                value, extra = self.score(p.data_source, text, p.ground_truth, p.extra_info)
            except reward.RewardError as e:  # one bad value costs one sample, not the run
                if self.reward_client is not None:
                    rows.append({"reward": 0.0})
                    continue
                dropped += 1
                log.warning("weights v%d: dropped a sample of prompt %s: %s", version, p.prompt_id, e)
                continue
            rows.append({"reward": value, **extra})
        return rows, dropped

    def _model_rows(
        self, version: int, chunk: list[Prompt], texts: list[list[str]], rules: list[list[dict]]
    ) -> tuple[list[list[dict]], int] | None:
        """The reward model's score as `reward`, the rule's row beside it as rule_* (verl: the
        model's rm_scores are the reward when present), and the samples dropped (a model score
        that is not a finite float32); None when a stop cut the scoring short."""
        assert self.reward_client is not None
        todo = [(f"validate/v{version}/{p.prompt_id}", p.messages, t) for p, t in zip(chunk, texts)]
        replies = self.reward_client.score_groups(todo, should_stop=lambda: self.stopping)
        out: list[list[dict]] = []
        dropped = 0
        for p, reply, group in zip(chunk, replies, rules):
            if reply is None:
                return None
            out.append([])
            for value, rule in zip(reply.scores, group):
                try:
                    value = reward.check_value(value, p.data_source)
                except reward.RewardError as e:
                    dropped += 1
                    log.warning(
                        "weights v%d: dropped a sample of prompt %s: the reward model's %s", version, p.prompt_id, e
                    )
                    continue
                out[-1].append({"reward": value, **{f"rule_{k}": v for k, v in rule.items()}})
        return out, dropped

    def evaluate(self, req: ValidationRequest) -> ValidationResult | None:
        """verl's metrics of one version on every held-out prompt; None when a stop cut the
        reward model's scoring short (the request stays open for the next validator)."""
        why = self.load(req.version)
        if why:
            return ValidationResult(req.version, req.step, {}, skipped=why, finished_at=time.time())
        t0 = time.monotonic()
        params = self.sampling()
        size = self.cfg.data.val_batch_size or len(self.prompts)
        sources, uids, rows, dropped = [], [], [], 0
        for start in range(0, len(self.prompts), size):
            chunk = self.prompts[start : start + size]
            texts = [
                [self.engine.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
                for group in self.engine.generate([p.token_ids for p in chunk], params)
            ]
            groups = []
            for p, group_texts in zip(chunk, texts):
                group_rows, lost = self._rule_rows(req.version, p, group_texts)
                groups.append(group_rows)
                dropped += lost
            if self.reward_client is not None:
                model = self._model_rows(req.version, chunk, texts, groups)
                if model is None:
                    return None
                groups, lost = model
                dropped += lost
            for i, (p, group_rows) in enumerate(zip(chunk, groups), start):
                sources += [p.data_source] * len(group_rows)
                uids += [str(i)] * len(group_rows)  # a prompt's n responses share its uid
                rows += group_rows
        infos = {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)}
        metrics = val_metrics(sources, uids, infos) | {"val-aux/rewards_dropped": float(dropped)}
        return ValidationResult(
            req.version,
            req.step,
            metrics,
            prompts=len(self.prompts),
            samples=len(rows),
            generate_s=time.monotonic() - t0,
            finished_at=time.time(),
        )

    def heartbeat(self, state: str) -> None:
        try:
            self.queue.write_beat(
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "state": state,
                    "weight_version": self.version,
                    "answered": self.answered,
                    "refused": self.refused,
                    "last_beat": time.time(),
                }
            )
        except OSError as e:
            if not is_disk_full(e):
                raise
            log.warning("disk full at %s: heartbeat skipped (the next one tries again)", self.queue.where())

    def answer_next(self) -> bool:
        """Answer the oldest open request; False when there is none."""
        requests = self.queue.requests()
        if not requests:
            return False
        result = self.evaluate(requests[0])
        if result is None:  # a stop while the reward servers scored: not answered, left open
            return False
        self.queue.answer(result)
        self.answered.append(result.version)
        self.heartbeat("running")
        if result.skipped:
            log.warning("skipped weights v%d (step %d): %s", result.version, result.step, result.skipped)
        else:
            core = "; ".join(f"{k} {v:.3f}" for k, v in sorted(result.metrics.items()) if k.startswith("val-core/"))
            log.info(
                "validated weights v%d (step %d): %s | %d samples in %.2f s",
                result.version,
                result.step,
                core,
                result.samples,
                result.generate_s,
            )
        return True

    def run(self) -> None:
        try:
            if not self.start():
                log.info("validator stopped before the first weight version appeared")
                return
            self.heartbeat("running")
            last_note = time.monotonic()
            while not self.stopping:
                if self.answer_next():
                    last_note = time.monotonic()
                    continue
                if self.stores.state.done():
                    break  # the trainer wrote every request before DONE
                if time.monotonic() - last_note > NOTE_EVERY_S:
                    last_note = time.monotonic()
                    log.info(
                        "waiting for validation requests in %s (the trainer writes one every trainer.test_freq steps)",
                        self.queue.where(),
                    )
                    self.heartbeat("running")
                time.sleep(self.cfg.validator.poll_interval_s)
        except Refused as e:  # the weights are not this validator's to measure: exit 2, named
            self.refused = e.details
            log.error("validator refuses to go on: %s", e)
            raise
        finally:
            self.heartbeat("stopped")  # the trainer stops waiting for results
        log.info("validator stopped: answered versions %s", self.answered)
        self.engine.close()
        if self.reward_client is not None:
            self.reward_client.close()


def main(argv: list[str] | None = None) -> int:
    return run_role(
        Validator,
        ValidatorConfig,
        argv,
        "python -m rollout.validate",
        "Validator: evaluates the weight versions the trainer asks for (every "
        "trainer.test_freq steps) on data.val_files and writes verl's val-core / "
        "val-aux metrics beside them, for the trainer to log.",
        "validate",
    )


if __name__ == "__main__":
    sys.exit(main())
