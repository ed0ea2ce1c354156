"""Configuration of a rollout worker (`python -m rollout.worker`). Names follow verl's."""

from __future__ import annotations

import dataclasses
import re

from buffer.config import BufferConfig
from buffer.layout import check_worker_id
from protocol.config import ConfigError, F
from protocol.sections import DataConfig, ModelConfig


@dataclasses.dataclass
class ValKwargsConfig:
    """verl's actor_rollout_ref.rollout.val_kwargs (same defaults: greedy, one response)."""

    do_sample: bool = F(False, "sample with the settings below; false: greedy decoding")
    n: int = F(1, "responses per validation prompt (metrics become mean@n, best@n, ...)", ge=1)
    temperature: float = F(0.0, "with do_sample: sampling temperature (0: greedy)", ge=0)
    top_p: float = F(1.0, "with do_sample: nucleus sampling mass", gt=0, le=1)
    top_k: int = F(-1, "with do_sample: sample from the k most likely tokens (-1: all)", ge=-1)


@dataclasses.dataclass
class RolloutSamplingConfig:
    name: str = F("hf", "engine: 'hf' (transformers, runs on CPU) or 'vllm' (GPU)", choices=("hf", "vllm"))
    n: int = F(8, "responses sampled per prompt (the GRPO group size)", ge=1)
    temperature: float = F(1.0, "sampling temperature; the trainer recomputes logprobs at it", gt=0)
    top_p: float = F(1.0, "nucleus sampling mass", gt=0, le=1)
    prompts_per_batch: int = F(
        16,
        "prompts submitted to the engine at once (synchronous "
        "trainer, max_staleness=0: at most, of a version's groups claimed "
        "at a time, an equal share among the live workers)",
        ge=1,
    )
    interruptible: bool = F(
        False,
        "generate in segments of segment_tokens; between segments "
        "load new weights and resume unfinished responses on them (as AReaL "
        "does); off: weights switch only between batches",
    )
    segment_tokens: int = F(64, "tokens per segment when interruptible", ge=1)
    dtype: str = F(
        "auto",
        "weights dtype in the engine: auto|float32|bfloat16|float16",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    gpu_memory_utilization: float = F(
        0.9,
        "vLLM: fraction of the GPU's memory the engine takes "
        "(weights, activations, KV cache); 0.9 for a GPU the worker "
        "owns, less when it shares one",
        gt=0,
        le=1,
    )
    tensor_model_parallel_size: int = F(1, "vLLM: tensor-parallel degree", ge=1)
    enforce_eager: bool = F(
        False,
        "vLLM: skip torch.compile and CUDA graphs (starts ~45 s "
        "faster, generates ~20% slower). For debugging, true together with "
        "the environment variable VLLM_ENABLE_V1_MULTIPROCESSING=0 runs the "
        "model in the worker's own process, where errors surface directly",
    )
    max_lora_rank: int = F(
        0,
        "vLLM with adapter-only (LoRA) weight versions: the largest adapter rank the engine holds, one "
        "of 1, 8, 16, 32, 64, 128, 256, 320, 512; 0: the first version's rank rounded up to those, as "
        "verl derives it from model.lora_rank",
        ge=0,
        le=512,
    )
    val_kwargs: ValKwargsConfig = F(factory=ValKwargsConfig)


@dataclasses.dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = F(factory=ModelConfig)
    rollout: RolloutSamplingConfig = F(factory=RolloutSamplingConfig)


@dataclasses.dataclass
class RewardFunctionConfig:
    path: str | None = F(
        None,
        "python file with a custom reward function; default: verl's "
        "reward for the row's data_source, or the built-in task's",
    )
    name: str = F(
        "compute_score",
        "function name in that file: f(data_source, solution_str, ground_truth, extra_info) -> float | dict",
    )


@dataclasses.dataclass
class RewardModelModelConfig:
    path: str | None = F(
        None, "HF sequence-classification folder (one output, num_labels=1) that the reward servers load"
    )


@dataclasses.dataclass
class RewardModelConfig:
    """verl's reward_model section. A worker scores each finished group on the run's reward
    servers (`python -m rollout.reward_server`, started by launch.local --reward-model or
    launch.submit reward) instead of in its own process; the servers read the same keys."""

    enable: bool | None = F(
        None,
        "true: score responses with the reward model (as verl: its score replaces the rule reward, "
        "which the experience keeps beside it as rule_reward)",
    )
    model: RewardModelModelConfig = F(factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: int | None = F(None, "server: rows per forward pass, at most (None: 64)", ge=1, le=65536)
    forward_max_token_len_per_gpu: int | None = F(
        None, "server: padded tokens per forward pass, at most; a longer row goes alone (None: 32768)", ge=16
    )
    max_length: int | None = F(
        None,
        "server: tokens of a (prompt, response) row, at most (None: the model's max_position_embeddings); "
        "longer rows lose their beginning (verl cuts the end; the classifier reads the last token, so tandem keeps it)",
        ge=8,
    )
    addresses: list[str] = F(
        doc="worker (tandem): host:port of the reward servers; empty: those announced in the run "
        "folder (reward/), which a worker with buffer.transport=grpc cannot see",
        factory=list,
    )
    wait_s: float = F(
        1800.0,
        "worker (tandem): seconds a group waits for a reward server to answer (none reachable, "
        "all busy) before the worker fails, naming the addresses every 30 s meanwhile",
        gt=0,
    )
    call_timeout_s: float = F(120.0, "worker (tandem): deadline of one scoring call; past it, retried", gt=0)
    max_inflight: int = F(8, "worker (tandem): groups of one batch being scored at once", ge=1, le=1024)

    def rows(self) -> int:
        return self.micro_batch_size_per_gpu or 64

    def tokens(self) -> int:
        return self.forward_max_token_len_per_gpu or 32768

    def check(self) -> None:
        if self.enable and not self.model.path:
            raise ConfigError("reward_model.model.path: required with reward_model.enable=true")
        for a in self.addresses:
            if not re.fullmatch(r"[^\s:]+:\d{1,5}", a):
                raise ConfigError(f"reward_model.addresses: {a!r} is not host:port")


@dataclasses.dataclass
class EngineProcessSection:
    """What every process with an engine (worker, validator) is told."""

    seed: int = F(0, "sampling seed (a worker's also orders its prompts; mixed with its id)")
    weights_timeout_s: float = F(900.0, "seconds to wait for the trainer's first weight version", gt=0)
    device: str = F("auto", "torch device for the hf engine: auto|cpu|cuda|cuda:N")
    SECTION = "worker"  # the section's name, for messages (not a field)

    def check(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"{self.SECTION}.device: {self.device!r} is not one of auto, cpu, cuda, cuda:N")


@dataclasses.dataclass
class WorkerSection(EngineProcessSection):
    id: str = F("", "worker id (letters, digits, _ . -); default: <hostname>-<pid>")
    max_batches: int = F(0, "stop after this many batches (0: run until stopped)", ge=0)
    arriving_wait_s: float = F(
        10.0,
        "a network worker (buffer.transport=grpc) whose newest published weight version is "
        "still arriving waits up to this long for it before generating a batch with older "
        "weights (a shared-folder worker has every version at once): a batch sampled with older "
        "weights is that much staler when trained on and may be dropped. 0: generate at once",
        ge=0,
        le=600,
    )

    def check(self) -> None:
        super().check()
        if self.id:
            try:
                check_worker_id(self.id)
            except ValueError as e:
                raise ConfigError(f"worker.id: {e}") from None


@dataclasses.dataclass
class EngineProcessConfig:
    """The sections every process with an engine (worker, validator) reads from one config."""

    root: str = F(
        doc="the run folder shared with the trainer (local path or fsspec URL); with "
        "buffer.transport=grpc this process's own local folder (weight cache, shard-number "
        "claim, logs): everything else goes through the trainer's run service"
    )
    data: DataConfig = F(factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = F(factory=ActorRolloutRefConfig)
    custom_reward_function: RewardFunctionConfig = F(factory=RewardFunctionConfig)
    reward_model: RewardModelConfig = F(factory=RewardModelConfig)
    buffer: BufferConfig = F(factory=BufferConfig)


@dataclasses.dataclass
class WorkerConfig(EngineProcessConfig):
    worker: WorkerSection = F(factory=WorkerSection)

    def check(self) -> None:
        if not self.data.train_files:
            raise ConfigError("data.train_files: at least one parquet file is required")


@dataclasses.dataclass
class ValidatorSection(EngineProcessSection):
    poll_interval_s: float = F(1.0, "seconds between looks for new validation requests", gt=0)
    SECTION = "validator"


@dataclasses.dataclass
class ValidatorConfig(EngineProcessConfig):
    validator: ValidatorSection = F(factory=ValidatorSection)

    def check(self) -> None:
        if not self.data.val_files:
            raise ConfigError("data.val_files: at least one parquet file of held-out prompts is required")


@dataclasses.dataclass
class RewardServerSection:
    id: str = F("", "server id (letters, digits, _ . -); default: reward-<hostname>-<pid>")
    device: str = F("auto", "torch device: auto (cuda when there is one)|cpu|cuda|cuda:N")
    host: str | None = F(
        None, "address workers reach it at (and it listens on); default: this node's, as its hostname resolves"
    )
    port: int = F(0, "port it listens on (0: a free one, announced)", ge=0, le=65535)
    beat_s: float = F(5.0, "seconds between refreshes of its endpoint in the run folder", gt=0, le=300)
    threads: int = F(16, "scoring calls handled at once (they queue for the one scoring thread)", ge=1, le=1024)
    max_queued: int = F(512, "groups waiting to be scored; one more is refused (busy: the worker retries)", ge=1)
    drain_s: float = F(60.0, "on SIGTERM: seconds to finish the queued groups before it stops", ge=0)
    SECTION = "server"

    def check(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"server.device: {self.device!r} is not one of auto, cpu, cuda, cuda:N")
        if self.id:
            try:
                check_worker_id(self.id)
            except ValueError as e:
                raise ConfigError(f"server.id: {e}") from None


@dataclasses.dataclass
class RewardServerConfig:
    root: str = F(doc="the run folder (its endpoint is announced in ROOT/reward/)")
    reward_model: RewardModelConfig = F(factory=RewardModelConfig)
    buffer: BufferConfig = F(factory=BufferConfig)  # the token and TLS (grpc_token_file, grpc_tls_*)
    server: RewardServerSection = F(factory=RewardServerSection)

    def check(self) -> None:
        if not self.reward_model.model.path:
            raise ConfigError("reward_model.model.path: the reward model folder is required (--model)")
