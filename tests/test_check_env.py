"""launch.check_env: a FAIL line naming the problem (and exit 1) on a read-only run folder and on
an unreachable port; PASS on a good folder, with the node's versions recorded there."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def check_env(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "launch.check_env", *args], env=env, capture_output=True, text=True, timeout=120
    )


def lines(out: str, status: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(status)]


@contextlib.contextmanager
def read_only_folder(tmp_path: Path):
    """A folder that even root cannot write: a read-only tmpfs mount when we may mount, else a
    path under /proc (which refuses new files to everyone)."""
    target = tmp_path / "ro"
    target.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)], capture_output=True, timeout=30
        ).returncode
        == 0
    )
    try:
        yield target if mounted else Path("/proc/self/tandem-run")
    finally:
        if mounted:
            subprocess.run(["umount", str(target)], capture_output=True, timeout=30)


def closed_port() -> int:
    """A localhost port with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_read_only_run_folder_fails_with_the_folder_named(tmp_path):
    with read_only_folder(tmp_path) as ro:
        out = check_env("--root", str(ro))
    assert out.returncode == 1, out.stdout
    fails = lines(out.stdout, "FAIL")
    assert any(line.startswith("FAIL run folder writable") and str(ro) in line for line in fails), out.stdout
    assert out.stdout.rstrip().splitlines()[-1].startswith("FAIL check_env")


def test_unreachable_port_fails_with_the_port_named(tmp_path):
    port = closed_port()
    out = check_env("--root", str(tmp_path), "--port", f"127.0.0.1:{port}")
    assert out.returncode == 1, out.stdout
    fails = lines(out.stdout, "FAIL")
    assert [line for line in fails if line.startswith("FAIL check_env")] and len(fails) == 2, out.stdout
    assert f"FAIL port 127.0.0.1:{port}: unreachable" in out.stdout
    assert "Connection refused" in out.stdout


def test_good_folder_and_open_port_pass_and_versions_are_recorded(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        port = srv.getsockname()[1]
        out = check_env("--root", str(root), "--port", str(port), "--node", "n1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not lines(out.stdout, "FAIL")
    for check in ("run folder writable", "atomic rename", "clock skew", "free disk", f"port 127.0.0.1:{port}"):
        assert f"PASS {check}:" in out.stdout, (check, out.stdout)
    for name in ("torch", "cuda", "nccl", "vllm", "verl"):
        assert f"INFO version {name}:" in out.stdout
    record = json.loads((root / "env" / "n1.json").read_text())
    assert record["versions"]["torch"] and "verl" in record["versions"]
    assert not (root / ".check_env").exists()  # scratch files removed

    # a second node with a different torch shows up as a mismatch
    other = dict(record, node="n2", versions=dict(record["versions"], torch="0.0.1-other"))
    (root / "env" / "n2.json").write_text(json.dumps(other))
    out = check_env("--root", str(root), "--node", "n1")
    assert out.returncode == 0
    assert "WARN versions across nodes: mismatch: torch" in out.stdout and "on n2" in out.stdout, out.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to fall back on /proc")
def test_proc_path_is_unwritable_even_for_root():
    out = check_env("--root", "/proc/self/tandem-run")
    assert out.returncode == 1 and "FAIL run folder writable" in out.stdout


def test_missing_run_folder_fails_and_is_not_created(tmp_path):
    """A node without the shared mount must not pass by creating the folder locally."""
    root = tmp_path / "nonexistent" / "r1"
    out = check_env("--root", str(root))
    assert out.returncode == 1, out.stdout
    assert f"FAIL run folder writable: {root} does not exist on this node" in out.stdout
    assert not root.exists() and not root.parent.exists()
