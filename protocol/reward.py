"""The reward service: what a rollout worker asks a reward-model server (`python -m
rollout.reward_server`, issue 28) and what the server announces of itself.

A worker sends each finished group as one `ScoreRequest` (the prompt's chat messages and the
response texts: the server re-tokenises them with the reward model's own tokenizer and chat
template) and gets one `ScoreReply`: a float per response and the `scorer`, the checksum of the
model folder that scored them (`model_checksum`), recorded on every sample of the experience.
Methods `/<SERVICE>/<name>` of RPCS, msgpack-encoded dataclasses with protocol/run_service.py's
codec (unknown fields ignored, missing ones defaulted: either side may add a field with a
default). Every call carries the run's token (`authorization: Bearer ...`) and SCHEMA_KEY; TLS as
the run's other gRPC servers (buffer/channel.py). Status codes: UNAUTHENTICATED (token),
FAILED_PRECONDITION (schema), INVALID_ARGUMENT (a request that does not decode or is over the
bounds below: retrying cannot help), RESOURCE_EXHAUSTED (the server's queue is full: retried),
UNAVAILABLE (not serving, draining: retried, on another server when there is one).

Scoring is a pure function of (model, request): a retried or repeated request is scored again
with the same result, so no request id is needed; the worker writes a group once, after its reply.

A server publishes a `RewardEndpoint` where the run's roles find it (buffer/reward/fs.py: one
file per server in the run folder), refreshed every `beat_s` (a file older than a few beats is a
dead server's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from protocol.run_service import Empty, MessageError, Rpc, decode, encode

__all__ = [  # the codec and Empty are run_service's, re-exported: one codec for every service
    "Empty",
    "SERVICE",
    "SCHEMA",
    "SCHEMA_KEY",
    "ScoreRequest",
    "ScoreReply",
    "InfoReply",
    "RewardEndpoint",
    "RPCS",
    "method",
    "encode",
    "decode",
    "MessageError",
    "model_checksum",
    "check_request",
]

SERVICE = "tandem.reward.v1.Reward"
SCHEMA = 1
SCHEMA_KEY = "x-tandem-reward-schema"
MAX_RESPONSES = 4096  # responses of one request (a group: actor_rollout_ref.rollout.n)
MAX_TEXT_CHARS = 1 << 20  # characters of one message or response
MAX_MESSAGES = 256  # chat messages of one prompt
MAX_REQUEST_BYTES = 32 << 20  # a client's and a server's message limit


@dataclasses.dataclass
class ScoreRequest:
    group_id: str = ""  # the worker's name of the group (logs only: scoring is stateless)
    messages: list = dataclasses.field(default_factory=list)  # the prompt: [{"role", "content"}, ...]
    responses: list = dataclasses.field(default_factory=list)  # the group's response texts (str)


@dataclasses.dataclass
class ScoreReply:
    scores: list = dataclasses.field(default_factory=list)  # one float per response, in order
    scorer: str = ""  # model_checksum of the server's reward model


@dataclasses.dataclass
class InfoReply:
    server_id: str = ""
    scorer: str = ""
    model: str = ""  # the model folder, as the server was told it
    max_length: int = 0  # tokens a row is truncated to
    device: str = ""


RPCS: dict[str, Rpc] = {
    "Score": Rpc(ScoreRequest, ScoreReply),
    "Info": Rpc(Empty, InfoReply),
}


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def check_request(req: ScoreRequest) -> None:
    """Raise MessageError naming what is out of bounds (the server refuses it: INVALID_ARGUMENT)."""
    if not req.responses or len(req.responses) > MAX_RESPONSES:
        raise MessageError(f"ScoreRequest.responses: {len(req.responses)} responses, expected 1 to {MAX_RESPONSES}")
    if len(req.messages) > MAX_MESSAGES:
        raise MessageError(f"ScoreRequest.messages: {len(req.messages)} messages, at most {MAX_MESSAGES}")
    for i, m in enumerate(req.messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise MessageError(f"ScoreRequest.messages[{i}]: expected {{'role': str, 'content': str}}")
        if len(m["content"]) > MAX_TEXT_CHARS:
            raise MessageError(f"ScoreRequest.messages[{i}].content: over {MAX_TEXT_CHARS} characters")
    for i, r in enumerate(req.responses):
        if not isinstance(r, str) or len(r) > MAX_TEXT_CHARS:
            raise MessageError(f"ScoreRequest.responses[{i}]: expected a str of at most {MAX_TEXT_CHARS} characters")


@dataclasses.dataclass
class RewardEndpoint:
    """What a reward server publishes of itself (JSON)."""

    server_id: str
    address: str  # host:port a worker dials
    scorer: str  # model_checksum of its model
    pid: int
    host: str
    started_at: float  # unix s
    last_beat: float  # unix s, refreshed every beat_s
    beat_s: float
    state: str = "serving"  # "serving", or "stopped" once it drained

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> RewardEndpoint:
        try:
            raw = json.loads(text)
            fields = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in raw.items() if k in fields})
        except (ValueError, TypeError, AttributeError) as e:
            raise MessageError(f"{where}: not a reward endpoint ({e})") from None


# The files of a model folder that decide its scores: weights and config (as
# protocol.weights.base_checksum), and the tokenizer with its chat template.
_SCORING_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def model_checksum(folder: str | Path) -> str:
    """The identity of a reward model folder: sha256 over the sorted `name sha256` lines of its
    *.safetensors files, config and tokenizer files (a changed chat template scores otherwise)."""
    from protocol.weights import ManifestError, sha256_file

    root = Path(folder)
    if not root.is_dir():
        raise ManifestError(f"{root}: not a folder")
    names = sorted(p.name for p in root.iterdir() if p.suffix == ".safetensors" or p.name in _SCORING_FILES)
    if not any(n.endswith(".safetensors") for n in names):
        raise ManifestError(f"{root}: no *.safetensors files: not a model folder")
    lines = "".join(f"{n} {sha256_file(root / n)}\n" for n in names)
    return hashlib.sha256(lines.encode()).hexdigest()
