"""buffer.ledger.Ledger: the trainer's compact consumed-shard ledger."""

import json
import random
import threading

import pytest
from conftest import make_group

from buffer.config import BufferConfig
from buffer.experience.reader import ExperienceReader
from buffer.experience.retention import prune_consumed
from buffer.ledger import Ledger, as_ledger
from buffer.writer import ShardWriter


def test_in_order_adds_keep_the_json_constant_in_size():
    ledger = Ledger()
    sizes = []
    for seq in range(10_000):
        for w in range(10):
            ledger.add(f"w{w}/{seq}")
        if seq in (99, 9_999):
            sizes.append(len(json.dumps(ledger.to_json())))
    assert len(ledger) == 100_000
    assert all(e == {"below": 10_000, "above": []} for e in ledger.to_json().values())
    # one more digit in each `below` is all that 100x more shards cost
    assert sizes[1] - sizes[0] == 10 * 2 and sizes[1] < 1024, sizes


def test_out_of_order_adds_fill_gaps():
    ledger = Ledger()
    for key in ["w0/2", "w0/4", "w0/5", "w0/0"]:
        ledger.add(key)
    assert ledger.to_json() == {"w0": {"below": 1, "above": [2, 4, 5]}}
    assert ledger.next_seq("w0") == 6 and ledger.next_seq("w9") == 0
    ledger.add("w0/1")
    assert ledger.to_json() == {"w0": {"below": 3, "above": [4, 5]}}
    ledger.add("w0/3")
    assert ledger.to_json() == {"w0": {"below": 6, "above": []}}
    ledger.add("w0/3")  # again: no change
    assert len(ledger) == 6 and ledger.next_seq("w0") == 6


def test_random_order_matches_a_set():
    rng = random.Random(0)
    keys = [f"w{w}/{s}" for w in range(3) for s in range(300)]
    rng.shuffle(keys)
    ledger, seen = Ledger(), set()
    for key in keys[:600]:
        ledger.add(key)
        seen.add(key)
    assert len(ledger) == len(seen) and set(ledger) == seen
    assert all((k in ledger) == (k in seen) for k in keys)
    assert set(Ledger.from_json(json.loads(json.dumps(ledger.to_json())))) == seen


def test_membership():
    ledger = Ledger.from_json({"w0": {"below": 10, "above": [12]}, "a.b-c_1": {"below": 0, "above": [3]}})
    assert "w0/0" in ledger and "w0/9" in ledger  # below the mark
    assert "w0/12" in ledger and "a.b-c_1/3" in ledger  # above it
    for key in [
        "w0/10",
        "w0/11",
        "w0/13",
        "w1/0",
        "a.b-c_1/0",  # never seen
        "w0/007",
        "w0/-1",
        "w0",
        "/3",
        "",
        None,
        5,
    ]:  # not keys at all
        assert key not in ledger, key
    assert len(ledger) == 12
    assert ledger.has("w0", 9) and ledger.has("w0", 12) and not ledger.has("w0", 11)
    assert not ledger.has("w1", 0)


def test_old_list_format_round_trip():
    old = sorted(["w0/0", "w0/1", "w0/2", "w0/5", "w-b/0", "w-b/1"])  # as checkpoints held it
    ledger = Ledger.from_json(old)
    assert ledger.to_json() == {"w-b": {"below": 2, "above": []}, "w0": {"below": 3, "above": [5]}}
    assert sorted(ledger) == old and len(ledger) == len(old)
    again = Ledger.from_json(json.loads(json.dumps(ledger.to_json())))
    assert again.to_json() == ledger.to_json() and sorted(again) == old
    assert Ledger.from_json([]).to_json() == {}


@pytest.mark.parametrize("key", ["w0", "w0/", "/3", "w0/x", "w0/-1", "w0/007", "w 0/1", "a/b/1", "w0/1.0", "w0/³"])
def test_malformed_keys_are_named(key):
    with pytest.raises(ValueError, match="ledger key " + repr(key).replace(".", r"\.")):
        Ledger().add(key)
    with pytest.raises(ValueError, match="ledger key"):
        Ledger.from_json(["w0/0", key])


@pytest.mark.parametrize(
    "obj, names",
    [
        ("w0/1", "got str"),
        (7, "got int"),
        ({"w0": {"below": -1, "above": []}}, "'w0'"),
        ({"w0": {"below": 1}}, "'w0'"),
        ({"w0": {"below": 1, "above": [2], "x": 1}}, "'w0'"),
        ({"w0": {"below": True, "above": []}}, "'w0'"),
        ({"w0": {"below": 1, "above": ["2"]}}, "'w0'"),
        ({"w0": [1, 2]}, "'w0'"),
        ({"bad/id": {"below": 1, "above": []}}, "'bad/id'"),
        ({3: {"below": 1, "above": []}}, "worker 3"),
    ],
)
def test_malformed_json_is_named(obj, names):
    with pytest.raises(ValueError, match=names):
        Ledger.from_json(obj)


def test_json_folds_redundant_entries():
    ledger = Ledger.from_json({"w0": {"below": 3, "above": [1, 3, 4, 6]}})
    assert ledger.to_json() == {"w0": {"below": 5, "above": [6]}} and len(ledger) == 6


def test_to_json_is_a_snapshot_and_as_ledger_copies():
    ledger = Ledger.from_keys(["w0/0"])
    saved = ledger.to_json()
    copy = as_ledger(ledger)
    ledger.add("w0/2")
    assert saved == {"w0": {"below": 1, "above": []}} and "w0/2" not in copy
    assert len(as_ledger(None)) == 0
    assert as_ledger({"w0": {"below": 2, "above": []}}).to_json() == {"w0": {"below": 2, "above": []}}
    assert "w0/1" in as_ledger({"w0/1"})


def test_concurrent_readers_never_see_a_consumed_key_vanish():
    """The gRPC servicer asks `in` from its threads while the reader thread adds."""
    ledger, stop, errors = Ledger(), threading.Event(), []
    order = [s for base in range(0, 20_000, 4) for s in (base + 3, base + 1, base + 2, base)]
    done = [0]  # every seq < done[0] has been added

    def check():
        while not stop.is_set():
            upto = done[0]
            for seq in range(max(0, upto - 64), upto):
                if f"w0/{seq}" not in ledger:
                    errors.append(seq)

    threads = [threading.Thread(target=check) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i, seq in enumerate(order):
            ledger.add(f"w0/{seq}")
            if i % 4 == 3:
                done[0] = seq + 4
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors and ledger.to_json() == {"w0": {"below": 20_000, "above": []}}


def test_prune_consumed_takes_a_ledger_or_keys(tmp_path):
    root = tmp_path / "run"
    wdir = root / "experience" / "w0"
    wdir.mkdir(parents=True)
    for seq in range(4):
        (wdir / f"{seq:09d}.arrow").write_bytes(b"x")
    assert prune_consumed(str(root), Ledger.from_json({"w0": {"below": 1, "above": [2]}})) == {
        "pruned": 2,
        "bytes": 2,
        "kept": 2,
    }
    assert prune_consumed(str(root), ["w0/3"])["pruned"] == 1
    assert sorted(p.name for p in wdir.iterdir()) == ["000000001.arrow"]


def test_reader_resumes_from_either_checkpoint_format(tmp_path):
    """What trainer.main saves (to_json, through JSON) and old checkpoints' key lists both
    resume a reader that reads only the shards not consumed, and probes from the ledger."""
    root = str(tmp_path / "run")
    cfg = BufferConfig(discovery="poll", poll_interval=0.02, flush_interval=3600.0, flush_samples=1)
    writer = ShardWriter.at(root, "w0", cfg)
    for g in range(5):
        writer.add_group(make_group("w0", "t", g, 0, 2))
    reader = ExperienceReader(root, cfg, max_staleness=100)
    try:
        assert len(reader.next_batch(5, 0, timeout_s=5)) == 5
        saved = json.loads(json.dumps(reader.consumed.to_json()))
    finally:
        reader.close()
    assert saved == {"w0": {"below": 5, "above": []}}
    writer.add_group(make_group("w0", "t", 5, 0, 2))
    for ledger in (saved, [f"w0/{s}" for s in range(5)]):
        resumed = ExperienceReader(root, cfg, max_staleness=100)
        try:
            resumed.consumed = ledger  # as Trainer._resume does
            assert [k for k, _ in resumed.discover()] == ["w0/5"]
            assert resumed._next == {"w0": 6}
            [g] = resumed.next_batch(1, 0, timeout_s=5)
            assert g.samples[0].prompt_id == "w0/t/5" and "w0/5" in resumed.consumed
        finally:
            resumed.close()
