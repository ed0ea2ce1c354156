"""Experience records: the Arrow schema of what rollout workers hand to the trainer.

This module is the single definition of the shard byte format:

    shard = payload + trailer
    payload = one Arrow IPC *stream* (one or more record batches, then the end-of-stream marker)
              whose schema metadata carries SCHEMA_VERSION
    trailer = 48 bytes, struct "<8sQ32s": TRAILER_MAGIC, len(payload), sha256(payload)

The trailer is part of the bytes written to the temporary file, so the atomic rename publishes
payload and digest together (no sidecar). Plain pyarrow readers still read a shard (an IPC stream
reader stops at the end-of-stream marker); `decode` first checks the trailer, which catches flipped
bytes, truncation (even of just the end-of-stream marker, which pyarrow alone does not notice)
and files that are not tandem shards. `load_shard` adds the per-value checks the trainer relies
on (`validate_table`).

A GRPO group (all `n` samples of one prompt draw) is never split across shards, so the trainer can
batch whole groups without waiting on other shards.

Versions: 1 = bare IPC stream; 2 = IPC stream + integrity trailer; 3 = experience shards carry
the run id (RUN_ID_KEY, RunState.run_id in buffer/control/) in the metadata; 4 = two columns at
the end, `rule_reward` (the rule function's score, which `reward` is unless a reward model scored
the sample) and `scorer` (protocol.reward.model_checksum of the reward model that scored it, ""
for the rule). Versions 2 to 4 are read (a checkpoint's pool.arrow of version 2 still loads):
`decode` gives an older table the new columns (rule_reward = reward, scorer = ""), so every
reader sees one schema. The trainer refuses experience shards without its run id whatever their
version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import struct
from collections.abc import Iterable

import pyarrow as pa

SCHEMA_VERSION = "4"
READABLE_VERSIONS = ("2", "3", "4")
SCHEMA_VERSION_KEY = b"tandem.schema_version"
RUN_ID_KEY = b"tandem.run_id"
# On an empty shard: its number held samples its writer could not hand over again after a restart
# (a damaged outbox copy): the trainer counts it (buffer/declared_lost_shards), the hole closes.
DECLARED_LOST_KEY = b"tandem.declared_lost"

TRAILER_MAGIC = b"TNDMSHA2"
_TRAILER = struct.Struct("<8sQ32s")
TRAILER_SIZE = _TRAILER.size  # 48


class SchemaError(ValueError):
    """A shard does not match this version of the experience schema."""


class IntegrityError(SchemaError):
    """The bytes of a shard are damaged: bad or missing trailer, wrong length, digest mismatch."""


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
    rule_reward: float | None = None  # the rule reward (None: `reward` is it); version 4
    scorer: str = ""  # model_checksum of the reward model whose score `reward` is; "": the rule


SCHEMA = pa.schema(
    [
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
        pa.field("rule_reward", pa.float32(), nullable=False),
        pa.field("scorer", pa.string(), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode()},
)

_NAMES = [f.name for f in dataclasses.fields(Sample)]
assert _NAMES == SCHEMA.names, "Sample and SCHEMA must list the same columns in the same order"


ADDED_IN_4 = ("rule_reward", "scorer")  # the columns older shards lack, filled by `upgrade`


def to_table(samples: Iterable[Sample], extra_metadata: dict[str, object] | None = None) -> pa.Table:
    rows = list(samples)
    cols = {name: [getattr(s, name) for s in rows] for name in _NAMES}
    cols["rule_reward"] = [s.reward if s.rule_reward is None else s.rule_reward for s in rows]
    meta = {k.encode(): str(v).encode() for k, v in (extra_metadata or {}).items()}
    meta.update(SCHEMA.metadata)  # the schema version cannot be overridden
    return pa.Table.from_pydict(cols, schema=SCHEMA.with_metadata(meta))


def from_table(table: pa.Table) -> list[Sample]:
    table = upgrade(table)
    check_schema(table.schema)
    cols = table.to_pydict()
    return [Sample(**{name: cols[name][i] for name in _NAMES}) for i in range(table.num_rows)]


def upgrade(table: pa.Table) -> pa.Table:
    """A table of an older version with the columns it lacks (rule_reward = reward: no reward
    model scored it; scorer = ""); any other table as it is (check_schema judges it)."""
    if table.schema.names != SCHEMA.names[: -len(ADDED_IN_4)]:
        return table
    reward = table.column("reward")
    table = table.append_column(SCHEMA.field("rule_reward"), reward.cast(pa.float32()))
    return table.append_column(SCHEMA.field("scorer"), pa.array([""] * table.num_rows, pa.string()))


def check_schema(schema: pa.Schema) -> None:
    version = (schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    if version is None:
        raise SchemaError("no tandem.schema_version in the shard metadata (not a tandem shard)")
    name = version.decode(errors="replace")
    if name not in READABLE_VERSIONS:
        raise SchemaError(f"schema version {name}, this build reads {', '.join(READABLE_VERSIONS)}")
    if not schema.remove_metadata().equals(SCHEMA.remove_metadata()):
        raise SchemaError(f"columns differ from the experience schema: got {schema.names}")


def check_rows(samples: list[Sample]) -> None:
    """Per-row invariants the trainer relies on."""
    for s in samples:
        if len(s.response_ids) != len(s.behaviour_logprobs):
            raise SchemaError(
                f"{s.sample_id}: {len(s.response_ids)} response tokens but {len(s.behaviour_logprobs)} logprobs"
            )
        if not s.prompt_ids or not s.response_ids:
            raise SchemaError(f"{s.sample_id}: empty prompt or response")


def validate_table(table: pa.Table, vocab_size: int | None = None) -> None:
    """Everything the trainer relies on, checked column-wise (no per-row Python loop).

    Schema version and column types; no nulls; per row equal numbers of response tokens and
    behaviour logprobs, non-empty prompt and response; token ids in [0, vocab_size) when
    `vocab_size` is given (else >= 0); finite logprobs, rewards and temperatures.
    Raises SchemaError naming the first offending sample.
    """
    import pyarrow.compute as pc  # here: importing it costs writers ~0.3 s at start-up

    check_schema(table.schema)
    if table.num_rows == 0:
        return
    ids = table.column("sample_id")

    def where(mask, what: str) -> SchemaError:
        row = pc.index(mask.cast(pa.bool_()), True).as_py()
        sid = ids[row].as_py() if row is not None and row >= 0 else "?"
        return SchemaError(f"{sid}: {what}")

    for name in table.column_names:
        col = table.column(name)
        if col.null_count:
            raise where(col.is_null(), f"null {name}")
        if pa.types.is_list(col.type) and pc.list_flatten(col).null_count:
            raise SchemaError(f"null value inside {name}")
    n_resp = pc.list_value_length(table.column("response_ids"))
    n_lp = pc.list_value_length(table.column("behaviour_logprobs"))
    differ = pc.not_equal(n_resp, n_lp)
    if pc.any(differ).as_py():
        row = pc.index(differ, True).as_py()
        raise SchemaError(f"{ids[row].as_py()}: {n_resp[row].as_py()} response tokens but {n_lp[row].as_py()} logprobs")
    for name in ("prompt_ids", "response_ids"):
        empty = pc.equal(pc.list_value_length(table.column(name)), 0)
        if pc.any(empty).as_py():
            raise where(empty, f"empty {name}")
        flat = pc.list_flatten(table.column(name))
        mm = pc.min_max(flat)
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        if lo is not None and lo < 0:
            raise where(_row_mask(table, name, lambda v: pc.less(v, 0)), f"negative token id {lo} in {name}")
        if vocab_size is not None and hi is not None and hi >= vocab_size:
            raise where(
                _row_mask(table, name, lambda v: pc.greater_equal(v, vocab_size)),
                f"token id {hi} in {name} outside the vocabulary (size {vocab_size})",
            )
    lp = pc.list_flatten(table.column("behaviour_logprobs"))
    if len(lp) and not pc.all(pc.is_finite(lp)).as_py():
        raise where(
            _row_mask(table, "behaviour_logprobs", lambda v: pc.invert(pc.is_finite(v))), "non-finite behaviour logprob"
        )
    for name in ("reward", "rule_reward", "temperature"):
        col = table.column(name)
        if not pc.all(pc.is_finite(col)).as_py():
            raise where(pc.invert(pc.is_finite(col)), f"non-finite {name}")


def _row_mask(table: pa.Table, name: str, pred) -> pa.ChunkedArray:
    """Per row of list column `name`: does any value satisfy `pred` (only used to name a bad row)."""
    col = table.column(name).combine_chunks()
    hit = pred(col.flatten()).to_pylist()
    offsets = col.offsets.to_pylist()
    return pa.chunked_array([pa.array([any(hit[offsets[i] : offsets[i + 1]]) for i in range(len(col))])])


def encode(table: pa.Table) -> bytes:
    """The shard bytes of `table`: IPC stream payload + integrity trailer."""
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    n = sink.tell()
    sink.write(_TRAILER.pack(TRAILER_MAGIC, n, hashlib.sha256(sink.getbuffer()[:n]).digest()))
    return sink.getvalue()


def _check_trailer(trailer: bytes | memoryview, payload_len: int, digest_of_payload) -> None:
    """Raise IntegrityError unless `trailer` closes a payload of `payload_len` bytes whose sha256
    (computed lazily by `digest_of_payload()`, the expensive part) matches."""
    magic, n, digest = _TRAILER.unpack(trailer)
    if magic != TRAILER_MAGIC:
        raise IntegrityError(
            "no tandem trailer at the end of the file (truncated, written by "
            "another schema version, or not a tandem shard)"
        )
    if n != payload_len:
        raise IntegrityError(f"trailer says {n} payload bytes, the file has {payload_len} (truncated or extended)")
    got = digest_of_payload()
    if got != digest:
        raise IntegrityError(
            f"sha256 mismatch: trailer {digest.hex()[:16]}..., content {got.hex()[:16]}... (damaged bytes)"
        )


def payload(data: bytes) -> memoryview:
    """The IPC payload of shard bytes, after checking the trailer (raises IntegrityError)."""
    view = memoryview(data)
    if len(view) < TRAILER_SIZE:
        raise IntegrityError(f"{len(view)} bytes: too short for a tandem shard (truncated, or not a shard)")
    body = view[:-TRAILER_SIZE]
    _check_trailer(view[-TRAILER_SIZE:], len(body), lambda: hashlib.sha256(body).digest())
    return body


class StreamVerifier:
    """The trailer check of `payload` for a shard that arrives in pieces (the gRPC transport):
    each piece is hashed as it arrives, so no step needs the whole shard in memory, and the last
    TRAILER_SIZE bytes seen are held back as the trailer."""

    def __init__(self):
        self._sha = hashlib.sha256()
        self._tail = b""
        self.size = 0

    def update(self, piece) -> None:
        view = memoryview(piece)
        self.size += len(view)
        if len(view) >= TRAILER_SIZE:  # the held-back tail is payload after all
            self._sha.update(self._tail)
            self._sha.update(view[:-TRAILER_SIZE])
            self._tail = bytes(view[-TRAILER_SIZE:])
        else:
            joined = self._tail + bytes(view)
            self._sha.update(joined[:-TRAILER_SIZE])
            self._tail = joined[-TRAILER_SIZE:]

    def finish(self) -> None:
        """Raise IntegrityError unless the bytes so far are one whole, undamaged shard."""
        if self.size < TRAILER_SIZE:
            raise IntegrityError(f"{self.size} bytes: too short for a tandem shard (truncated, or not a shard)")
        _check_trailer(self._tail, self.size - TRAILER_SIZE, self._sha.digest)


def decode(data: bytes) -> pa.Table:
    """The table in shard bytes; checks the trailer first (IntegrityError), then parses."""
    body = payload(data)
    try:
        with pa.ipc.open_stream(pa.py_buffer(body)) as reader:
            table = reader.read_all()
        # Offsets in bounds, UTF-8 valid: a writer's bug (the digest is of what it wrote)
        # must end here, not in the compute kernels or in a decode later (~0.03 ms per MB).
        table.validate(full=True)
        return upgrade(table)
    except (pa.ArrowException, OSError, ValueError) as e:  # digest fine, not a valid stream
        raise IntegrityError(f"not a readable Arrow IPC stream: {type(e).__name__}: {e}") from e


def load_shard(data: bytes, vocab_size: int | None = None) -> pa.Table:
    """decode + validate_table: the full check a reader applies to a shard's bytes."""
    table = decode(data)
    validate_table(table, vocab_size)
    return table


# --- a group named, not sent: what trainer rank 0 hands the other ranks ------------------------
@dataclasses.dataclass(frozen=True)
class GroupRef:
    """One group a trainer rank reads itself: the file holding it (an experience shard, or the
    pool file of the checkpoint that saved it), its id, and the digest of its samples."""

    path: str  # in the run folder's filesystem, as the trainer's reader found it
    group_id: str
    digest: str  # group_digest of its samples, in order


def group_digest(samples: Iterable[Sample]) -> str:
    """sha256 over every field of every sample (floats by their exact repr): a rank that reads a
    group back checks it is the very group rank 0 dealt it."""
    h = hashlib.sha256()
    for s in samples:
        h.update(repr(dataclasses.astuple(s)).encode())
    return h.hexdigest()
