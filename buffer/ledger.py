"""The trainer's consumption ledger: which shards "<worker>/<seq>" were read (or rejected).

A set of every key grows without bound in a long run and is saved in every checkpoint. Shards
are consumed mostly in seq order per worker, so per worker the ledger keeps a high-water mark
`below` (every seq < below is consumed) plus the few consumed seqs above it (read past a gap
that a full listing found, or read while an older shard was retried). Adding the missing seq
closes the gap and advances `below`, so the saved form stays a few bytes per worker:

    {"w0": {"below": 120, "above": [122]}}

`Ledger.from_json` also reads the old checkpoint format, a list of keys, so old runs resume.

Thread safety: the gRPC servicer asks `key in ledger` from its threads while the reader thread
adds. Each add changes state with single assignments in an order that never makes a consumed
key look unconsumed (`below` is raised before the seqs it covers leave `above`); there is only
one writer (the reader thread), which also is the only caller of `to_json`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from buffer.layout import check_worker_id


def shard_key(worker_id: str, seq: int) -> str:
    """The ledger key of a shard: "<worker>/<seq>" (as in ExperienceReader.consumed)."""
    return f"{worker_id}/{seq}"


def parse_key(key) -> tuple[str, int]:
    """(worker, seq) of a key exactly as `shard_key` writes it; ValueError otherwise."""
    if not isinstance(key, str) or "/" not in key:
        raise ValueError(f"ledger key {key!r}: expected a string '<worker>/<seq>'")
    worker, _, seq = key.rpartition("/")  # worker ids never contain '/', see layout._WORKER_ID
    try:
        check_worker_id(worker)
    except ValueError as e:
        raise ValueError(f"ledger key {key!r}: {e}") from None
    if not _canonical_seq(seq):
        raise ValueError(f"ledger key {key!r}: seq must be a non-negative integer without leading zeros")
    return worker, int(seq)


def _canonical_seq(seq: str) -> bool:
    # "7", not "007" or "٧": a set of key strings would not equate those with "w0/7" either
    return seq.isascii() and seq.isdigit() and (seq[0] != "0" or seq == "0")


class _Worker:
    """One worker's consumed seqs: all of range(below), plus `above` (each > below)."""

    __slots__ = ("above", "below")

    def __init__(self, below: int = 0):
        self.below = below
        self.above: set[int] = set()

    def __contains__(self, seq: int) -> bool:
        # `above` before `below`: add() raises `below` before it drops seqs from `above`
        return seq in self.above or seq < self.below

    def add(self, seq: int) -> bool:
        """Record `seq`; False if it was already recorded."""
        if seq in self:
            return False
        if seq != self.below:
            self.above.add(seq)
            return True
        below = seq + 1
        while below in self.above:
            below += 1
        self.below = below  # first: covered seqs stay members while they leave `above`
        self.above = {s for s in self.above if s > below}
        return True

    def next_seq(self) -> int:
        return max(self.above) + 1 if self.above else self.below


class Ledger:
    """Consumed shard keys "<worker>/<seq>", stored per worker as a mark plus a small set.

    Behaves as a growing set of keys: `add`, `in`, `len`, iteration (O(consumed): tests and
    debugging only). `in` is False for anything that is not a well-formed key."""

    def __init__(self):
        self._workers: dict[str, _Worker] = {}
        self._count = 0

    def add(self, key: str) -> None:
        worker, seq = parse_key(key)
        self._add(worker, seq)

    def _add(self, worker: str, seq: int) -> None:
        entry = self._workers.get(worker)
        if entry is None:  # publish the entry only once it holds the seq (see module doc)
            entry = _Worker()
            entry.add(seq)
            self._workers[worker] = entry
            self._count += 1
        elif entry.add(seq):
            self._count += 1

    def __contains__(self, key) -> bool:
        # Hot (reader listings, gRPC pushes), so no full parse: only valid worker ids are stored.
        if not isinstance(key, str):
            return False
        worker, _, seq = key.rpartition("/")
        entry = self._workers.get(worker)
        return entry is not None and _canonical_seq(seq) and int(seq) in entry

    def has(self, worker: str, seq: int) -> bool:
        """`shard_key(worker, seq) in self` without building the key."""
        entry = self._workers.get(worker)
        return entry is not None and seq in entry

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        for worker in sorted(self._workers):
            entry = self._workers[worker]
            for seq in itertools.chain(range(entry.below), sorted(entry.above)):
                yield shard_key(worker, seq)

    def __repr__(self) -> str:
        return f"Ledger({len(self._workers)} workers, {self._count} shards)"

    def workers(self) -> list[str]:
        return list(self._workers)

    def next_seq(self, worker: str) -> int:
        """One past the highest consumed seq of `worker` (0 if none): where probing resumes."""
        entry = self._workers.get(worker)
        return entry.next_seq() if entry is not None else 0

    def copy(self) -> Ledger:
        return Ledger.from_json(self.to_json())

    # --- checkpoint form ---------------------------------------------------------------------
    def to_json(self) -> dict:
        """A fresh JSON-ready dict (a snapshot: later adds do not change it)."""
        return {w: {"below": e.below, "above": sorted(e.above)} for w, e in sorted(self._workers.items())}

    @classmethod
    def from_keys(cls, keys: Iterable[str]) -> Ledger:
        ledger = cls()
        for key in keys:
            ledger.add(key)
        return ledger

    @classmethod
    def from_json(cls, obj) -> Ledger:
        """From `to_json()`'s dict, or from the old format: a list (or set) of keys."""
        if isinstance(obj, dict):
            ledger = cls()
            for worker, entry in obj.items():
                ledger._load_worker(worker, entry)
            return ledger
        if isinstance(obj, (list, tuple, set, frozenset)):
            return cls.from_keys(obj)
        raise ValueError(f"consumed ledger: expected a dict or a list of keys, got {type(obj).__name__}")

    def _load_worker(self, worker, entry) -> None:
        where = f"consumed ledger, worker {worker!r}"
        try:
            check_worker_id(worker)
        except (TypeError, ValueError) as e:  # TypeError: not a string (a dict built in Python)
            raise ValueError(f"{where}: {e}") from None
        if not isinstance(entry, dict) or set(entry) != {"below", "above"}:
            raise ValueError(f"{where}: expected {{'below': int, 'above': [int, ...]}}, got {entry!r}")
        below, above = entry["below"], entry["above"]
        if not _is_seq(below) or not isinstance(above, list) or not all(map(_is_seq, above)):
            raise ValueError(f"{where}: 'below' and 'above' must hold non-negative integers, got {entry!r}")
        self._workers[worker] = _Worker(below)
        self._count += below
        for seq in above:  # add() folds in redundant or gap-closing entries
            self._add(worker, seq)


def _is_seq(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def as_ledger(obj) -> Ledger:
    """A Ledger from a Ledger (copied), None (empty), to_json()'s dict or a list/set of keys."""
    if obj is None:
        return Ledger()
    if isinstance(obj, Ledger):
        return obj.copy()
    return Ledger.from_json(obj)
