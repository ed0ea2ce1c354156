"""Look into a run's experience buffer: `python -m buffer.inspect RUN_DIR [--verify]`.

Prints, per worker and in total: published shards, samples, weight versions (min/max), bytes and
leftover temporaries; each worker's heartbeat; the backlog the workers' backpressure sees
(samples in heartbeats minus samples the trainer retired, from progress.json); archived shards;
and the quarantine with each shard's reason.

Without --verify it reads only each shard's schema (samples and versions come from the metadata
the writer records). With --verify it reads every shard in full and applies the trainer's checks
(sha256 trailer, schema, row invariants, token ids < vocab size, finite values, origin), names
every bad shard and exits 1 if there is one. The vocabulary size comes from --vocab-size, else
from init_model/config.json when the run has one, else token ids are only checked to be >= 0.
--json prints the same report as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import pyarrow as pa

from buffer.control.backpressure import backlog
from buffer.experience.reader import check_origin, check_rows_origin
from buffer.layout import SHARD_SUFFIX, TMP_MARK, check_worker_id
from buffer.run import setup_trainer_run
from buffer.storage import read_json
from protocol.experience import SchemaError, from_table, load_shard


def _names(fs, path: str) -> list[str]:
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _workers(fs, folder: str) -> list[str]:
    out = []
    for name in _names(fs, folder):
        try:
            out.append(check_worker_id(name))
        except ValueError:
            continue
    return out


def _summary(fs, path: str) -> tuple[int, int | None, int | None]:
    """(samples, min version, max version) of a shard, from its metadata when present."""
    with fs.open(path, "rb") as f:
        reader = pa.ipc.open_stream(f)
        meta = reader.schema.metadata or {}
        if b"tandem.min_weight_version" in meta and b"tandem.num_samples" in meta:
            return (
                int(meta[b"tandem.num_samples"]),
                int(meta[b"tandem.min_weight_version"]),
                int(meta[b"tandem.max_weight_version"]),
            )
        col = reader.read_all().column("weight_version").to_pylist()
    return len(col), (min(col) if col else None), (max(col) if col else None)


def _vocab_size(fs, layout, given: int | None) -> tuple[int | None, str]:
    if given is not None:
        return given, "--vocab-size"
    cfg = read_json(fs, f"{layout.init_model}/config.json")
    if cfg and isinstance(cfg.get("vocab_size"), int):
        return cfg["vocab_size"], f"{layout.init_model}/config.json"
    return None, "unknown (token ids checked >= 0 only)"


def verify_shard(
    fs, path: str, worker: str, seq: int, vocab_size: int | None, run_id: str | None = None
) -> tuple[int, list]:
    """Full check of one shard as the trainer does it; returns (samples, versions); raises."""
    data = fs.cat_file(path)
    table = load_shard(data, vocab_size)
    check_origin(table.schema.metadata or {}, worker, seq, path, run_id)
    check_rows_origin(table, worker)
    versions = table.column("weight_version").to_pylist()
    from_table(table)
    return table.num_rows, versions


def report(root: str, verify: bool = False, vocab_size: int | None = None) -> dict:
    run = setup_trainer_run(root)
    fs, layout = run.fs, run.files
    vocab, vocab_from = _vocab_size(fs, layout, vocab_size)
    run_id = run.state.run_id()
    out: dict = {
        "root": layout.root,
        "workers": {},
        "bad": [],
        "quarantine": [],
        "archive": {},
        "vocab_size": vocab,
        "vocab_from": vocab_from,
        "verified": verify,
    }
    total = {
        "shards": 0,
        "samples": 0,
        "bytes": 0,
        "temporaries": 0,
        "min_version": None,
        "max_version": None,
        "other_files": 0,
    }
    for worker in _workers(fs, layout.experience_dir):
        wdir = layout.worker_shard_dir(worker)
        w: dict[str, Any] = {
            "shards": 0,
            "samples": 0,
            "bytes": 0,
            "temporaries": 0,
            "first_seq": None,
            "last_seq": None,
            "min_version": None,
            "max_version": None,
            "other_files": 0,
        }
        for name in _names(fs, wdir):
            path = f"{wdir}/{name}"
            seq = layout.shard_seq(name)
            if seq is None:
                w["temporaries" if TMP_MARK in name else "other_files"] += 1
                continue
            w["shards"] += 1
            w["first_seq"] = seq if w["first_seq"] is None else min(w["first_seq"], seq)
            w["last_seq"] = seq if w["last_seq"] is None else max(w["last_seq"], seq)
            try:
                w["bytes"] += fs.size(path)
                if verify:
                    n, versions = verify_shard(fs, path, worker, seq, vocab, run_id)
                    lo, hi = (min(versions), max(versions)) if versions else (None, None)
                else:
                    n, lo, hi = _summary(fs, path)
            except (SchemaError, pa.ArrowException, OSError, ValueError, KeyError) as e:
                out["bad"].append({"path": path, "reason": f"{type(e).__name__}: {e}"})
                continue
            w["samples"] += n
            for key, val, pick in (("min_version", lo, min), ("max_version", hi, max)):
                if val is not None:
                    w[key] = val if w[key] is None else pick(w[key], val)
        w["heartbeat"] = run.heartbeats.read(worker)
        out["workers"][worker] = w
        for key in ("shards", "samples", "bytes", "temporaries", "other_files"):
            total[key] += w[key]
        for key, pick in (("min_version", min), ("max_version", max)):
            if w[key] is not None:
                total[key] = w[key] if total[key] is None else pick(total[key], w[key])
    out["total"] = total
    progress = run.progress.read() or {}
    out["backlog"] = {
        "samples": backlog(run.heartbeats, run.progress),
        "retired": int(progress.get("samples_retired", 0)),
        "trainer_version": progress.get("version"),
    }
    out["backlog"]["written"] = out["backlog"]["samples"] + out["backlog"]["retired"]
    for worker in _workers(fs, layout.quarantine_dir):
        qdir = f"{layout.quarantine_dir}/{worker}"
        for name in _names(fs, qdir):
            if name.endswith(".reason.txt"):
                continue
            reason_path = layout.quarantine_reason(f"{qdir}/{name}")
            try:
                text = fs.cat_file(reason_path).decode(errors="replace")
                reason = next(
                    (ln[len("reason: ") :] for ln in text.splitlines() if ln.startswith("reason: ")), text.strip()
                )
            except FileNotFoundError:
                reason = "(no reason file)"
            out["quarantine"].append({"path": f"{qdir}/{name}", "reason": reason})
    for worker in _workers(fs, layout.archive_dir):
        wdir = f"{layout.archive_dir}/{worker}"
        out["archive"][worker] = sum(
            1 for bucket in _names(fs, wdir) for name in _names(fs, f"{wdir}/{bucket}") if name.endswith(SHARD_SUFFIX)
        )
    return out


def _range(lo, hi) -> str:
    return "-" if lo is None else (f"v{lo}" if lo == hi else f"v{lo}..v{hi}")


def print_report(r: dict, file=sys.stdout) -> None:
    p = lambda *a: print(*a, file=file)  # noqa: E731
    t = r["total"]
    p(f"run {r['root']}")
    p(
        f"experience: {len(r['workers'])} workers, {t['shards']} shards, {t['samples']} samples, "
        f"versions {_range(t['min_version'], t['max_version'])}, {t['bytes'] / 1e6:.1f} MB, "
        f"{t['temporaries']} temporaries" + (f", {t['other_files']} other files" if t["other_files"] else "")
    )
    for name, w in r["workers"].items():
        beat = w["heartbeat"] or {}
        seqs = "-" if w["first_seq"] is None else f"seq {w['first_seq']}..{w['last_seq']}"
        hb = (
            (
                f"heartbeat: {beat.get('state', '?')}, next_seq {beat.get('next_seq', '?')}, "
                f"samples_written {beat.get('samples_written', '?')}"
            )
            if beat
            else "no heartbeat"
        )
        p(
            f"  {name}: {w['shards']} shards ({seqs}), {w['samples']} samples, versions "
            f"{_range(w['min_version'], w['max_version'])}, {w['temporaries']} temporaries; {hb}"
        )
    b = r["backlog"]
    p(
        f"backlog: {b['samples']} samples (written {b['written']} per heartbeats - retired "
        f"{b['retired']} per progress.json); trainer at version {b['trainer_version']}"
    )
    p(f"archive: {sum(r['archive'].values())} shards")
    p(f"quarantine: {len(r['quarantine'])} shards")
    for q in r["quarantine"]:
        p(f"  {q['path']}: {q['reason']}")
    if r["verified"]:
        p(
            f"verify (vocab size {r['vocab_size']}, from {r['vocab_from']}): "
            f"{t['shards'] - len(r['bad'])}/{t['shards']} shards ok"
        )
    for bad in r["bad"]:
        p(f"BAD {bad['path']}: {bad['reason']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m buffer.inspect", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("root", help="the run folder (the one holding experience/)")
    ap.add_argument("--verify", action="store_true", help="read and check every shard in full; exit 1 if any is bad")
    ap.add_argument(
        "--vocab-size", type=int, default=None, help="token ids must be below this (default: init_model/config.json)"
    )
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    run = setup_trainer_run(args.root)
    if not run.fs.isdir(run.files.root):
        print(f"python -m buffer.inspect: run folder {args.root} not found", file=sys.stderr)
        return 2
    r = report(args.root, verify=args.verify, vocab_size=args.vocab_size)
    if args.json:
        print(json.dumps(r, indent=1, sort_keys=True))
    else:
        print_report(r)
    return 1 if r["bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
