"""Check a node before a run: versions, the shared run folder, disk, ports, GPUs, clock, and
the Ray cluster the roles are submitted to (--ray-address).

    python -m launch.check_env --root /shared/runs/r1 --port node001:29500 --port node001:50051
    python -m launch.check_env --root /shared/runs/r1 --ray-address http://HEAD:8265

One line per check: PASS / FAIL (a problem that breaks a run), WARN (likely trouble), INFO (a
report). Exit 1 on any FAIL. Each node's versions and results are recorded in the run folder
(ROOT/env/<node>.json) and compared with what the other nodes recorded there, so run it on
every node (e.g. `srun --ntasks-per-node=1 python -m launch.check_env --root ...`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import socket
import sys
import time
import uuid

from buffer.run import TrainerRun, setup_trainer_run

COMPARED = ("python", "torch", "cuda", "nccl", "vllm", "verl", "transformers", "ray")


class Report:
    def __init__(self):
        self.lines: list[tuple[str, str, str]] = []

    def add(self, status: str, check: str, detail: str) -> None:
        self.lines.append((status, check, detail))
        print(f"{status:<4} {check}: {detail}", flush=True)

    @property
    def failed(self) -> bool:
        return any(s == "FAIL" for s, _, _ in self.lines)


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        nccl = None
        if torch.cuda.is_available():
            try:
                v = torch.cuda.nccl.version()
                nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            except Exception:  # noqa: BLE001 - a build without NCCL
                nccl = None
        out["nccl"] = nccl
    except ImportError:
        out.update(torch=None, cuda=None, nccl=None)
    for name in ("vllm", "verl", "transformers", "ray"):
        out[name] = _dist_version(name)
    return out


def check_versions(rep: Report, vers: dict) -> None:
    for name in COMPARED:
        rep.add("INFO", f"version {name}", vers.get(name) or "not installed")


def check_other_nodes(rep: Report, run: TrainerRun, node: str, vers: dict) -> None:
    try:
        names = sorted(os.listdir(run.files.env_dir))
    except OSError:
        names = []
    others = {}
    for name in names:
        if not name.endswith(".json") or name == f"{node}.json":
            continue
        try:
            with open(os.path.join(run.files.env_dir, name)) as f:
                others[name[:-5]] = json.load(f).get("versions", {})
        except (OSError, ValueError):
            continue
    if not others:
        rep.add("INFO", "versions across nodes", "no other node has recorded its versions yet")
        return
    diffs = [
        f"{k}: {vers.get(k)} here, {v.get(k)} on {other}"
        for other, v in sorted(others.items())
        for k in COMPARED
        if v.get(k) != vers.get(k)
    ]
    if diffs:
        rep.add("WARN", "versions across nodes", "mismatch: " + "; ".join(diffs))
    else:
        rep.add("PASS", "versions across nodes", f"same as {len(others)} other node(s): {', '.join(sorted(others))}")


def check_folder(rep: Report, run: TrainerRun, max_skew_s: float) -> bool:
    """Exists, writable, atomic rename, clock skew; returns whether the folder is writable."""
    if not os.path.isdir(run.files.root):  # never created here: that would hide a missing mount
        rep.add(
            "FAIL",
            "run folder writable",
            f"{run.files.root} does not exist on this node: is the "
            "shared filesystem mounted here? (create the run folder once, e.g. mkdir -p, "
            "on a node that has it)",
        )
        return False
    scratch = os.path.join(run.files.check_scratch, f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(scratch, exist_ok=True)
        probe = os.path.join(scratch, "probe")
        before = time.time()
        with open(probe, "wb") as f:
            f.write(b"tandem")
            f.flush()
            os.fsync(f.fileno())
        after = time.time()
    except OSError as e:
        rep.add(
            "FAIL",
            "run folder writable",
            f"cannot write in {run.files.root}: {e.strerror or e} "
            f"({type(e).__name__}); the run folder must be writable from every node",
        )
        return False
    try:
        rep.add("PASS", "run folder writable", run.files.root)
        # atomic rename over an existing file (how shards and weights/LATEST are published)
        a, b = os.path.join(scratch, ".new"), os.path.join(scratch, "target")
        try:
            with open(b, "w") as f:
                f.write("old")
            with open(a, "w") as f:
                f.write("new")
            os.replace(a, b)
            with open(b) as f:
                ok = f.read() == "new" and not os.path.exists(a)
            rep.add(
                "PASS" if ok else "FAIL",
                "atomic rename",
                "rename over an existing file replaces it"
                if ok
                else f"rename in {scratch} did not replace the target atomically",
            )
        except OSError as e:
            rep.add("FAIL", "atomic rename", f"rename in {run.files.root} failed: {e}")
        # clock skew: the file server stamps mtime; compare with this node's clock
        mtime = os.stat(probe).st_mtime
        skew = 0.0 if before - 1 <= mtime <= after + 1 else (mtime - after if mtime > after else mtime - before)
        status = "PASS" if abs(skew) <= max_skew_s else "FAIL"
        rep.add(
            status,
            "clock skew",
            f"{skew:+.2f} s between this node's clock and the run folder's "
            f"file times (limit {max_skew_s:g} s){'' if status == 'PASS' else '; sync clocks (NTP/chrony)'}",
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            os.rmdir(run.files.check_scratch)
        except OSError:
            pass
    return True


def check_disk(rep: Report, root: str, min_free_gb: float) -> None:
    path = root
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        free = shutil.disk_usage(path).free / 2**30
    except OSError as e:
        rep.add("FAIL", "free disk", f"cannot stat {path}: {e}")
        return
    rep.add(
        "PASS" if free >= min_free_gb else "FAIL",
        "free disk",
        f"{free:.1f} GiB free under {path} (need {min_free_gb:g})",
    )


def _host_port(spec: str) -> tuple[str, int]:
    host, sep, port = spec.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", spec
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--port {spec!r}: give PORT or HOST:PORT")
    return host, int(port)


def check_ports(rep: Report, specs: list[str], timeout_s: float) -> None:
    if not specs:
        rep.add("INFO", "ports", "none given (--port HOST:PORT for the trainer's rendezvous and gRPC ports)")
    for spec in specs:
        try:
            host, port = _host_port(spec)
        except ValueError as e:
            rep.add("FAIL", f"port {spec}", str(e))
            continue
        t0 = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                pass
            ms = 1000 * (time.monotonic() - t0)
            rep.add("PASS", f"port {host}:{port}", f"reachable (TCP connect in {ms:.0f} ms)")
        except OSError as e:
            reason = "timed out" if isinstance(e, (socket.timeout, TimeoutError)) else (e.strerror or str(e))
            rep.add(
                "FAIL",
                f"port {host}:{port}",
                f"unreachable: {reason} (is the process listening there, "
                "on an interface this node can reach, and no firewall between?)",
            )


def check_gpus(rep: Report, expect: int | None) -> dict:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = [torch.cuda.get_device_name(i) for i in range(count)]
    except Exception as e:  # noqa: BLE001 - a broken driver is a finding, not a crash
        count, names = 0, []
        rep.add("WARN", "GPUs", f"torch.cuda failed: {e}")
    detail = (
        f"{count} visible"
        + (f": {', '.join(names)}" if names else "")
        + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
    )
    if expect is not None:
        rep.add("PASS" if count >= expect else "FAIL", "GPUs", f"{detail}; expected {expect}")
    else:
        rep.add("INFO", "GPUs", detail if count else f"{detail}; CPU only (fine for the built-in task)")
    return {"count": count, "names": names, "cuda_visible_devices": visible}


def check_ray(rep: Report, address: str, timeout_s: float) -> None:
    """The Ray cluster the roles are submitted to: its Jobs API reachable, its ray version the
    same as this one's (a job runs with the cluster's ray), its alive nodes and their resources."""
    import urllib.request

    local = _dist_version("ray")
    if local is None:
        rep.add("FAIL", "ray", "not installed here: pip install 'tandem[ray]' (the cluster's version)")
        return
    url = (address if "://" in address else f"http://{address}").rstrip("/")
    try:
        with urllib.request.urlopen(f"{url}/api/version", timeout=timeout_s) as r:
            remote = json.load(r).get("ray_version")
    except (OSError, ValueError) as e:
        rep.add(
            "FAIL",
            f"ray cluster {address}",
            f"unreachable: {getattr(e, 'reason', e)} (is the head up "
            "with `ray start --head --include-dashboard=true`, and port 8265 open to this node?)",
        )
        return
    rep.add("PASS", f"ray cluster {address}", "Jobs API reachable")
    rep.add(
        "PASS" if remote == local else "FAIL",
        "ray version",
        f"cluster {remote}, here {local}" + ("" if remote == local else f": pip install 'ray[default]=={remote}' here"),
    )
    try:
        from ray.util.state import list_nodes

        nodes = [n for n in list_nodes(address=url, timeout=int(max(1, timeout_s))) if n.state == "ALIVE"]
    except Exception as e:  # noqa: BLE001 - Ray's state API raises several kinds
        rep.add("WARN", "ray resources", f"cannot list the nodes: {e}")
        return
    total = lambda k: sum(n.resources_total.get(k, 0) for n in nodes)  # noqa: E731
    each = "; ".join(
        f"{n.node_ip}: {n.resources_total.get('CPU', 0):g} CPU, {n.resources_total.get('GPU', 0):g} GPU" for n in nodes
    )
    rep.add(
        "PASS" if nodes else "FAIL",
        "ray resources",
        f"{len(nodes)} node(s) alive, {total('CPU'):g} CPUs, {total('GPU'):g} GPUs ({each})",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launch.check_env", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", required=True, help="run folder (on the shared filesystem)")
    p.add_argument(
        "--port",
        action="append",
        default=[],
        metavar="[HOST:]PORT",
        help="a port that must accept TCP connections, repeatable (rendezvous, gRPC)",
    )
    p.add_argument("--gpus", type=int, help="GPUs this node must see (default: report only)")
    p.add_argument("--min-free-gb", type=float, default=1.0, help="free disk needed (default 1 GiB)")
    p.add_argument("--max-skew", type=float, default=5.0, help="clock skew allowed in s (default 5)")
    p.add_argument("--connect-timeout", type=float, default=3.0, help="seconds per port (default 3)")
    p.add_argument("--node", default=socket.gethostname(), help="name to record under (default: hostname)")
    p.add_argument(
        "--ray-address",
        metavar="http://HEAD:8265",
        help="also check this Ray cluster: Jobs API, ray version, nodes and resources",
    )
    args = p.parse_args(argv)
    run = setup_trainer_run(os.path.abspath(args.root))
    rep = Report()
    vers = versions()
    check_versions(rep, vers)
    writable = check_folder(rep, run, args.max_skew)
    check_disk(rep, run.files.root, args.min_free_gb)
    check_ports(rep, args.port, args.connect_timeout)
    gpus = check_gpus(rep, args.gpus)
    check_other_nodes(rep, run, args.node, vers)
    if args.ray_address:
        check_ray(rep, args.ray_address, args.connect_timeout)
    if writable:
        from buffer.storage import atomic_write_json

        record = {
            "node": args.node,
            "time": time.time(),
            "versions": vers,
            "gpus": gpus,
            "checks": [{"status": s, "check": c, "detail": d} for s, c, d in rep.lines],
        }
        try:
            atomic_write_json(run.fs, run.files.env_report(args.node), record)
            rep.add("INFO", "recorded", run.files.env_report(args.node))
        except OSError as e:
            rep.add("FAIL", "recorded", f"cannot write {run.files.env_report(args.node)}: {e}")
    n_fail = sum(s == "FAIL" for s, _, _ in rep.lines)
    print(f"{'FAIL' if n_fail else 'PASS'} check_env: {n_fail} failed check(s)", flush=True)
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
