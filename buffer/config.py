"""Settings of the experience transport, shared by rollout workers (writers) and the trainer."""
from __future__ import annotations

import dataclasses

from protocol.config import ConfigError, F


@dataclasses.dataclass
class BufferConfig:
    flush_interval: float = F(30.0, "seconds: publish buffered groups at least this often", gt=0)
    flush_samples: int = F(512, "publish a shard once this many samples are buffered", ge=1)
    discovery: str = F("auto", "how the trainer finds new shards: 'auto' polls and also listens to "
                       "filesystem events (watchdog) where they are delivered; 'poll' only polls "
                       "(events never arrive from other nodes on NFS/Lustre)",
                       choices=("auto", "poll"))
    poll_interval: float = F(1.0, "seconds between listings of the experience folder", gt=0)
    full_scan_interval: float = F(60.0, "seconds between full listings of every worker folder; "
                                  "between them the trainer only probes for each worker's next "
                                  "shard (cost grows with new shards, not with all shards), the "
                                  "full listing catches gaps in a worker's sequence", gt=0)
    retention: str = F("delete", "what happens to shards consumed and covered by a committed "
                       "checkpoint: 'delete', 'archive' (moved to archive/) or 'keep'",
                       choices=("delete", "archive", "keep"))
    tmp_timeout_s: float = F(3600.0, "temporary shard/heartbeat files older than this are "
                             "leftovers of dead writers and are removed", gt=0)
    max_backlog_samples: int = F(1024, "workers pause while more samples than this are written "
                                 "but not yet trained on or dropped by the trainer", ge=1)
    backlog_timeout_s: float = F(1800.0, "seconds a worker waits for the backlog to drain (with "
                                 "trainer.max_staleness=0: for the next weight version) before "
                                 "failing (the trainer is presumed dead)", gt=0)
    transport: str = F("fs", "how shards reach the trainer: 'fs' (a shared folder) or 'grpc' "
                       "(pushed to the trainer, which spools them on its disk)", choices=("fs", "grpc"))
    grpc_address: str = F("localhost:50051", "worker: the trainer's gRPC address host:port")
    grpc_bind: str = F(":50051", "trainer: host:port the gRPC server listens on; ':PORT' (the "
                       "default) is this node's address (its hostname's) plus loopback, never "
                       "every interface. Off this host without TLS it warns: the token would "
                       "cross the network in clear")
    grpc_token_file: str | None = F(None, "file holding the shared token (else $TANDEM_GRPC_TOKEN)")
    grpc_tls_cert: str | None = F(None, "trainer: TLS certificate (PEM); with grpc_tls_key enables TLS")
    grpc_tls_key: str | None = F(None, "trainer: TLS private key (PEM)")
    grpc_tls_ca: str | None = F(None, "worker: CA certificate (PEM) to verify the trainer; enables TLS")
    grpc_max_shard_mb: int = F(256, "trainer: largest shard it accepts, MiB (flush_samples must fit)",
                               ge=1)
    grpc_chunk_kb: int = F(1024, "worker: a shard is streamed in messages of this many KiB (the "
                           "trainer hashes and writes each as it arrives)", ge=16, le=4096)
    grpc_server_threads: int = F(16, "trainer: pushes handled at once (over all workers); more "
                                 "wait in the gRPC queue", ge=1)
    grpc_max_inflight: int = F(8, "shards a worker may have unacknowledged before it blocks", ge=1)
    grpc_timeout_s: float = F(60.0, "seconds one push may take before it is retried", gt=0)
    grpc_idle_timeout_s: float = F(30.0, "trainer: a push that sends nothing for this many seconds "
                                   "is cancelled, so stalled clients cannot hold the server's "
                                   "threads (the worker resends it)", gt=0)
    grpc_max_pushes_per_worker: int = F(8, "trainer: pushes of one worker id handled at once; "
                                        "more are refused (RESOURCE_EXHAUSTED) and resent later",
                                        ge=1)
    grpc_claim_ttl_s: float = F(60.0, "trainer: a worker id belongs to the writer that pushed it "
                                "last until this many seconds after its last push; another "
                                "writer using the id meanwhile is refused (ABORTED, resent: a "
                                "restarted worker takes over after this)", gt=0)
    grpc_call_timeout_s: float = F(30.0, "deadline of one run-service call (a heartbeat, the "
                                   "weights pointer, a claim, one stretch of a weight file); a "
                                   "call past it is retried", gt=0)
    grpc_trainer_wait_s: float = F(1800.0, "a worker, validator or pool without the run folder "
                                   "(transport grpc) waits this long for an unreachable trainer "
                                   "(not started yet, restarting), saying so every 30 s, before "
                                   "it fails", gt=0)
    grpc_linger_s: float = F(60.0, "trainer: after its last step it goes on serving the run "
                             "service, at most this long, until every worker's heartbeat says "
                             "stopped (so that workers without the run folder learn the run "
                             "ended)", ge=0)
    grpc_cache_versions: int = F(2, "worker (transport grpc): weight versions kept in the cache "
                                 "in its own folder (ROOT/weights)", ge=1)

    def check(self) -> None:
        if bool(self.grpc_tls_cert) != bool(self.grpc_tls_key):
            raise ConfigError("buffer.grpc_tls_cert and buffer.grpc_tls_key go together: set both "
                              "(TLS) or neither")
