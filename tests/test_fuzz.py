"""Property-based fuzzing (hypothesis) of every input a role takes from outside: shard bytes and
Arrow tables (the reader), control files, config values, parquet rows, reward values and gRPC
streams. The property is always the same: each input ends in a clear error naming it (or a
counted skip), never in another exception, and nothing is written for a refused input.

Examples per target are bounded (FUZZ_EXAMPLES scales them all) so the suite runs in a few
minutes on a 2-core CI machine; `--hypothesis-show-statistics` prints the cases tried.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import string
import tempfile
import time
import typing

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import free_port, make_group
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from buffer.channel import WRITER_KEY
from buffer.config import BufferConfig
from buffer.experience.net_server import ShardServer
from buffer.experience.reader import ExperienceReader
from launch.pool import PoolConfig
from protocol import config as pconfig
from protocol import control
from protocol.config import ConfigError, build
from protocol.experience import (
    _TRAILER,
    SCHEMA,
    SCHEMA_VERSION,
    TRAILER_MAGIC,
    Sample,
    SchemaError,
    encode,
    from_table,
    load_shard,
    to_table,
)
from protocol.shard_stream import PUSH_METHOD
from rollout import builtin_task, reward
from rollout.config import ValidatorConfig, WorkerConfig
from rollout.dataset import DatasetError, load_prompts
from trainer.config import TrainerConfig

SCALE = float(os.environ.get("FUZZ_EXAMPLES", "1"))


def fuzz(n: int):
    # derandomize: the same cases on every run (a CI failure reproduces); deadline=None: the
    # config builds and the live gRPC server take ~0.1 s a case on a loaded 2-core machine
    return settings(
        max_examples=max(1, int(n * SCALE)),
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture,
        ],
    )


VOCAB = 64
GOOD = encode(to_table(make_group("w0", 0, 0, 0, 4)))


def _sign(payload: bytes) -> bytes:
    """`payload` closed by a valid trailer: damage that the sha256 cannot catch (a buggy or
    hostile writer), so the Arrow parser and the value checks get to see it."""
    return payload + _TRAILER.pack(TRAILER_MAGIC, len(payload), hashlib.sha256(payload).digest())


# --- shard bytes: the reader ---------------------------------------------------------------


def _mutated(data: st.DataObject) -> bytes:
    body = bytearray(GOOD[:-48])
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
    if kind == "flip":
        for pos in data.draw(st.lists(st.integers(0, len(body) - 1), min_size=1, max_size=8)):
            body[pos] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        del body[data.draw(st.integers(0, len(body) - 1)) :]
    elif kind == "extend":
        body += data.draw(st.binary(min_size=1, max_size=64))
    else:
        at = data.draw(st.integers(0, len(body)))
        body[at:at] = data.draw(st.binary(min_size=1, max_size=64))
    return _sign(bytes(body)) if data.draw(st.booleans()) else bytes(body) + GOOD[-48:]


@fuzz(600)
@given(st.data())
def test_shard_bytes(data):
    """Any bytes: load_shard raises SchemaError (IntegrityError is one) or returns a table
    whose rows hold every invariant the trainer relies on."""
    raw = data.draw(
        st.one_of(st.binary(max_size=600), st.builds(_mutated, st.just(data)), st.binary(max_size=200).map(_sign))
    )
    try:
        table = load_shard(raw, VOCAB)
    except SchemaError:
        return
    _holds_invariants(from_table(table))


def _holds_invariants(samples: list[Sample]) -> None:
    for s in samples:
        assert s.prompt_ids and s.response_ids and len(s.response_ids) == len(s.behaviour_logprobs)
        assert all(0 <= t < VOCAB for t in s.prompt_ids + s.response_ids)
        assert all(math.isfinite(v) for v in [*s.behaviour_logprobs, s.reward, s.temperature])


_i32 = st.integers(-(2**31), 2**31 - 1)
_f = st.floats(allow_nan=True, allow_infinity=True, width=32)
_sample = st.builds(
    Sample,
    sample_id=st.text(max_size=8),
    group_id=st.text(max_size=8),
    prompt_id=st.text(max_size=8),
    worker_id=st.just("w0"),
    weight_version=st.integers(-(2**63), 2**63 - 1),
    prompt_ids=st.lists(st.one_of(st.integers(0, VOCAB - 1), _i32), max_size=6),
    response_ids=st.lists(st.one_of(st.integers(0, VOCAB - 1), _i32), max_size=6),
    behaviour_logprobs=st.lists(_f, max_size=6),
    reward=_f,
    finish_reason=st.sampled_from(["stop", "length", ""]),
    temperature=_f,
    data_source=st.text(max_size=8),
    created_at=st.floats(),
    finished_at=st.floats(),
)


@fuzz(400)
@given(st.lists(_sample, max_size=6))
def test_arrow_tables(samples):
    """Tables of the right schema with any values: accepted only when every row is sound."""
    table = to_table(samples)
    try:
        got = from_table(load_shard(encode(table), VOCAB))
    except SchemaError:
        return
    _holds_invariants(got)
    assert len(got) == len(samples)


_arrow_types = st.sampled_from(
    [
        pa.int8(),
        pa.int32(),
        pa.int64(),
        pa.float32(),
        pa.float64(),
        pa.string(),
        pa.binary(),
        pa.bool_(),
        pa.list_(pa.int32()),
        pa.list_(pa.float32()),
        pa.list_(pa.string()),
        pa.null(),
    ]
)


@fuzz(150)
@given(
    st.lists(st.tuples(st.sampled_from(SCHEMA.names + ["extra"]), _arrow_types), max_size=16, unique_by=lambda c: c[0]),
    st.integers(0, 3),
    st.booleans(),
)
def test_arrow_schemas(columns, rows, versioned):
    """Any other schema (missing, extra, retyped columns; no version) is refused by name."""
    fields = [pa.field(n, t) for n, t in columns]
    meta = SCHEMA.metadata if versioned else None
    table = pa.table({f.name: pa.nulls(rows, f.type) for f in fields}, schema=pa.schema(fields, metadata=meta))
    assume(not table.schema.remove_metadata().equals(SCHEMA.remove_metadata()))
    with pytest.raises(SchemaError):
        load_shard(encode(table), VOCAB)


@fuzz(60)
@given(st.data())
def test_reader_quarantines_bad_shards_and_goes_on(data):
    """The reader over a folder: a bad shard is counted, quarantined with its reason, and the
    good shard after it is still read; nothing else is written."""
    raw = data.draw(st.one_of(st.binary(max_size=300), st.builds(_mutated, st.just(data))))
    with tempfile.TemporaryDirectory() as root:
        wdir = os.path.join(root, "experience", "w0")
        os.makedirs(wdir)
        with open(os.path.join(wdir, "000000000.arrow"), "wb") as f:
            f.write(raw)
        with open(os.path.join(wdir, "000000001.arrow"), "wb") as f:
            f.write(encode(to_table(make_group("w0", 0, 1, 0, 4), {"tandem.worker_id": "w0", "tandem.shard_seq": 1})))
        reader = ExperienceReader(
            root, BufferConfig(discovery="poll", poll_interval=0.01), max_staleness=10, vocab_size=60_000
        )
        try:
            groups = reader.next_batch(1, current_version=0, timeout_s=30)
            ok = reader.stats["bad_shards"] == 0
            if ok:  # shard 0 passed; the reader reads no further than a step needs: ask again
                groups += reader.next_batch(1, current_version=0, timeout_s=30)
                assert reader.stats["shards_read"] == 2
            else:
                assert reader.stats["bad_shards"] == 1 and reader.stats["quarantined_shards"] == 1
                assert sorted(os.listdir(os.path.join(root, "quarantine", "w0"))) == [
                    "000000000.arrow",
                    "000000000.arrow.reason.txt",
                ]
            assert groups[-1].samples[0].prompt_id == "w0/0/1"  # the good shard after it
            assert all(g.samples[0].prompt_id in ("w0/0/0", "w0/0/1") for g in groups)
        finally:
            reader.close()
        assert sorted(os.listdir(root)) == (["experience"] if ok else ["experience", "quarantine"])


# --- control files ---------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["action", "count", "id", "commands", "x"]), inner, max_size=4)
    ),
    max_leaves=12,
)
_command = st.fixed_dictionaries(
    {"action": st.sampled_from(["add", "remove", "grow", 1])},
    optional={
        "count": st.one_of(st.integers(-5, 2000), st.floats(), st.booleans(), st.text(max_size=3)),
        "id": st.one_of(st.text(max_size=6), st.integers()),
    },
)


@fuzz(600)
@given(
    st.one_of(
        st.binary(max_size=200),
        _json.map(lambda o: json.dumps(o).encode()),
        _command.map(lambda o: json.dumps(o).encode()),
        st.lists(_command, max_size=4).map(lambda c: json.dumps({"commands": c}).encode()),
        st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
    )
)
def test_control_files(raw):
    """What a pool reads from control.json: commands it can apply, or one ControlError."""
    try:
        cmds = control.parse(raw)
    except control.ControlError as e:
        assert str(e).startswith("control file")
        return
    assert len({c.id for c in cmds}) == len(cmds)
    for c in cmds:
        assert c.action in control.ACTIONS and 1 <= c.count <= control.MAX_COUNT


# --- config values: every field of every role --------------------------------------------------

REQUIRED = {
    TrainerConfig: {"root": "/r", "actor_rollout_ref.model.path": "/m"},
    WorkerConfig: {"root": "/r", "data.train_files": "[/d.parquet]"},
    PoolConfig: {"root": "/r"},
    ValidatorConfig: {"root": "/r", "data.val_files": "[/v.parquet]"},
}
# The validator shares its sections with the worker; only its own keys (and the required
# val_files) are swept again for it.
FIELDS = [
    (cls, name, f, tp)
    for cls in REQUIRED
    for name, f, tp in pconfig.leaves(cls)
    if cls is not ValidatorConfig or name.startswith("validator.") or name == "data.val_files"
]
_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.one_of(st.integers(), st.text(max_size=4), st.floats()), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(
        [
            "nan",
            "inf",
            "-inf",
            "1e999",
            "-1",
            "0",
            "1",
            "0.5",
            "[]",
            "[1, 2]",
            "true",
            "none",
            "",
            "../x",
            "w0\n",
            "cuda:1",
            "[0.9, 0.999]",
            "{a: 1}",
        ]
    ),
)


def _bounds_hold(value, meta) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        return False
    checks = [("ge", lambda v, b: v >= b), ("gt", lambda v, b: v > b), ("le", lambda v, b: v <= b)]
    return all(meta.get(k) is None or ok(value, meta[k]) for k, ok in checks) and (
        meta.get("choices") is None or value in meta["choices"]
    )


def _config_case(field, value, from_yaml: bool) -> None:
    cls, name, f, tp = field
    given_value = value if from_yaml else (value if isinstance(value, str) else json.dumps(value))
    try:
        cfg = build(cls, {**REQUIRED[cls], name: given_value})
    except ConfigError as e:
        assert name in str(e) or name.rsplit(".", 1)[-1] in str(e), (name, str(e))
        return
    got = cfg
    for part in name.split("."):
        got = getattr(got, part)
    base = typing.get_args(tp)[0] if typing.get_origin(tp) in (typing.Union, type(int | None)) else tp
    if got is not None and base in (int, float, str, bool):
        assert type(got) is base or (base is float and type(got) is int), (name, got)
        assert _bounds_hold(got, f.metadata), (name, got)


@fuzz(250)
@given(st.sampled_from(FIELDS), _value, st.booleans())
def test_config_values(field, value, from_yaml):
    """Any value for any field, from the command line (text) or a YAML file (typed): a config
    whose every value is of its type, finite and in bounds, or a ConfigError naming the field."""
    _config_case(field, value, from_yaml)


def _hostile(tp) -> list:
    base = typing.get_args(tp)[0] if typing.get_origin(tp) in (typing.Union, type(int | None)) else tp
    return {float: ["nan", float("inf")], int: ["1.5", 10**30], bool: ["maybe"], str: [["a", "b"]]}.get(
        base, [{"x": 1}]
    )


@pytest.mark.parametrize("field", FIELDS, ids=[f"{c.__name__}:{n}" for c, n, _, _ in FIELDS])
def test_every_config_field_refuses_a_hostile_value(field):
    """Every field, swept: non-finite floats, non-integers and overflows for ints, text for
    bools, a list for strings, a mapping for the rest, each from the command line and YAML."""
    for value in _hostile(field[3]):
        for from_yaml in (False, True):
            _config_case(field, value, from_yaml)


# --- parquet rows --------------------------------------------------------------------------

_text = st.text(alphabet=string.printable + "éø漢😀\x00", max_size=12)
_message = st.fixed_dictionaries(
    {}, optional={"role": st.one_of(_text, st.none()), "content": st.one_of(_text, st.none())}
)
_row = st.fixed_dictionaries(
    {},
    optional={
        "data_source": st.one_of(st.sampled_from(["tandem/copy", "openai/gsm8k"]), _text, st.none()),
        "prompt": st.one_of(st.lists(_message, max_size=3), st.none(), _text, st.integers()),
        "reward_model": st.one_of(
            st.fixed_dictionaries(
                {}, optional={"ground_truth": st.one_of(_text, st.lists(st.integers(), max_size=2)), "style": _text}
            ),
            st.none(),
            _text,
        ),
        "extra_info": st.one_of(st.fixed_dictionaries({}, optional={"index": st.integers()}), st.none(), _text),
    },
)


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_task.build_tokenizer()


@fuzz(300)
@given(rows=st.lists(_row, min_size=1, max_size=4))
def test_parquet_rows(tokenizer, rows):
    """Rows of a verl parquet with fields missing, null, mistyped or odd: prompts, or a
    DatasetError naming the file and the row."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.parquet")
        try:
            pq.write_table(pa.Table.from_pylist(rows), path)
        except (pa.ArrowException, TypeError, OverflowError):
            assume(False)  # not writable as one parquet table: no file a worker could meet
        try:
            prompts = load_prompts([path], tokenizer, "prompt", 64)
        except DatasetError as e:
            assert path in str(e), str(e)
            return
    assert prompts and all(p.token_ids and isinstance(p.extra_info, dict) for p in prompts)


# --- reward values -------------------------------------------------------------------------

_reward = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.integers(-(10**400), 10**400),
    st.booleans(),
    st.none(),
    st.text(max_size=6),
    st.sampled_from(["nan", "1.5", 1e39, -1e39, 3.4028235e38, float("inf")]),
    st.dictionaries(
        st.sampled_from(["score", "acc"]), st.one_of(st.floats(allow_nan=True), st.text(max_size=3)), max_size=2
    ),
    st.lists(st.floats(), max_size=2),
)


@fuzz(600)
@given(_reward)
def test_reward_values(value):
    """Whatever a reward function returns: a float that float32 holds finitely, or a
    RewardError (the worker drops that sample and counts it)."""
    try:
        got = reward.check_value(
            value["score"] if isinstance(value, dict) and "score" in value else value, "tests/fuzz"
        )  # as resolve()'s score does
    except reward.RewardError as e:
        assert "tests/fuzz" in str(e)
        return
    assert isinstance(got, float) and math.isfinite(got) and abs(got) <= reward.FLOAT32_MAX
    assert math.isfinite(pa.array([got], pa.float32())[0].as_py())  # the shard's column


# --- gRPC streams --------------------------------------------------------------------------

TOKEN = "fuzz-token"


def _serve(tmp_path_factory, idle_timeout_s: float):
    d = tmp_path_factory.mktemp("grpc")
    (d / "token").write_text(TOKEN)
    port = free_port()
    cfg = BufferConfig(
        grpc_bind=f"127.0.0.1:{port}",
        grpc_token_file=str(d / "token"),
        transport="grpc",
        grpc_max_shard_mb=1,
        grpc_idle_timeout_s=idle_timeout_s,
        grpc_server_threads=4,
        grpc_claim_ttl_s=0.01,
    )
    srv = ShardServer(str(d / "trainer"), cfg)
    yield srv, port, d / "trainer"
    srv.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """For streams that never pause: the default idle timeout. At 0.5 s a push whose client
    thread was not scheduled for half a second (load average 13) was cancelled mid-stream."""
    yield from _serve(tmp_path_factory, BufferConfig().grpc_idle_timeout_s)


@pytest.fixture(scope="module")
def stall_server(tmp_path_factory):
    """For the stalled pushes: cancelled after 0.5 s of silence, so each case takes ~1 s."""
    yield from _serve(tmp_path_factory, 0.5)


def _header(worker, seq, size, schema=SCHEMA_VERSION) -> bytes:
    from protocol import experience_pb2 as pb

    return pb.ShardChunk(
        header=pb.ShardHeader(worker_id=worker, seq=seq, size=size, schema_version=schema)
    ).SerializeToString()


def _data(b: bytes) -> bytes:
    from protocol import experience_pb2 as pb

    return pb.ShardChunk(data=b).SerializeToString()


_seq = st.integers(0, 2**64 - 1)
_message_raw = st.one_of(
    st.builds(_data, st.binary(max_size=64)),
    st.builds(
        _header,
        st.one_of(st.sampled_from(["f0", "f1"]), st.text(max_size=8)),
        _seq,
        st.one_of(st.integers(0, 2**64 - 1), st.just(len(GOOD))),
        st.sampled_from([SCHEMA_VERSION, "1", "", "9"]),
    ),
    st.binary(max_size=32),
)  # garbage that need not parse as a ShardChunk


def _call(port, messages, token, timeout=20, ack=None):
    """A raw push (messages as bytes: garbage allowed); its status code. `ack` (a list) gets
    the parsed acknowledgement of a successful one."""
    from protocol import experience_pb2 as pb

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        push = ch.stream_unary(PUSH_METHOD, request_serializer=lambda b: b, response_deserializer=pb.Ack.FromString)
        try:
            got = push(
                iter(messages), timeout=timeout, metadata=[("authorization", f"Bearer {token}"), (WRITER_KEY, "fuzz")]
            )
        except grpc.RpcError as e:
            return e.code()
    if ack is not None:
        ack.append(got)
    return grpc.StatusCode.OK


def _stored(root) -> dict[str, bytes]:
    exp = root / "experience"
    return {
        f"{w}/{n}": (exp / w / n).read_bytes()
        for w in (os.listdir(exp) if exp.exists() else [])
        if (exp / w).is_dir()
        for n in os.listdir(exp / w)
    }


@fuzz(300)
@given(st.data())
def test_grpc_streams(server, data):
    """Random streams (headers, data, garbage, in any order and size, right or wrong tokens):
    every push ends in a status, only a whole valid shard is stored, and nothing else is."""
    srv, port, root = server
    seq = data.draw(st.integers(0, 2**40))
    token = data.draw(st.one_of(st.just(TOKEN), st.text(string.ascii_letters, max_size=12)))
    honest = data.draw(st.booleans())
    if honest:  # a valid shard, possibly chunked oddly or damaged on the way
        cut = data.draw(st.lists(st.integers(0, len(GOOD)), max_size=4, unique=True))
        cuts = [0, *sorted(cut), len(GOOD)]
        body = bytearray(GOOD)
        if data.draw(st.booleans()):
            body[data.draw(st.integers(0, len(body) - 1))] ^= 0x5A
        msgs = [_header("f0", seq, len(GOOD))] + [_data(bytes(body[a:b])) for a, b in zip(cuts, cuts[1:])]
        if data.draw(st.booleans()):
            msgs.insert(data.draw(st.integers(1, len(msgs))), data.draw(_message_raw))
    else:
        msgs = data.draw(st.lists(_message_raw, max_size=6))
    before, ack = _stored(root), []
    code = _call(port, msgs, token, ack=ack)
    after = _stored(root)
    new = {k: v for k, v in after.items() if k not in before}
    assert all(before[k] == after[k] for k in before)  # nothing stored is ever changed
    if code == grpc.StatusCode.OK:  # a whole valid shard, or the resend of a stored one
        key = f"{ack[0].worker_id}/{ack[0].seq:09d}.arrow"
        assert token == TOKEN and after[key] == GOOD
        assert new == ({} if ack[0].duplicate else {key: GOOD}), (ack, new)
    else:
        assert code in (
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.DATA_LOSS,
        ), code
        assert not new
    exp = root / "experience"
    leftovers = [n for n in os.listdir(exp) if not (exp / n).is_dir()] if exp.exists() else []
    assert not leftovers  # no temporary outlives its push
    assert {k.split("/")[0] for k in after} <= {"f0"}, "a folder for a refused push"


@fuzz(6)
@given(st.integers(0, 2), st.floats(0.7, 1.5))
def test_grpc_stalls(stall_server, after, pause):
    """A client that stops sending (after the header, or mid-shard) is cancelled after the
    idle timeout; the server goes on serving honest pushes at once."""
    srv, port, root = stall_server
    msgs = [_header("f1", 7, len(GOOD)), _data(GOOD[:100])][:after]

    def stalled():
        yield from msgs
        time.sleep(pause + 30)  # well past the 0.5 s idle timeout

    t0 = time.monotonic()
    code = _call(port, stalled(), TOKEN, timeout=60)
    assert code == grpc.StatusCode.CANCELLED and time.monotonic() - t0 < 20, code
    assert _call(port, [_header("f1", 8, len(GOOD)), _data(GOOD)], TOKEN) == grpc.StatusCode.OK
    assert not (root / "experience" / "f1" / "000000007.arrow").exists()
