"""Issue 15's fixes and later issues' (30.<item>: issue 30; 26a-f: weight deltas; 26g-m: the
trainer's chunk-server processes; 26n: a delta chain in memory; 26o: a network worker waits for
the version in flight; 25a: the row boundaries handed to the attention; 25b:
trainer.checkpoint_every; 25c: one rank reduces once per optimizer step; 27w-a..e: adapter-only
versions on the workers; x1: a rank leaves without
the interpreter's teardown; x2: launch.local restarts a trainer whose rank died;
x3: a restart meets in a fresh rendezvous store; x4: a stopping worker scores its batch;
x5: learn_gpu rl passes --validator settings on), each removed in turn:
its tests must fail without it and pass with it.

    python scripts/fail_before_fix.py [--only 2,5b] [--no-pass-run] [--timeout 1800] [--check]

For each case below the script substitutes text in one product file (the smallest edit that
removes the fix; each anchor must occur exactly once), runs the case's tests with pytest in a
subprocess under a timeout, and restores the file in a `finally`; every test of the case must
fail (a failure, an error or a hang past the timeout). Then, unless --no-pass-run, it runs all
the named tests once on the untouched tree and expects them to pass. It prints a markdown table
(benchmarks/README.md, "Failed before its fix") and exits 1 if a test passed without its fix or
failed with it.

It refuses to run on a dirty tree: a restore writes the committed text back. Nothing else may run
in this tree meanwhile (it would see the fix removed). Not part of the test suite: about 30 min
on a 2-core machine; the SLURM case needs root (tests/test_slurm.py starts a one-node SLURM).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
F = "tests/test_faults.py::"
H = "tests/test_hostile_clients.py::"
EN, WN, CN = "buffer/experience/net_server.py", "buffer/weights/net_server.py", "buffer/control/net_server.py"
C = "tests/test_contained_failures.py::"
D = "tests/test_weights_delta.py::"
L = "tests/test_lora_worker.py::"
P, WP = "tests/test_weights_pool.py::", "buffer/weights/net_pool.py"


@dataclasses.dataclass
class Case:
    key: str  # issue 15's item number, a letter per part of its fix
    what: str  # the edit, in words
    edits: list[tuple[str, str, str]]  # (file, anchor, replacement)
    tests: list[str]


CASES = [
    Case(
        "1",
        "a restarted writer ignores its durable seq claim (workers/<id>.claim)",
        [("buffer/writer.py", "claim = self.sink.read_claim() or {}", "claim = {}")],
        [
            F + "test_restarted_worker_never_reuses_a_consumed_and_pruned_shard_number",
            F + "test_restarted_grpc_worker_is_not_acknowledged_as_a_duplicate",
        ],
    ),
    Case(
        "1b",
        "a gRPC writer's claim counts its unacknowledged shards in samples_before (found "
        "by the chaos soak after the 11 items)",
        [
            (
                "buffer/writer.py",
                '"samples_before": self.samples_written - sum(self._unsure_samples.values()),',
                '"samples_before": self.samples_written,',
            )
        ],
        [F + "test_a_restarted_grpc_worker_counts_each_written_sample_once"],
    ),
    Case(
        "2",
        "no parent-death signal: die_with_agent() returns at once",
        [("trainer/lifeline.py", 'if "TORCHELASTIC_RUN_ID" not in os.environ:', "if True:")],
        [F + "test_killing_torchrun_kills_its_ranks"],
    ),
    Case(
        "3",
        "no run lock: RunLock.acquire takes no fcntl lock",
        [("trainer/run_lock.py", "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", "pass")],
        [F + "test_a_second_trainer_on_the_run_folder_is_refused_naming_the_first"],
    ),
    Case(
        "4",
        "the reader checks neither the run id nor versions from the future",
        [
            (
                "buffer/experience/reader.py",
                "check_origin(table.schema.metadata or {}, worker, seq, path, self.run_id)\n"
                "            check_rows_origin(table, worker, self.stats)\n"
                "            check_not_future(table, current_version)",
                "check_origin(table.schema.metadata or {}, worker, seq, path, None)",
            )
        ],
        [
            F + "test_leftover_experience_of_another_run_is_not_trained_on",
            F + "test_reader_refuses_shards_of_another_run_without_a_run_id_or_from_the_future",
        ],
    ),
    Case(
        "5a",
        "quarantined samples are not counted as retired",
        [("buffer/experience/reader.py", 'self.stats["quarantined_samples"] += _declared_samples(data, path)', "pass")],
        [F + "test_quarantined_and_stale_samples_are_retired_while_the_trainer_waits"],
    ),
    Case(
        "5b",
        "the worker's cap is buffer.max_backlog_samples alone, not sized from one step",
        [
            (
                "buffer/control/backpressure.py",
                'cap = max(limit, int(report.get("batch_groups", 0)) * group_size)',
                "cap = limit",
            )
        ],
        [F + "test_a_step_larger_than_the_backlog_cap_completes"],
    ),
    Case(
        "5c",
        "no age-based flush while blocked by backpressure",
        [("rollout/worker.py", "on_wait=self._flush_while_waiting,", "")],
        [F + "test_a_worker_blocked_by_backpressure_still_flushes_by_age"],
    ),
    Case(
        "6a",
        "the gRPC server never pushes back",
        [("buffer/experience/net_server.py", "        self._backpressure(head, key, context)\n", "")],
        [F + "test_grpc_spool_stops_growing_while_the_trainer_does_not_consume"],
    ),
    Case(
        "6b",
        "the reader ingests every discovered shard, not just one step's",
        [
            (
                "buffer/experience/reader.py",
                "if len(self.pool) >= num_groups:\n                    break  # the rest",
                "if False:\n                    break  # the rest",
            )
        ],
        [F + "test_reader_reads_no_further_than_a_step_needs"],
    ),
    Case(
        "7",
        "maybe_reload catches FileNotFoundError only, not ManifestError",
        [("rollout/worker.py", "except (FileNotFoundError, ManifestError) as e:", "except FileNotFoundError as e:")],
        [F + "test_worker_survives_a_version_pruned_while_it_loads"],
    ),
    Case(
        "7b",
        "the engine's start does not retry a version pruned while the engine loaded it (chaos "
        "soak, 2026-12-02: a worker died with transformers' OSError for the vanished folder)",
        [
            (
                "rollout/worker.py",
                "                if store.exists(version):\n                    raise\n"
                '                log.warning("weight version %d was pruned while the engine',
                "                if True:\n                    raise\n"
                '                log.warning("weight version %d was pruned while the engine',
            )
        ],
        [F + "test_engine_start_survives_the_version_pruned_while_the_engine_loads"],
    ),
    Case(
        "8",
        "the per-shard lock is dropped when its holder ends (waiters or not), and every "
        "push of a shard spools under one temporary name",
        [
            ("buffer/experience/net_server.py", "                if not entry[1]:\n", "                if True:\n"),
            ("buffer/experience/net_server.py", 'f"{os.getpid()}.{next(self._push_ids)}"', "os.getpid()"),
        ],
        [F + "test_concurrent_pushes_of_one_shard_never_publish_damaged_bytes"],
    ),
    Case(
        "9",
        "control.d/<id>.json created by check-then-rename, not by a hard link",
        [
            (
                "buffer/storage.py",
                "if not is_local(fs):\n        if fs.exists(path):",
                "if True:\n        if fs.exists(path):",
            )
        ],
        [F + "test_concurrent_control_commands_are_all_kept_with_distinct_ids"],
    ),
    Case(
        "10a",
        "a full disk is an error like any other (is_disk_full() is False)",
        [("buffer/storage.py", "return isinstance(e, OSError) and e.errno in DISK_FULL", "return False")],
        [F + "test_every_role_outlives_a_full_disk"],
    ),
    Case(
        "10b",
        "no checkpoint by default (trainer.save_freq default 0)",
        [("trainer/config.py", "save_freq: int = F(\n        10,", "save_freq: int = F(\n        0,")],
        [F + "test_a_trainer_killed_before_its_first_checkpoint_starts_again"],
    ),
    Case(
        "10c",
        "versions but no checkpoint: refused, not started again at step 0",
        [("trainer/main.py", 'if cfg.trainer.resume_mode != "auto":', "if True:")],
        [F + "test_a_trainer_killed_before_its_first_checkpoint_starts_again"],
    ),
    Case(
        "10d",
        "staging folders of killed publishes are not removed at start",
        [("trainer/main.py", "self.store.remove_debris()  #", "pass  #")],
        [F + "test_a_trainer_killed_before_its_first_checkpoint_starts_again"],
    ),
    Case(
        "11a",
        "the trainer ignores ROOT/trainer.stop",
        [
            (
                "trainer/main.py",
                "path = self.stores.files.trainer_stop\n        if os.path.exists(path):",
                "path = self.stores.files.trainer_stop\n        if False:",
            )
        ],
        [F + "test_a_stop_request_checkpoints_and_a_restart_resumes"],
    ),
    Case(
        "11b",
        "the trainer job's batch script does not trap USR1 (no stop request, no requeue)",
        [("launch/slurm/trainer.sbatch", "trap stop_requested USR1\n", "")],
        ["tests/test_slurm.py::test_trainer_job_checkpoints_on_the_time_limit_signal_and_is_requeued"],
    ),
    # issue 30, items 3, 4, 6 (the servers protect themselves); keys 30.<item><part>
    Case(
        "30.3a",
        "one thread pool for every service: in_pool leaves the handler on the server's own pool",
        [("buffer/channel.py", "    run.experimental_thread_pool = pool  # type: ignore[attr-defined]\n", "")],
        [H + "test_trickling_pushes_starve_no_honest_call"],
    ),
    Case(
        "30.3b",
        "no eviction of the slowest pushes past buffer.grpc_server_threads",
        [
            (EN, '"grpc-spool", self.servicer.evict_slowest,', '"grpc-spool", lambda n: None,'),
            (EN, "self.evict_slowest(len(streams) - cfg.grpc_server_threads)", "pass"),
        ],
        [H + "test_trickling_pushes_starve_no_honest_call"],
    ),
    Case(
        "30.3c",
        "no minimum rate (only silent pushes are cut)",
        [(EN, "elif s.waiting and rate is not None and rate <", "elif False and rate <")],
        [H + "test_a_slow_or_endless_push_is_cut_by_its_rate_or_deadline"],
    ),
    Case(
        "30.3d",
        "no total deadline per push",
        [(EN, "if now - s.started > cfg.grpc_stream_deadline_s:", "if False:")],
        [H + "test_a_slow_or_endless_push_is_cut_by_its_rate_or_deadline"],
    ),
    Case(
        "30.4a",
        "peers handed out and counted as covering chunks without a probe",
        [
            (WN, "and p not in avoid and e.address in self.answered", "and p not in avoid"),
            (WN, "if p != rep.peer_id and e.address in self.answered and", "if p != rep.peer_id and"),
        ],
        [H + "test_fake_peers_and_reports_for_unpublished_versions"],
    ),
    Case(
        "30.4b",
        "peer reports for versions not published are taken",
        [(WN, "have = self._check_report(rep, context)", "have = rep.have")],
        [H + "test_fake_peers_and_reports_for_unpublished_versions"],
    ),
    Case(
        "30.4c",
        "no bound on the peers registered",
        [(WN, "if rep.peer_id not in table and self._registered() >=", "if False and 0 >=")],
        [H + "test_fake_peers_and_reports_for_unpublished_versions"],
    ),
    Case(
        "30.4d",
        "the hashing lock of a version never published stays in the table",
        [
            (
                WN,
                "                with self._lock:\n                    self._making.pop(version, None)\n",
                "                pass\n",
            )
        ],
        [H + "test_fake_peers_and_reports_for_unpublished_versions"],
    ),
    Case(
        "30.6a",
        "no bound on a sync claim's groups and want",
        [(CN, "if max(request.groups, request.want) > cap:", "if False:")],
        [H + "test_claims_heartbeats_and_worker_ids_are_bounded"],
    ),
    Case(
        "30.6b",
        "heartbeats bounded by the 1 MiB of any document, not 32 KiB",
        [(CN, 'f"heartbeat of {worker_id}", rs.MAX_BEAT_BYTES)', 'f"heartbeat of {worker_id}")')],
        [H + "test_claims_heartbeats_and_worker_ids_are_bounded"],
    ),
    Case(
        "30.6c",
        "no bound on distinct worker ids",
        [(CN, "if worker_id not in self.seen and len(self.seen) >= cap:", "if False:")],
        [H + "test_claims_heartbeats_and_worker_ids_are_bounded"],
    ),
    Case(
        "30.6d",
        "the Heartbeats reply is every heartbeat, however large",
        [(CN, "if sum(sizes) <= rs.MAX_REPLY_BYTES:", "if True:")],
        [H + "test_claims_heartbeats_and_worker_ids_are_bounded"],
    ),
    # issue 30, items 1, 2, 5, 7 and the sync drop
    Case(
        "30.1",
        "a restarted gRPC writer does not re-send its outbox (shards never acknowledged)",
        [("buffer/experience/net_client.py", "        for seq in self.published():\n", "        for seq in []:\n")],
        [F + "test_a_killed_grpc_worker_re_sends_its_unacknowledged_shards_or_declares_them_lost"],
    ),
    Case(
        "30.2",
        "no lock per worker id: two live writers of one id both write",
        [("buffer/experience/fs.py", "        self._hold_worker_id()\n", "")],
        ["tests/test_buffer.py::test_a_second_live_writer_of_a_worker_id_fails_naming_the_holder"],
    ),
    Case(
        "30.5",
        "no seq window: a shard of seq 10**12 is spooled (and bypasses the backlog cap)",
        [("buffer/experience/net_server.py", "        self._seq_bound(head, key, context)\n", "")],
        [
            "tests/test_grpc.py::test_a_seq_far_past_the_highest_accepted_is_refused_and_cannot_bypass_the_cap",
            H + "test_seq_jumps_and_foreign_rows_cost_the_attacker_only",
        ],
    ),
    Case(
        "30.7",
        "a shard's rows are not checked against its key (worker id, sample ids)",
        [("buffer/experience/reader.py", "            check_rows_origin(table, worker, self.stats)\n", "")],
        [
            "tests/test_buffer_integrity.py::test_a_shard_re_encoded_under_another_worker_id_is_quarantined",
            H + "test_seq_jumps_and_foreign_rows_cost_the_attacker_only",
        ],
    ),
    Case(
        "30.sync",
        "sync mode: a claimed group whose rewards were all dropped is not drawn again",
        [("rollout/worker.py", "                    count = self._redraw()\n", "                    count = 0\n")],
        ["tests/test_sync.py::test_a_synchronous_group_whose_rewards_are_all_dropped_is_drawn_again"],
    ),
    # issue 30's items 8-12 (keys 30.<item>)
    Case(
        "30.8",
        "a NOT_FOUND from the trainer mid-download is retried unless it says 'not published'",
        [
            (
                "buffer/weights/net_client.py",
                "if code == grpc.StatusCode.NOT_FOUND:  # the trainer holds every chunk",
                'if code == grpc.StatusCode.NOT_FOUND and "not published" in _why(e):  #',
            )
        ],
        [C + "test_a_version_pruned_mid_download_fails_fast"],
    ),
    Case(
        "30.9",
        "a full weight cache disk fails the fetch (no when_space around it)",
        [
            (
                "buffer/weights/net_client.py",
                "when_space(lambda: fetcher.fetch(version, folder), folder)",
                "fetcher.fetch(version, folder)",
            )
        ],
        [C + "test_a_full_weight_cache_is_waited_out_not_a_crash"],
    ),
    Case(
        "30.10a",
        "a damaged version is not skipped: the worker raises",
        [
            (
                "rollout/worker.py",
                "                bad.add(version)\n                skip(version, e)\n",
                "                raise\n",
            ),
            ("rollout/worker.py", "                self._skip_version(latest, e)\n", "                raise\n"),
        ],
        [C + "test_a_damaged_version_is_skipped_and_the_worker_keeps_a_good_one"],
    ),
    Case(
        "30.10b",
        "launch.local never restarts a dead worker",
        [("launch/local.py", "if code == REFUSED or child.restarts >= max_restarts:", "if True:")],
        [C + "test_launch_local_restarts_a_dead_worker_but_not_a_refusal"],
    ),
    Case(
        "30.11",
        "only RewardError is caught around the reward function",
        [
            (
                "rollout/worker.py",
                "        except Exception as e:  # noqa: BLE001 - a user's reward",
                "        except KeyboardInterrupt as e:  #",
            )
        ],
        [C + "test_a_reward_function_that_raises_costs_that_samples_score_only"],
    ),
    Case(
        "30.12",
        "a garbage control.json is not set aside",
        [("buffer/control/fs.py", "            self._set_aside(e)\n", "            raise\n")],
        [C + "test_a_garbage_control_file_is_set_aside_and_commands_go_on"],
    ),
    Case(
        "30.s",
        "RunClient ignores interrupt(): it retries until buffer.grpc_trainer_wait_s",
        [
            (
                "buffer/channel.py",
                "                if self._interrupted:\n                    raise Interrupted(",
                "                if False:\n                    raise Interrupted(",
            )
        ],
        [C + "test_sigterm_stops_a_worker_waiting_for_an_unreachable_trainer"],
    ),
    # issue 26: weight versions as exact deltas (buffer/weights/delta.py)
    Case(
        "26a",
        "a rebuild copies the base without applying the delta's changed values",
        [
            (
                "buffer/weights/delta.py",
                '_int_view(t)[at] = _int_view(d.get_tensor(f"{key}::val"))',
                "pass",
            )
        ],
        [D + "test_fifty_versions_rebuild_bit_exact_from_deltas"],
    ),
    Case(
        "26b",
        "retention ignores delta chains (only the newest keep_versions stay)",
        [
            (
                "buffer/weights/fs.py",
                "needed = self._chains([*versions[-keep:], *held])",
                "needed = set(versions[-keep:])",
            )
        ],
        [D + "test_fifty_versions_rebuild_bit_exact_from_deltas"],
    ),
    Case(
        "26c",
        "the trainer ignores a reader's snapshot request",
        [("buffer/weights/fs.py", "if os.path.exists(wanted):", "if False:")],
        [D + "test_a_lost_base_makes_the_worker_ask_for_a_snapshot"],
    ),
    Case(
        "26d",
        "a rebuild that fails its checksum is not retried on fresh copies",
        [
            (
                "buffer/weights/delta.py",
                "            if attempt:\n                raise",
                "            if True:\n                raise",
            )
        ],
        [D + "test_a_corrupted_delta_is_caught_by_the_rebuilt_checksum_and_fetched_again"],
    ),
    Case(
        "26e",
        "a rebuild writes into the version's folder in place (no temp folder renamed)",
        [("buffer/weights/delta.py", 'tmp = f"{out}{TMP_MARK}{os.getpid()}-{threading.get_ident()}"', "tmp = out")],
        [D + "test_a_worker_killed_mid_apply_resumes_with_nothing_lost"],
    ),
    Case(
        "26f",
        "temp folders of killed rebuilds are never removed",
        [("buffer/weights/delta.py", "    remove_debris(os.path.dirname(out))\n", "")],
        [D + "test_a_worker_killed_mid_apply_resumes_with_nothing_lost"],
    ),
    Case(
        "27w-a",
        "a worker applies an adapter whatever base it names (the base checksums never compared)",
        [("rollout/versions.py", "        if have != wanted:", "        if False:")],
        [
            L + "test_an_adapter_for_another_base_is_refused_before_anything_loads",
            L + "test_a_worker_process_refuses_a_mismatched_base_exits_2_and_status_shows_refused",
        ],
    ),
    Case(
        "27w-b",
        "an adapter-only version is taken as loaded without reaching the engine (verl #7495)",
        [("rollout/versions.py", "        return engine.load_adapter(folder, version)", "        return 0")],
        [
            L + "test_worker_samples_each_adapter_version_as_the_trainer_computes_it",
            L + "test_adapter_versions_over_the_network_store",
        ],
    ),
    Case(
        "27w-c",
        "a run switching from adapter versions to full weights is loaded as it comes",
        [("rollout/versions.py", "        if self.kind is not None and got != self.kind:", "        if False:")],
        [L + "test_a_run_that_switches_from_adapters_to_full_weights_is_refused"],
    ),
    Case(
        "27w-d",
        "the refusal is not in the worker's heartbeat",
        [("rollout/worker.py", '                "refused": self.refused,\n', "")],
        [L + "test_a_worker_process_refuses_a_mismatched_base_exits_2_and_status_shows_refused"],
    ),
    Case(
        "27w-e",
        "launch.local gives the workers and the validator no base (model path)",
        [("launch/local.py", '    common.append(f"{MODEL}={model}")\n', "")],
        [L + "test_launch_local_gives_the_workers_and_the_validator_their_base"],
    ),
    Case(
        "26g",
        "the worker ignores the trainer's chunk servers (every chunk from its own process)",
        [("buffer/weights/net_client.py", 'return [f"{host}:{p}" if p else "" for p in ports]', "return []")],
        [P + "test_fetch_over_several_serving_processes_is_bit_exact"],
    ),
    Case(
        "26h",
        "the trainer ignores ChunkRequest.sent (a chunk server's deferral): it sends chunks peers hold",
        [(WN, "if all_sent or all(self.served[i] for i in options):", "if all(self.served[i] for i in options):")],
        [P + "test_fetch_over_several_serving_processes_is_bit_exact"],
    ),
    Case(
        "26i",
        "a chunk server that died is never restarted",
        [(WP, "        s.start_at = time.monotonic() + s.backoff_s\n", "        s.start_at = math.inf\n")],
        [P + "test_killed_serving_process_is_replaced_and_the_fetch_completes"],
    ),
    Case(
        "26i2",
        "a chunk server that stopped answering is left in place (Pings not counted)",
        [(WP, "        if s.unanswered >= PING_FAILURES:", "        if False:")],
        [P + "test_hung_serving_process_is_killed_and_replaced"],
    ),
    Case(
        "26j",
        "the pool's stop leaves its processes running",
        [(WP, "            for s in self.servers:\n                self._end(s, STOP_GRACE_S)\n", "")],
        [P + "test_no_orphans_after_the_trainer_server_stops"],
    ),
    Case(
        "26k",
        "a chunk server outlives a killed trainer (no PR_SET_PDEATHSIG, stdin EOF not watched: it "
        "serves 60 s more, then exits, so that the case leaves no orphans of its own)",
        [
            (WP, "ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)", "pass"),
            (WP, "    sys.stdin.buffer.read()  # until EOF", "    time.sleep(60)  # until EOF"),
        ],
        [P + "test_no_orphans_after_the_trainer_is_killed"],
    ),
    Case(
        "26m",
        "the chunk servers listen without TLS when the trainer has it",
        [(WP, "    creds = server_credentials(cfg)\n", "    creds = None\n")],
        [P + "test_chunk_servers_speak_tls_and_check_the_token"],
    ),
    Case(
        "26n",
        "a reader several deltas behind rebuilds every version on the way (no chain in memory)",
        [("buffer/weights/delta.py", "if in_memory and depth == 0", "if False and depth == 0")],
        [D + "test_a_lagging_worker_rebuilds_only_the_version_it_asks_for"],
    ),
    Case(
        "26o",
        "a network worker samples a batch with older weights while the newest version is arriving",
        [("rollout/worker.py", "            self._await_arrival(latest, wait_s)\n", "            pass\n")],
        ["tests/test_run_service.py::test_a_network_worker_waits_at_a_batch_start_for_the_version_in_flight"],
    ),
    Case(
        "25a",
        "the trainer hands the attention no row boundaries (each layer derives them: a host sync, a graph break)",
        [("trainer/algo.py", "        if batch.cu_seqlens is not None:\n", "        if False:\n")],
        [
            "tests/test_attention_bounds.py::test_every_layer_attends_with_the_micro_batch_own_row_bounds",
            "tests/test_attention_bounds.py::test_a_compiled_layer_traces_three_packed_lengths_without_a_graph_break",
        ],
    ),
    Case(
        "25b",
        "trainer.checkpoint_every ignored (every layer checkpointed)",
        [("trainer/model.py", "layer.gradient_checkpointing = i % checkpoint_every == 0", "pass")],
        [
            "tests/test_model.py::test_gradient_checkpointing_recomputes_each_layer_in_backward[True-2]",
            "tests/test_model.py::test_compile_layers_compiles_each_decoder_layer_before_sharding",
        ],
    ),
    Case(
        "25c",
        "one rank reduces gradients after every pass (FSDP's reduce: copies only)",
        [("trainer/update.py", "            sync(i == len(mb.passes) - 1)\n", "")],
        ["tests/test_model.py::test_one_rank_reduces_gradients_once_per_optimizer_step"],
    ),
    Case(
        "26l",
        "buffer.weights_serve_processes unbounded",
        [("buffer/config.py", "        ge=-1,\n        le=64,\n", "")],
        [P + "test_serve_processes_refused_early_with_the_field_named"],
    ),
    Case(
        "x1",
        "a rank's normal end goes through the interpreter's teardown (leave() calls sys.exit)",
        [("trainer/lifeline.py", "    os._exit(code)\n", "    sys.exit(code)\n")],
        ["tests/test_lifeline.py::test_a_rank_that_leaves_is_not_aborted_by_a_gloo_thread_at_teardown"],
    ),
    Case(
        "x2",
        "launch.local's trainer torchrun without --max-restarts (a dead rank ends the run)",
        [
            (
                "launch/local.py",
                '            f"--max-restarts={args.max_restarts}",  # as on SLURM and Ray: every rank again, resumed\n'
                '            "-m",\n            "trainer.main",\n',
                '            "-m",\n            "trainer.main",\n',
            )
        ],
        [F + "test_launch_local_restarts_the_trainer_after_a_rank_dies"],
    ),
    Case(
        "x3",
        "torchrun's rendezvous store shared with the ranks across restarts (launch/torchrun.py's ENV empty)",
        [("launch/torchrun.py", 'ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}', "ENV: dict[str, str] = {}")],
        ["tests/test_torchrun.py::test_a_restarted_attempt_forms_its_group_with_the_launchers_environment"],
    ),
    Case(
        "x4",
        "a worker's stop cuts its batch's scoring before the first call (groups a live server would score dropped)",
        [
            (
                "buffer/reward/net_client.py",
                "        while True:\n            self._refresh()\n",
                "        while True:\n            if should_stop():\n                return None\n"
                "            self._refresh()\n",
            )
        ],
        ["tests/test_reward_server.py::test_a_stop_still_scores_a_group_a_live_server_answers"],
    ),
    Case(
        "x5",
        "learn_gpu rl drops --validator's settings (no way to shrink the validator's held-out batch on an 80 GB card)",
        [("benchmarks/learn_gpu.py", ", *args.validator] for x in", "] for x in")],
        ["tests/test_arith_task.py::test_experiment_script_runs_every_step_on_cpu"],
    ),
]


def dirty() -> str:
    return subprocess.run(
        ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def apply(edits: list[tuple[str, str, str]], originals: dict[Path, str]) -> None:
    """Apply the edits, keeping each file's text before the first in `originals`. An anchor
    must occur exactly once."""
    for name, anchor, replacement in edits:
        path = REPO / name
        current = path.read_text()
        originals.setdefault(path, current)
        count = current.count(anchor)
        if count != 1:
            raise SystemExit(f"{name}: the anchor occurs {count} times, not once (has the fix moved?):\n{anchor}")
        path.write_text(current.replace(anchor, replacement))


def restore(originals: dict[Path, str]) -> None:
    for path, text in originals.items():
        path.write_text(text)


def run_pytest(tests: list[str], timeout_s: float, log: Path) -> dict[str, tuple[str, str, float]]:
    """{test: (outcome, first line of the message, seconds)}; outcome passed, failed, error,
    skipped, or timeout/missing. pytest's output goes to `log`."""
    with tempfile.TemporaryDirectory() as tmp, open(log, "w") as out:
        xml = os.path.join(tmp, "junit.xml")
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
        p = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *tests],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return {t: ("timeout", f"pytest ran past {timeout_s:.0f} s", timeout_s) for t in tests}
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        return (
            _outcomes(xml, tests)
            if os.path.exists(xml)
            else {t: ("missing", f"pytest exited {p.returncode} without a report ({log})", 0.0) for t in tests}
        )


def _outcomes(xml: str, tests: list[str]) -> dict[str, tuple[str, str, float]]:
    got = {}
    for case in ET.parse(xml).iter("testcase"):
        name = case.get("name")
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                # pytest's "E" lines of the report (the message attribute is cut at a newline)
                report = [x[1:] for x in (el.text or "").splitlines() if x.startswith("E ")]
                message = "\n".join(report) or el.get("message") or ""
                break
        got[name] = (outcome, _line(message), float(case.get("time", 0)))
    return {t: got.get(t.rsplit("::", 1)[-1], ("missing", f"not in pytest's report ({xml})", 0.0)) for t in tests}


def _line(message: str) -> str:
    """The message's first informative line, short and safe in a markdown table. An assertion
    whose message is a process's output tail: the last exception named there (not torchrun's
    ChildFailedError), else its last line."""
    lines = [x.strip() for x in message.splitlines() if x.strip()]
    told = [x for x in lines if not x.startswith(("assert ", "+", "where "))] or lines or [""]
    line = told[0]
    if line.rstrip(":") == "AssertionError" and len(told) > 1:
        raised = [x for x in told[1:] if re.search(r"\w(Error|Exception): \S", x) and "ChildFailedError" not in x]
        line = raised[-1] if raised else told[-1]
    line = re.sub(r"/tmp/pytest-of-[^/]+/pytest-\d+/", "", line)
    return (line[:160] + ("..." if len(line) > 160 else "")).replace("|", "\\|")


def table(cases: list[Case], without: dict, with_fix: dict) -> int:
    """Print the markdown table; returns how many tests passed without their fix or did not
    pass with it."""
    bad = 0
    print("\n| item | fix removed (file: edit) | test | without the fix | with the fix |")
    print("| --- | --- | --- | --- | --- |")
    for case in cases:
        files = ", ".join(dict.fromkeys(f"`{e[0]}`" for e in case.edits))
        for test in case.tests:
            out, msg, secs = without[case.key, test]
            fixed = with_fix.get(test)
            # skipped (e.g. no SLURM here) proves nothing either way, and is shown as such
            bad += out in ("passed", "missing") or (
                fixed is not None and fixed[0] in ("failed", "error", "timeout", "missing")
            )
            shown = f"**{out}** ({secs:.0f} s): {msg}" if out != "passed" else "**PASSED: the test is defective**"
            after = f"{fixed[0]} ({fixed[2]:.0f} s)" + (f": {fixed[1]}" if fixed[1] else "") if fixed else "not run"
            print(f"| {case.key} | {files}: {case.what} | `{test.rsplit('::', 1)[-1]}` | {shown} | {after} |")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated case keys (e.g. 2,5b); default all")
    p.add_argument("--no-pass-run", action="store_true", help="skip the run with every fix in place")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run")
    p.add_argument(
        "--logs", default=None, help="folder for pytest's output per run (default: a new temporary folder, printed)"
    )
    p.add_argument("--check", action="store_true", help="only check that every anchor occurs once (changes nothing)")
    args = p.parse_args(argv)
    if args.check:
        counts = [
            (case.key, name, (REPO / name).read_text().count(anchor))
            for case in CASES
            for name, anchor, _ in case.edits
        ]
        for key, name, count in counts:
            print(f"{key}: {name}: {'ok' if count == 1 else f'the anchor occurs {count} times'}")
        return 0 if all(count == 1 for *_, count in counts) else 1
    if dirty():
        print(f"refusing to run: the tree is dirty (commit or stash first):\n{dirty()}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally restores the files
    logs = Path(args.logs or tempfile.mkdtemp(prefix="fail_before_fix-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"pytest's output: {logs}/<item>.log", flush=True)
    only = set(filter(None, args.only.split(",")))
    cases = [c for c in CASES if not only or c.key in only]
    without: dict[tuple[str, str], tuple[str, str, float]] = {}
    for case in cases:
        print(f"[{time.strftime('%H:%M:%S')}] {case.key}: {case.what}", flush=True)
        originals: dict[Path, str] = {}
        try:
            apply(case.edits, originals)
            got = run_pytest(case.tests, args.timeout, logs / f"{case.key}.log")
        finally:
            restore(originals)
        for test, result in got.items():
            without[case.key, test] = result
            print(f"    without the fix: {result[0]} ({result[2]:.0f} s) {result[1]}", flush=True)
    if dirty():
        print(f"the tree is not clean after the restores:\n{dirty()}", file=sys.stderr)
        return 2
    with_fix = {}
    if not args.no_pass_run:
        tests = list(dict.fromkeys(t for c in cases for t in c.tests))
        print(f"[{time.strftime('%H:%M:%S')}] every fix in place: {len(tests)} tests", flush=True)
        with_fix = run_pytest(tests, args.timeout * 2, logs / "with-the-fixes.log")
    bad = table(cases, without, with_fix)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
