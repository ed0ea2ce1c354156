"""The trainer's chunk-server processes (`buffer.weights_serve_processes` N >= 2).

Why processes: one Python process sends weight chunks at about 1 GB/s at most: gRPC's Python
layer, the reply's framing and the pread run under its one GIL (benchmarks/README.md, issue 26:
on 16 cores the trainer's process spent 0.94 CPU s per GB, one core flat out, at 825 MB/s, while
the worker used 2.5 cores). Why not grpc's SO_REUSEPORT pattern (N processes on the trainer's
port): the kernel spreads connections, not calls, and a worker's fetch is one HTTP/2 connection,
so all its streams would land in one process; and that port carries the experience stream and
the run service, which only the trainer's main process can answer. So: N processes, each a gRPC
server on a port of its own (the trainer's hosts, token and TLS certificate), sending read-only
chunks of the published versions from the weight folder; process k sends the chunks k modulo N,
so each chunk has one sender and "the chunk sent least often" (the peer fan-out's rule: each
chunk leaves the trainer about once) holds over all of them. The trainer's main process keeps
the chunk lists (hashed once, there), the peer registry and every chunk (the fallback while a
process is down); its ChunkServers method tells workers the ports (net_client spreads its
trainer streams over them).

Ownership: one thread of the pool starts every process (PR_SET_PDEATHSIG is tied to the thread
that forked the child, so a short-lived thread must not), checks them every HEALTH_S (an exit is
seen at once; without TLS, PING_FAILURES Pings in a row unanswered within
buffer.weights_probe_timeout_s: killed), restarts a dead one on the same port (workers' channels
reconnect by themselves) after a doubling backoff, and `stop()` ends them. A process ends with
the trainer however the trainer ends: its stdin is a pipe from the trainer (EOF when the trainer
exits or is killed), and PR_SET_PDEATHSIG(SIGKILL) covers a forked child of the trainer (a data
loader worker) keeping that pipe open. With TLS the health check is the exit alone: the trainer
has no CA to verify its own certificate on a loopback name.

    python -m buffer.weights.net_pool      # a chunk server: its spec on stdin (one JSON line)
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc

from buffer.channel import bind_hosts, server_credentials
from buffer.config import BufferConfig
from buffer.layout import RunLayout
from buffer.weights.net_server import CACHED_VERSIONS, OPTIONS, ChunkServicer, Holding, check_token
from protocol.weights import ManifestError, WeightManifest
from protocol.weights_wire import PING_METHOD, ChunkList

log = logging.getLogger(__name__)

HEALTH_S = 1.0  # the pool's thread looks at its processes this often
PING_FAILURES = 3  # Pings unanswered in a row before a process is taken for hung
START_TIMEOUT_S = 60.0  # a process that has not said READY by then is killed (and retried)
STOP_GRACE_S = 5.0  # after its stdin closes, a process has this long to end before SIGKILL
MAX_BACKOFF_S = 30.0  # restarts of a process that keeps dying are at most this far apart
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PR_SET_PDEATHSIG = 1


@dataclasses.dataclass
class _Server:
    """One chunk-server process of the pool: process `index` sends chunks `index` mod N."""

    index: int
    port: int = 0  # 0 while it is not up
    want_port: int = 0  # the port it had: a restart asks for it again
    proc: subprocess.Popen | None = None
    unanswered: int = 0  # Pings in a row
    backoff_s: float = 0.5
    start_at: float = 0.0  # not restarted before this (monotonic)
    up_at: float = 0.0  # when it said READY


class ChunkServerPool:
    """N chunk-server processes of the published versions in `layout`'s weight folder, owned
    by the pool's thread; `ports()` in process order (0: not up now); `stop()` ends them."""

    def __init__(self, layout: RunLayout, secret: str, cfg: BufferConfig, processes: int):
        if processes < 2:
            raise ValueError(f"buffer.weights_serve_processes: a pool of {processes} processes (2 or more)")
        self.cfg, self.n = cfg, processes
        # the trainer's send slots and upload cap, split: the worker spreads its streams evenly
        own = dataclasses.replace(
            cfg,
            weights_send_slots=max(1, math.ceil(cfg.weights_send_slots / processes)),
            weights_upload_mb_s=cfg.weights_upload_mb_s / processes,
        )
        self._spec = {"cfg": dataclasses.asdict(own), "root": layout.root, "count": processes, "parent": os.getpid()}
        self._secret = secret
        self.servers = [_Server(k) for k in range(processes)]
        self.host = bind_hosts(cfg.grpc_bind)[-1]  # loopback when it listens there too: the Ping's
        self._lock = threading.Lock()  # guards servers' port/proc (read by ports(), pids())
        self._stop = threading.Event()
        self._changed = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="weights-chunk-servers", daemon=True)
        self._thread.start()

    def ports(self) -> list[int]:
        with self._lock:
            return [s.port for s in self.servers]

    def pids(self) -> list[int | None]:
        with self._lock:
            return [s.proc.pid if s.proc is not None else None for s in self.servers]

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether every process is up within `timeout_s` (the first start takes a second or
        two: a Python interpreter and gRPC each); chunks of those not up go to the trainer."""
        with self._changed:
            return self._changed.wait_for(lambda: all(s.port for s in self.servers), timeout_s)

    def cpu_seconds(self) -> dict[int, float]:
        """pid -> CPU seconds (user + system) of each live process (Linux /proc)."""
        out = {}
        tick = os.sysconf("SC_CLK_TCK")
        for pid in self.pids():
            if pid is None:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[pid] = (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):  # ended meanwhile
                continue
        return out

    def stop(self) -> None:
        """End every process (stdin closed, then SIGKILL after STOP_GRACE_S) and the thread."""
        self._stop.set()
        # its bounds: a tick, a start's READY, then each process's grace and SIGKILL wait
        self._thread.join(timeout=HEALTH_S + START_TIMEOUT_S + 2 * STOP_GRACE_S * self.n)
        if self._thread.is_alive():  # never seen: it ends each process within those bounds
            log.error("the weight chunk-server thread did not end; killing its processes")
            for s in self.servers:
                self._end(s, grace_s=0)

    # --- the pool's thread ----------------------------------------------------------------
    def _run(self) -> None:
        channels: dict[int, grpc.Channel] = {}
        try:
            while not self._stop.is_set():
                due = [s for s in self.servers if self._tend(s, channels)]
                for s in [s for s in due if self._spawn(s)]:  # all at once: each takes a second or two
                    self._started(s)
                self._stop.wait(HEALTH_S)
        finally:
            for ch in channels.values():
                ch.close()
            for s in self.servers:
                self._end(s, STOP_GRACE_S)

    def _tend(self, s: _Server, channels: dict[int, grpc.Channel]) -> bool:
        """Whether `s` is to start now (down, its backoff passed); else check that it lives."""
        if s.proc is not None and s.proc.poll() is not None:
            log.warning(
                "weight chunk server %d (pid %d, port %d) exited with %s; restarting it",
                s.index,
                s.proc.pid,
                s.port,
                s.proc.returncode,
            )
            self._end(s, 0)
            self._later(s)
        if s.proc is None:
            return not self._stop.is_set() and time.monotonic() >= s.start_at
        if self.cfg.grpc_tls_cert:  # see the module's doc: no Ping over TLS
            return False
        if self._ping(s, channels):
            s.unanswered = 0
            return False
        s.unanswered += 1
        if s.unanswered >= PING_FAILURES:
            log.warning(
                "weight chunk server %d (pid %d) did not answer %d Pings within "
                "buffer.weights_probe_timeout_s; killing and restarting it",
                s.index,
                s.proc.pid,
                s.unanswered,
            )
            self._end(s, 0)
            self._later(s)
        return False

    def _later(self, s: _Server) -> None:
        """The next start of `s` after its backoff: 0.5 s, doubling while it keeps dying (up to
        MAX_BACKOFF_S), from 0.5 s again once it lived longer than that."""
        if time.monotonic() - s.up_at > MAX_BACKOFF_S:
            s.backoff_s = 0.5
        s.start_at = time.monotonic() + s.backoff_s
        s.backoff_s = min(2 * s.backoff_s, MAX_BACKOFF_S)

    def _ping(self, s: _Server, channels: dict[int, grpc.Channel]) -> bool:
        if s.port not in channels:
            channels[s.port] = grpc.insecure_channel(f"{self.host}:{s.port}")
        try:
            channels[s.port].unary_unary(PING_METHOD)(
                b"", timeout=self.cfg.weights_probe_timeout_s, metadata=[("authorization", f"Bearer {self._secret}")]
            )
            return True
        except grpc.RpcError:
            return False

    def _spawn(self, s: _Server) -> bool:
        """Start the process of `s`, asked for its old port (its READY: `_started`)."""
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
        try:  # the secret crosses a pipe, never the command line (ps shows that)
            proc = subprocess.Popen(
                [sys.executable, "-m", "buffer.weights.net_pool"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                cwd=_REPO,
            )
            assert proc.stdin is not None and proc.stdout is not None  # both piped just above
            with self._lock:
                s.proc = proc
            spec = {**self._spec, "index": s.index, "port": s.want_port, "secret": self._secret}
            proc.stdin.write((json.dumps(spec) + "\n").encode())
            proc.stdin.flush()
            return True
        except OSError as e:
            self._failed_start(s, e)
            return False

    def _started(self, s: _Server) -> None:
        """Its READY <port> within START_TIMEOUT_S, or it is killed and retried after the
        backoff (doubling up to MAX_BACKOFF_S)."""
        assert s.proc is not None
        try:
            port = _ready(s.proc, START_TIMEOUT_S)
        except (OSError, ValueError) as e:
            self._failed_start(s, e)
            return
        with self._changed:
            s.port = s.want_port = port
            s.unanswered, s.up_at = 0, time.monotonic()
            self._changed.notify_all()
        log.info("weight chunk server %d of %d: pid %d on port %d", s.index, self.n, s.proc.pid, port)

    def _failed_start(self, s: _Server, e: Exception) -> None:
        log.warning(
            "weight chunk server %d did not start (%s); again in %.1f s",
            s.index,
            e,
            min(s.backoff_s, MAX_BACKOFF_S),
        )
        self._end(s, 0)
        self._later(s)

    def _end(self, s: _Server, grace_s: float) -> None:
        """Close its stdin (it stops its server and exits), wait `grace_s`, then SIGKILL; reaped."""
        with self._changed:
            proc, s.proc, s.port = s.proc, None, 0
            self._changed.notify_all()
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:  # the process is gone: its pipe is broken
                pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_GRACE_S)  # SIGKILL ends it at once; bounded anyway


def _ready(proc: subprocess.Popen, timeout_s: float) -> int:
    """The port from the process's `READY <port>` line, within `timeout_s`."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise ValueError(f"no READY within {timeout_s:.0f} s")
    line = proc.stdout.readline().decode().split()  # the whole line follows at once
    if len(line) != 2 or line[0] != "READY":
        raise ValueError(f"it said {line!r} (exit {proc.poll()})")
    return int(line[1])


def chunk_servers(layout: RunLayout, secret: str, cfg: BufferConfig) -> ChunkServerPool | None:
    """The pool of buffer.weights_serve_processes processes serving `layout`'s weight folder,
    None when that is 0 or 1 (the trainer's own process sends every chunk, as before)."""
    n = cfg.serve_processes()
    return ChunkServerPool(layout, secret, cfg, n) if n >= 2 else None


# --- the chunk-server process ---------------------------------------------------------------


class _Published:
    """The versions this process sends: of each published folder (one with its manifest.json:
    published is a rename), the chunks `index` mod `count`, located from the manifest alone
    (the trainer's main process hashed them). The newest CACHED_VERSIONS asked are kept."""

    def __init__(self, layout: RunLayout, chunk_bytes: int, index: int, count: int):
        self.layout, self.chunk_bytes, self.index, self.count = layout, chunk_bytes, index, count
        self.held: collections.OrderedDict[int, Holding] = collections.OrderedDict()
        self.lock = threading.Lock()

    def __call__(self, version: int) -> Holding | None:
        with self.lock:
            if version in self.held:
                self.held.move_to_end(version)
                return self.held[version]
        folder = self.layout.version_dir(version)
        path = os.path.join(folder, "manifest.json")
        try:
            with open(path) as f:
                text = f.read()
            chunks = ChunkList.unhashed(WeightManifest.from_json(text, where=path), text, self.chunk_bytes)
        except (OSError, ManifestError, ValueError):  # not published (yet, or pruned): NOT_FOUND
            return None
        mine = set(range(self.index, chunks.total, self.count))
        with self.lock:
            held = self.held.setdefault(version, Holding(chunks, folder, mine))
            while len(self.held) > CACHED_VERSIONS:
                self.held.popitem(last=False)
        return held


def _die_with(parent: int) -> None:
    """SIGKILL this process when the trainer's thread that started it ends (Linux), and exit
    now if the trainer is gone already (it died before the prctl)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _bind(server: grpc.Server, cfg: BufferConfig, want: int) -> int:
    """Listen on the trainer's hosts (buffer.grpc_bind's), on port `want` if it is free, else a
    free one. SO_REUSEPORT is off (OPTIONS below), so a port in use is refused, not shared."""
    creds = server_credentials(cfg)
    port = 0
    for host in bind_hosts(cfg.grpc_bind):
        for ask in [port] if port else ([want, 0] if want else [0]):
            address = f"{host}:{ask}"
            bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
            if bound:
                port = bound
                break
        else:
            raise OSError(f"weight chunk server: cannot listen on {host} (buffer.grpc_bind {cfg.grpc_bind!r})")
    return port


def serve() -> int:
    """A chunk-server process: its spec from stdin, READY <port> on stdout, then serve until
    stdin ends (the trainer closed it, or died)."""
    spec = json.loads(sys.stdin.readline())
    _die_with(spec["parent"])
    logging.basicConfig(level=logging.WARNING, format=f"chunk server {spec['index']}: %(levelname)s %(message)s")
    cfg = BufferConfig(**spec["cfg"])
    published = _Published(RunLayout(spec["root"]), cfg.weights_chunk_kb << 10, spec["index"], spec["count"])
    slots = cfg.weights_send_slots
    # every sender and waiter holds a thread; two to spare so that a Ping always finds one
    servicer = ChunkServicer(published, spec["secret"], cfg, max_waiting=slots, defer=True)
    server = grpc.server(
        futures.ThreadPoolExecutor(2 * slots + 2, thread_name_prefix="weights-chunks"),
        options=[*OPTIONS, ("grpc.so_reuseport", 0)],
    )

    def ping(raw: bytes, context) -> bytes:
        check_token(context, servicer.expected)
        return b""

    server.add_generic_rpc_handlers([servicer.handlers(Ping=ping)])
    port = _bind(server, cfg, spec["port"])
    server.start()
    print(f"READY {port}", flush=True)
    sys.stdin.buffer.read()  # until EOF: the trainer stopped the pool, or is gone
    server.stop(1.0).wait(timeout=STOP_GRACE_S)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
