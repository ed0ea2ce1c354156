"""Experience records: the Arrow schema of what rollout workers hand to the trainer.

One shard is one Arrow IPC file (stream format, one or more record batches) whose schema
metadata carries SCHEMA_VERSION. A GRPO group (all `n` samples of one prompt draw) is never split
across shards, so the trainer can batch whole groups without waiting on other shards.
"""
from __future__ import annotations

import dataclasses
import io
from typing import Iterable

import pyarrow as pa

SCHEMA_VERSION = "1"
SCHEMA_VERSION_KEY = b"tandem.schema_version"


class SchemaError(ValueError):
    """A shard does not match this version of the experience schema."""


@dataclasses.dataclass
class Sample:
    sample_id: str  # globally unique: "{worker_id}/{batch_seq}/{group_idx}/{k}"
    group_id: str  # one draw of one prompt; the GRPO group key
    prompt_id: str  # stable id of the dataset row (verl extra_info.index when present)
    worker_id: str
    weight_version: int  # version of the weights that generated every token of the response
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]  # log mu(token), per response token, at `temperature`
    reward: float
    finish_reason: str  # "stop" (eos) or "length"
    temperature: float
    data_source: str
    created_at: float  # unix seconds, generation start
    finished_at: float  # unix seconds, reward computed


SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("worker_id", pa.string(), nullable=False),
    pa.field("weight_version", pa.int64(), nullable=False),
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("behaviour_logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("reward", pa.float32(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("temperature", pa.float32(), nullable=False),
    pa.field("data_source", pa.string(), nullable=False),
    pa.field("created_at", pa.float64(), nullable=False),
    pa.field("finished_at", pa.float64(), nullable=False),
], metadata={SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode()})

_NAMES = [f.name for f in dataclasses.fields(Sample)]
assert _NAMES == SCHEMA.names, "Sample and SCHEMA must list the same columns in the same order"


def to_table(samples: Iterable[Sample], extra_metadata: dict[str, str] | None = None) -> pa.Table:
    rows = list(samples)
    cols = {name: [getattr(s, name) for s in rows] for name in _NAMES}
    meta = {k.encode(): str(v).encode() for k, v in (extra_metadata or {}).items()}
    meta.update(SCHEMA.metadata)  # the schema version cannot be overridden
    return pa.Table.from_pydict(cols, schema=SCHEMA.with_metadata(meta))


def from_table(table: pa.Table) -> list[Sample]:
    check_schema(table.schema)
    cols = table.to_pydict()
    return [Sample(**{name: cols[name][i] for name in _NAMES}) for i in range(table.num_rows)]


def check_schema(schema: pa.Schema) -> None:
    version = (schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    if version is None:
        raise SchemaError("no tandem.schema_version in the shard metadata (not a tandem shard)")
    if version.decode() != SCHEMA_VERSION:
        raise SchemaError(f"schema version {version.decode()}, this build reads {SCHEMA_VERSION}")
    if not schema.remove_metadata().equals(SCHEMA.remove_metadata()):
        raise SchemaError(f"columns differ from the experience schema: got {schema.names}")


def check_rows(samples: list[Sample]) -> None:
    """Per-row invariants the trainer relies on."""
    for s in samples:
        if len(s.response_ids) != len(s.behaviour_logprobs):
            raise SchemaError(f"{s.sample_id}: {len(s.response_ids)} response tokens but "
                              f"{len(s.behaviour_logprobs)} logprobs")
        if not s.prompt_ids or not s.response_ids:
            raise SchemaError(f"{s.sample_id}: empty prompt or response")


def encode(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def decode(data: bytes) -> pa.Table:
    with pa.ipc.open_stream(pa.py_buffer(data)) as reader:
        return reader.read_all()
