"""protocol.experience: the Arrow schema and its round trip through the IPC stream format."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest
from conftest import make_group

from protocol.experience import (
    SCHEMA,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    Sample,
    SchemaError,
    check_rows,
    check_schema,
    decode,
    encode,
    from_table,
    to_table,
)

FLOAT32_FIELDS = {"reward", "temperature", "rule_reward"}


def _assert_same(got: Sample, want: Sample) -> None:
    for f in dataclasses.fields(Sample):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "rule_reward" and b is None:  # unset: the reward is the rule's (to_table records it)
            b = want.reward
        if f.name == "behaviour_logprobs":
            assert len(a) == len(b), f.name
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7), f.name
        elif f.name in FLOAT32_FIELDS:
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7), f.name
        else:
            assert type(a) is type(b), f.name
            assert a == b, f.name


def _samples() -> list[Sample]:
    return make_group("w0", 3, 0, version=7, n=4) + make_group("w0", 3, 1, version=7, n=3)


def test_round_trip_equals_input():
    samples = _samples()
    table = to_table(samples, {"tandem.worker_id": "w0", "tandem.shard_seq": 12})
    data = encode(table)
    assert isinstance(data, bytes) and len(data) > 0
    back_table = decode(data)
    assert back_table.num_rows == len(samples)
    assert back_table.schema.metadata[SCHEMA_VERSION_KEY] == SCHEMA_VERSION.encode()
    assert back_table.schema.metadata[b"tandem.worker_id"] == b"w0"
    assert back_table.schema.metadata[b"tandem.shard_seq"] == b"12"
    back = from_table(back_table)
    assert len(back) == len(samples)
    for got, want in zip(back, samples):
        _assert_same(got, want)
    check_rows(back)


def test_round_trip_float32_columns_are_rounded_not_exact():
    """The logprob column really is float32: values come back rounded, within tolerance."""
    s = make_group("w0", 0, 0, version=0, n=1, response_len=4)[0]
    back = from_table(decode(encode(to_table([s]))))[0]
    want32 = pa.array(s.behaviour_logprobs, pa.float32()).to_pylist()
    assert back.behaviour_logprobs == want32
    assert back.created_at == s.created_at  # float64 column: exact


def test_to_table_uses_the_schema():
    table = to_table(_samples())
    assert table.schema.remove_metadata().equals(SCHEMA.remove_metadata())
    check_schema(table.schema)


def test_empty_round_trip():
    assert from_table(decode(encode(to_table([])))) == []


def _table() -> pa.Table:
    return to_table(_samples())


def test_check_schema_rejects_missing_version_metadata():
    table = _table().replace_schema_metadata(None)
    with pytest.raises(SchemaError, match="schema_version"):
        check_schema(table.schema)
    with pytest.raises(SchemaError):
        from_table(decode(encode(table)))


def test_check_schema_rejects_other_metadata_without_version():
    table = _table().replace_schema_metadata({b"tandem.worker_id": b"w0"})
    with pytest.raises(SchemaError, match="schema_version"):
        check_schema(table.schema)


def test_check_schema_rejects_wrong_version():
    wrong = str(int(SCHEMA_VERSION) + 1).encode()
    table = _table().replace_schema_metadata({SCHEMA_VERSION_KEY: wrong})
    with pytest.raises(SchemaError, match="schema version"):
        check_schema(table.schema)
    with pytest.raises(SchemaError):
        from_table(decode(encode(table)))


def test_check_schema_rejects_missing_column():
    table = _table().drop_columns(["reward"])
    assert table.schema.metadata[SCHEMA_VERSION_KEY] == SCHEMA_VERSION.encode()
    with pytest.raises(SchemaError, match="columns differ"):
        check_schema(table.schema)
    with pytest.raises(SchemaError):
        from_table(decode(encode(table)))


def test_check_schema_rejects_renamed_column():
    names = ["logprobs" if n == "behaviour_logprobs" else n for n in SCHEMA.names]
    table = _table()
    table = table.rename_columns(names).replace_schema_metadata(table.schema.metadata)
    assert table.schema.metadata[SCHEMA_VERSION_KEY] == SCHEMA_VERSION.encode()
    with pytest.raises(SchemaError, match="columns differ"):
        check_schema(table.schema)
    with pytest.raises(SchemaError):
        from_table(decode(encode(table)))


def test_check_schema_rejects_changed_type():
    table = _table()
    i = table.schema.get_field_index("weight_version")
    field = pa.field("weight_version", pa.int32(), nullable=False)
    table = table.set_column(i, field, table.column(i).cast(pa.int32()))
    with pytest.raises(SchemaError):
        check_schema(table.schema)


def test_check_rows_rejects_mismatched_logprobs():
    samples = _samples()
    samples[2] = dataclasses.replace(samples[2], behaviour_logprobs=samples[2].behaviour_logprobs[:-1])
    with pytest.raises(SchemaError, match=samples[2].sample_id):
        check_rows(samples)


def test_check_rows_rejects_extra_logprob():
    s = _samples()[0]
    bad = dataclasses.replace(s, behaviour_logprobs=s.behaviour_logprobs + [-1.0])
    with pytest.raises(SchemaError, match="logprobs"):
        check_rows([bad])


def test_check_rows_rejects_empty_prompt_or_response():
    s = _samples()[0]
    with pytest.raises(SchemaError, match="empty"):
        check_rows([dataclasses.replace(s, prompt_ids=[])])
    with pytest.raises(SchemaError, match="empty"):
        check_rows([dataclasses.replace(s, response_ids=[], behaviour_logprobs=[])])


def test_check_rows_accepts_valid_rows():
    check_rows(_samples())  # raises on failure


def test_a_version_3_shard_reads_with_the_rule_reward_and_no_scorer():
    """Schema 4 (issue 28) adds rule_reward and scorer at the end; a shard written before them
    decodes into the current schema: its reward was the rule's, no reward model scored it."""
    import pyarrow as pa

    from protocol.experience import ADDED_IN_4, SCHEMA

    samples = [dataclasses.replace(s, rule_reward=0.25, scorer="abc") for s in _samples()]
    new = from_table(decode(encode(to_table(samples))))
    assert {(s.rule_reward, s.scorer) for s in new} == {(0.25, "abc")}
    table = to_table(_samples()).drop_columns(list(ADDED_IN_4))
    old = table.replace_schema_metadata({**table.schema.metadata, SCHEMA_VERSION_KEY: b"3"})
    back_table = decode(encode(old))
    assert back_table.schema.remove_metadata().equals(SCHEMA.remove_metadata())
    back = from_table(back_table)
    assert [s.scorer for s in back] == [""] * len(back)
    assert [s.rule_reward for s in back] == pytest.approx([s.reward for s in _samples()])
    assert isinstance(back_table.column("scorer"), pa.ChunkedArray)
