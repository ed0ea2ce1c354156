"""Settings of the experience transport, shared by rollout workers (writers) and the trainer."""

from __future__ import annotations

import dataclasses
import os

from protocol.config import ConfigError, F


def usable_cpus() -> int:
    """The CPUs this process may use (SLURM, taskset), not the node's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclasses.dataclass
class BufferConfig:
    flush_interval: float = F(30.0, "seconds: publish buffered groups at least this often", gt=0)
    flush_samples: int = F(512, "publish a shard once this many samples are buffered", ge=1)
    discovery: str = F(
        "auto",
        "how the trainer finds new shards: 'auto' polls and also listens to "
        "filesystem events (watchdog) where they are delivered; 'poll' only polls "
        "(events never arrive from other nodes on NFS/Lustre)",
        choices=("auto", "poll"),
    )
    poll_interval: float = F(1.0, "seconds between listings of the experience folder", gt=0)
    full_scan_interval: float = F(
        60.0,
        "seconds between full listings of every worker folder; "
        "between them the trainer only probes for each worker's next "
        "shard (cost grows with new shards, not with all shards), the "
        "full listing catches gaps in a worker's sequence",
        gt=0,
    )
    retention: str = F(
        "delete",
        "what happens to shards consumed and covered by a committed "
        "checkpoint: 'delete', 'archive' (moved to archive/) or 'keep'",
        choices=("delete", "archive", "keep"),
    )
    tmp_timeout_s: float = F(
        3600.0, "temporary shard/heartbeat files older than this are leftovers of dead writers and are removed", gt=0
    )
    max_backlog_samples: int = F(
        1024,
        "workers pause while more samples than this are written but not yet trained on or dropped by the trainer",
        ge=1,
    )
    backlog_timeout_s: float = F(
        1800.0,
        "seconds a worker waits for the backlog to drain (with "
        "trainer.max_staleness=0: for the next weight version) before "
        "failing (the trainer is presumed dead)",
        gt=0,
    )
    transport: str = F(
        "fs",
        "how shards reach the trainer: 'fs' (a shared folder) or 'grpc' "
        "(pushed to the trainer, which spools them on its disk)",
        choices=("fs", "grpc"),
    )
    grpc_address: str = F("localhost:50051", "worker: the trainer's gRPC address host:port")
    grpc_bind: str = F(
        ":50051",
        "trainer: host:port the gRPC server listens on; ':PORT' (the "
        "default) is this node's address (its hostname's) plus loopback, never "
        "every interface. Off this host without TLS it warns: the token would "
        "cross the network in clear",
    )
    grpc_token_file: str | None = F(None, "file holding the shared token (else $TANDEM_GRPC_TOKEN)")
    grpc_tls_cert: str | None = F(None, "trainer: TLS certificate (PEM); with grpc_tls_key enables TLS")
    grpc_tls_key: str | None = F(None, "trainer: TLS private key (PEM)")
    grpc_tls_ca: str | None = F(None, "worker: CA certificate (PEM) to verify the trainer; enables TLS")
    grpc_max_shard_mb: int = F(256, "trainer: largest shard it accepts, MiB (flush_samples must fit)", ge=1)
    grpc_chunk_kb: int = F(
        1024,
        "worker: a shard is streamed in messages of this many KiB (the trainer hashes and writes each as it arrives)",
        ge=16,
        le=4096,
    )
    grpc_server_threads: int = F(
        16,
        "trainer: pushes handled at once (over all workers); one more cancels the slowest under "
        "buffer.grpc_min_rate_bytes_s and runs on a spare thread (4x as many in all), past "
        "those they wait in the gRPC queue",
        ge=1,
    )
    worker_lock_wait_s: float = F(
        30.0,
        "seconds a starting worker waits for the lock of its worker id (an older process of the id "
        "still exiting) before it fails with WorkerIdInUse",
        ge=0,
    )
    grpc_max_inflight: int = F(
        8, "shards a worker may have unacknowledged before it blocks", ge=1, le=1024
    )  # le: the trainer refuses a shard more than 1024 past the highest it accepted
    grpc_max_workers: int = F(
        8,
        "trainer: threads of the run service's pool and of the weight service's pool, each "
        "(pushes have their own, buffer.grpc_server_threads): one service's callers never "
        "hold another's threads",
        ge=1,
        le=256,
    )
    grpc_min_rate_bytes_s: int = F(
        16384,
        "trainer: a push that sends less than this many bytes/s, averaged over "
        "buffer.grpc_min_rate_window_s of waiting for the client, is cancelled (a slow trickle "
        "must not hold a push thread); while every push thread is busy, the slowest push under "
        "this rate is cancelled to let a new one in; 0: off",
        ge=0,
    )
    grpc_min_rate_window_s: float = F(
        10.0, "trainer: seconds of a push's waiting for its client over which its rate is averaged", gt=0, le=3600
    )
    grpc_stream_deadline_s: float = F(
        300.0,
        "trainer: a push still in progress after this many seconds is cancelled, whatever its "
        "rate (a worker's own deadline is buffer.grpc_timeout_s)",
        gt=0,
    )
    grpc_max_claim_groups: int = F(
        1 << 16,
        "trainer: a sync claim naming more groups (or wanting more) than this is refused "
        "(INVALID_ARGUMENT); a version's slots are data.train_batch_size groups per step",
        ge=1,
    )
    grpc_max_worker_ids: int = F(
        1024,
        "trainer: distinct worker ids whose heartbeats it keeps; a new id past this takes the "
        "place (and heartbeat file) of one silent for buffer.grpc_worker_id_ttl_s, else is "
        "refused (RESOURCE_EXHAUSTED, retried)",
        ge=1,
    )
    grpc_worker_id_ttl_s: float = F(
        3600.0, "trainer: a worker id with no heartbeat for this long may be dropped for a new one", gt=0
    )
    grpc_timeout_s: float = F(60.0, "seconds one push may take before it is retried", gt=0)
    grpc_idle_timeout_s: float = F(
        30.0,
        "trainer: a push that sends nothing for this many seconds "
        "is cancelled, so stalled clients cannot hold the server's "
        "threads (the worker resends it)",
        gt=0,
    )
    grpc_max_pushes_per_worker: int = F(
        8,
        "trainer: pushes of one worker id handled at once; more are refused (RESOURCE_EXHAUSTED) and resent later",
        ge=1,
    )
    grpc_claim_ttl_s: float = F(
        60.0,
        "trainer: a worker id belongs to the writer that pushed it "
        "last until this many seconds after its last push; another "
        "writer using the id meanwhile is refused (ABORTED, resent: a "
        "restarted worker takes over after this)",
        gt=0,
    )
    grpc_call_timeout_s: float = F(
        30.0,
        "deadline of one run-service call (a heartbeat, the weights pointer, a claim, ...); a call past it is retried",
        gt=0,
    )
    grpc_trainer_wait_s: float = F(
        1800.0,
        "a worker, validator or pool without the run folder "
        "(transport grpc) waits this long for an unreachable trainer "
        "(not started yet, restarting), saying so every 30 s, before "
        "it fails",
        gt=0,
    )
    grpc_linger_s: float = F(
        60.0,
        "trainer: after its last step it goes on serving the run "
        "service, at most this long, until every worker's heartbeat says "
        "stopped (so that workers without the run folder learn the run "
        "ended)",
        ge=0,
    )
    grpc_cache_versions: int = F(
        2,
        "worker (transport grpc): complete weight versions kept in "
        "the cache in its own folder (ROOT/weights), besides at most one "
        "partial fetch of a newer one (resumed by the next fetch)",
        ge=1,
    )

    # --- weight versions over the network (buffer/weights/) ---
    weights_chunk_kb: int = F(
        4096,
        "trainer: weight files are served in chunks of this many KiB, each with its sha256 in the version's chunk list",
        ge=64,
        le=4096,
    )
    weights_parallel: int = F(4, "worker: chunk requests to other workers (peers) in flight at once", ge=1)
    weights_trainer_streams: int = F(2, "worker: chunk requests to the trainer in flight at once", ge=1)
    weights_peer_fanout: bool = F(
        True,
        "worker: fetch weight chunks from other workers that "
        "hold them, and serve the chunks it holds (the trainer sends "
        "each chunk about once); false: every chunk from the trainer",
    )
    weights_peer_host: str | None = F(
        None,
        "worker: the host other workers reach its peer "
        "server at (default: this node's address, as its hostname "
        "resolves)",
    )
    weights_peer_port: int = F(0, "worker: port of its peer server (0: a free one)", ge=0, le=65535)
    weights_peer_threads: int = F(8, "worker: chunk requests its peer server handles at once", ge=1)
    weights_max_peers: int = F(16, "trainer: peers handed to a worker per request", ge=1)
    weights_max_registered_peers: int = F(
        256,
        "trainer: peers it keeps in its registry, over all versions; reports past this are "
        "refused (RESOURCE_EXHAUSTED) until entries expire (buffer.weights_peer_ttl_s)",
        ge=1,
    )
    weights_probe_timeout_s: float = F(
        2.0,
        "trainer: a peer is handed to others only after it answered one request within this "
        "many seconds (an address that never answers would stall their fetches)",
        gt=0,
    )
    weights_peer_refresh_s: float = F(
        1.0, "worker: seconds between reports of the chunks it holds to the trainer, which answers with peers", gt=0
    )
    weights_peer_ttl_s: float = F(
        10.0,
        "trainer: a peer not heard from for this long is no longer "
        "handed out; worker: a peer that failed a request is not asked "
        "again for this long",
        gt=0,
    )
    weights_chunk_timeout_s: float = F(60.0, "worker: seconds one chunk request may take", gt=0)
    weights_stall_timeout_s: float = F(600.0, "worker: a weight fetch that verifies no chunk for this long fails", gt=0)
    weights_upload_mb_s: float = F(
        0.0,
        "cap on the rate (MB/s, 1e6 bytes) at which a server "
        "(the trainer's, or a worker's peer server) sends weight "
        "chunks, all requests together; 0: no cap",
        ge=0,
    )
    weights_send_slots: int = F(
        2,
        "chunks a weight server (the trainer's, a worker's peer "
        "server) sends at once; more requests wait their turn, so chunks "
        "reach workers one after another instead of all together late",
        ge=1,
    )
    weights_serve_processes: int = F(
        -1,
        "trainer: processes that send weight chunks (buffer/weights/net_pool.py): 0 or 1: the "
        "trainer's own gRPC process sends them all, under its one GIL (~1 GB/s at most); N >= 2: "
        "N processes of their own (each its port, the same token and TLS; process k sends the "
        "chunks k modulo N), started, health-checked and stopped with the trainer, restarted if "
        "one dies; buffer.weights_send_slots and weights_upload_mb_s are split over them. "
        "-1: min(4, usable CPUs // 2)",
        ge=-1,
        le=64,
    )
    weights_serve_versions: int = F(
        2, "worker: weight versions it keeps serving to peers after fetching them (the newest ones)", ge=1
    )

    def serve_processes(self) -> int:
        """buffer.weights_serve_processes resolved: 0 (the trainer's own process) or N >= 2."""
        n = self.weights_serve_processes
        if n < 0:
            n = min(4, usable_cpus() // 2)
        return n if n >= 2 else 0

    def check(self) -> None:
        if bool(self.grpc_tls_cert) != bool(self.grpc_tls_key):
            raise ConfigError("buffer.grpc_tls_cert and buffer.grpc_tls_key go together: set both (TLS) or neither")
