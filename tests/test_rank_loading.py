"""Per-rank loading: trainer rank 0 deals groups by name (GroupRef: file, group id, digest) and
each rank reads its own from the run folder, from the shard or, once a checkpoint saved the
pool, from the checkpoint's pool file; a changed or missing file is refused, naming it."""

from __future__ import annotations

import os

import pytest
from conftest import make_group

from buffer.checkpoints import pool_file
from buffer.config import BufferConfig
from buffer.experience.reader import read_groups
from buffer.run import setup_trainer_run
from buffer.writer import ShardWriter
from protocol.experience import encode, to_table
from trainer.checkpoint import pool_path


def _run_with_shards(tmp_path, groups=6):
    root = str(tmp_path / "run")
    run = setup_trainer_run(root)
    run_id = run.state.ensure_run_id()
    writer = ShardWriter.at(root, "w0", BufferConfig(flush_samples=4 * 3))
    for i in range(groups):
        writer.add_group(make_group("w0", 0, i, 0, n=3))
    writer.flush()
    reader = run.reader(BufferConfig(poll_interval=0.05), max_staleness=10, run_id=run_id)
    return root, reader


def test_ranks_read_the_groups_rank0_names(tmp_path):
    root, reader = _run_with_shards(tmp_path)
    try:
        groups = reader.next_batch(3, current_version=0, timeout_s=10)  # the shard's 4th group stays pooled
        refs = [g.ref() for g in groups[1::2]]  # rank 1 of 2
        assert {r.path for r in refs} and all(r.path.endswith(".arrow") for r in refs)
        got = read_groups(root, refs)
        assert [g.samples for g in got] == [g.samples for g in groups[1::2]]
        assert [g.group_id for g in got] == [r.group_id for r in refs]
        # The pooled groups after a checkpoint: their shards may be pruned, the pool file holds them.
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        pooled = list(reader.pool)
        assert pooled
        with open(pool_file(str(ckpt)), "wb") as f:  # what trainer/checkpoint.save writes
            f.write(encode(to_table([s for g in pooled for s in g.samples])))
        shards = {g.source for g in [*groups, *pooled]}
        for g in pooled:  # what Trainer.save_checkpoint does once the checkpoint is committed
            g.source = pool_path(str(ckpt))
        for shard in shards:  # then retention prunes the consumed shards
            os.remove(shard)
        assert [g.samples for g in read_groups(root, [g.ref() for g in pooled])] == [g.samples for g in pooled]
    finally:
        reader.close()


def test_a_changed_or_missing_file_is_refused(tmp_path):
    root, reader = _run_with_shards(tmp_path, groups=4)
    try:
        groups = reader.next_batch(4, current_version=0, timeout_s=10)
        ref = groups[2].ref()
        changed = [s for g in groups for s in g.samples]
        changed[7].reward += 1.0  # group 2's second sample, same ids: a valid file, another group
        with open(ref.path, "wb") as f:
            f.write(encode(to_table(changed)))
        with pytest.raises(RuntimeError, match="digest differs"):
            read_groups(root, [ref])
        os.remove(ref.path)
        with pytest.raises(RuntimeError, match=f"cannot read group {ref.group_id} from {ref.path}"):
            read_groups(root, [ref])
    finally:
        reader.close()
