"""Issue 28's reward-model server role on a CPU: the scorer (rollout/reward_model.py), the reward
room (buffer/reward/: discovery in the run folder, the gRPC client sharing servers, the server),
and a whole run whose reward server is killed (-9) and started again."""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import launch_local, subprocess_env

from buffer.reward.base import RewardServiceError
from buffer.reward.net_client import GrpcRewardClient, StaticEndpoints
from buffer.reward.net_server import RewardService, serve
from buffer.run import setup_reward_server_run, setup_trainer_run, setup_worker_run
from protocol.config import build
from protocol.experience import decode, from_table
from protocol.reward import RewardEndpoint, model_checksum
from rollout.config import WorkerConfig
from rollout.reward_model import RewardScorer, Row, build_tiny_reward_model, micro_batches

TOKEN = "reward-test-token"
Q = [{"role": "user", "content": "123"}]
RESPONSES = ["123", "12", "1234", "", "321", "0000", "9=9", "1"]


def wait_for(cond, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if out := cond():
            return out
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> str:
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", seed=3)


@pytest.fixture(scope="module")
def scorer(rm_dir) -> RewardScorer:
    return RewardScorer(rm_dir, micro_batch_rows=64, token_budget=4096)


# --- the scorer -----------------------------------------------------------------------------------
def test_micro_batches_keep_the_row_and_token_bounds():
    rows = [Row(i, [0] * n) for i, n in enumerate([5, 1, 9, 3, 3, 7, 30])]
    batches = micro_batches(rows, max_rows=3, token_budget=12)
    assert sorted(r.index for b in batches for r in b) == list(range(7))  # every row once
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * max(len(r.ids) for r in b) <= 12, b  # a 30-token row goes alone


def test_scores_do_not_depend_on_the_micro_batching(rm_dir, scorer):
    alone = RewardScorer(rm_dir, micro_batch_rows=1, token_budget=16)
    batched = scorer.score(Q, RESPONSES)
    # fp32 on a CPU: padding and batch size change the summation order only (observed < 1e-6)
    assert batched == pytest.approx(alone.score(Q, RESPONSES), abs=1e-5)
    assert len(set(round(s, 6) for s in batched)) > 1  # a real model: responses score differently


def test_rows_use_the_reward_models_chat_template_and_keep_their_end(rm_dir, scorer):
    tok = scorer.tokenizer
    assert scorer.encode(Q, "12") == tok("123=12", add_special_tokens=False)["input_ids"]  # template's "="
    short = RewardScorer(rm_dir, max_length=3)
    assert short.encode(Q, "4012") == tok("012", add_special_tokens=False)["input_ids"]  # the end stays
    plain = RewardScorer(rm_dir)
    plain.tokenizer.chat_template = None
    assert plain.encode(Q, "12") == tok("12312", add_special_tokens=False)["input_ids"]  # no template: joined


def test_a_classifier_of_several_outputs_is_refused(tmp_path, rm_dir):
    from transformers import AutoConfig

    bad = tmp_path / "two"
    shutil.copytree(rm_dir, bad)
    config = AutoConfig.from_pretrained(bad)
    config.num_labels = 2
    config.save_pretrained(bad)
    with pytest.raises(ValueError, match="reward_model.model.path: .* 2 labels"):
        RewardScorer(str(bad))


def test_the_checksum_names_the_weights_and_the_chat_template(tmp_path, rm_dir):
    copy = tmp_path / "copy"
    shutil.copytree(rm_dir, copy)
    assert model_checksum(copy) == model_checksum(rm_dir)
    (copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert model_checksum(copy) != model_checksum(rm_dir)


# --- the room: discovery, token, several servers --------------------------------------------------
class Served:
    """A reward server in this process: the service, its grpc server, its endpoint announced."""

    def __init__(self, root: str, scorer: RewardScorer, checksum: str, server_id: str, secret: str = TOKEN):
        buffer = build(WorkerConfig, {"root": root, "data.train_files": "[a]"}).buffer
        self.service = RewardService(scorer, Row, checksum, server_id, secret, threads=4)
        self.server, port = serve(self.service, buffer, "127.0.0.1", 0)
        self.endpoint = RewardEndpoint(server_id, f"127.0.0.1:{port}", checksum, os.getpid(), "here", 0, 0, 1.0)
        self.announcer = setup_trainer_run(root).reward
        self.endpoint.last_beat = time.time()
        self.announcer.announce(self.endpoint)

    def stop(self) -> None:
        self.announcer.withdraw(self.endpoint.server_id)
        self.server.stop(0).wait(5)
        self.service.close()


def worker_run(root: str):
    return setup_worker_run(build(WorkerConfig, {"root": root, "data.train_files": "[a]"}))


def test_a_client_shares_the_announced_servers_with_the_token(tmp_path, monkeypatch, scorer, rm_dir):
    monkeypatch.setenv("TANDEM_GRPC_TOKEN", TOKEN)
    root = str(tmp_path / "run")
    checksum = model_checksum(rm_dir)
    servers = [Served(root, scorer, checksum, f"r{i}") for i in range(2)]
    try:
        assert sorted(e.server_id for e in setup_trainer_run(root).reward.live()) == ["r0", "r1"]
        from launch.status import render, snapshot

        shown = snapshot(root)["reward_servers"]
        assert [(s["server_id"], s["live"], s["scorer"]) for s in shown] == [(f"r{i}", True, checksum) for i in (0, 1)]
        render(snapshot(root))  # launch.status draws them
        client = worker_run(root).reward_client([], wait_s=30, call_timeout_s=10, max_inflight=4)
        groups = [(f"g{i}", Q, RESPONSES[i % 4 :]) for i in range(12)]
        replies = client.score_groups(groups)
        for (_, _, responses), reply in zip(groups, replies):
            assert reply is not None and reply.scorer == checksum
            assert reply.scores == pytest.approx(scorer.score(Q, responses), abs=1e-5)  # as batched above
        assert all(s.service.stats["groups"] > 0 for s in servers), [s.service.stats for s in servers]
        client.close()
        monkeypatch.setenv("TANDEM_GRPC_TOKEN", "wrong")
        stranger = worker_run(root).reward_client([], wait_s=30, call_timeout_s=10, max_inflight=1)
        with pytest.raises(RewardServiceError, match="UNAUTHENTICATED"):
            stranger.score("g", Q, ["1"])
        stranger.close()
    finally:
        for s in servers:
            s.stop()
    assert setup_trainer_run(root).reward.live() == []  # withdrawn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_waited_for_by_address_and_nothing_is_lost(
    tmp_path, monkeypatch, caplog, scorer, rm_dir
):
    monkeypatch.setenv("TANDEM_GRPC_TOKEN", TOKEN)
    buffer = build(WorkerConfig, {"root": str(tmp_path), "data.train_files": "[a]"}).buffer
    address = f"127.0.0.1:{free_port()}"
    client = GrpcRewardClient(
        StaticEndpoints([address]), buffer, wait_s=1.5, call_timeout_s=2, max_inflight=2, note_s=0.4
    )
    caplog.set_level(logging.INFO, "buffer.reward.net_client")
    with pytest.raises(TimeoutError, match=f"reward_model.wait_s.*{address}"):
        client.score("g0", Q, ["1"])
    waits = [r.getMessage() for r in caplog.records if "waiting for a reward server" in r.getMessage()]
    assert len(waits) >= 2 and all(address in w for w in waits), waits  # said again every note_s
    # A group waiting when the server comes up is scored then, once.
    caplog.clear()
    patient = GrpcRewardClient(
        StaticEndpoints([address]), buffer, wait_s=60, call_timeout_s=5, max_inflight=2, note_s=0.2
    )
    out: list = []
    waiter = threading.Thread(target=lambda: out.append(patient.score("g1", Q, RESPONSES)), daemon=True)
    waiter.start()
    wait_for(lambda: any("waiting for a reward server" in r.getMessage() for r in caplog.records), 30, "a waiting line")
    service = RewardService(scorer, Row, model_checksum(rm_dir), "late", TOKEN)
    server, _ = serve(service, buffer, "127.0.0.1", int(address.rsplit(":", 1)[1]))
    try:
        waiter.join(timeout=60)
        assert not waiter.is_alive() and out and out[0].scores == pytest.approx(scorer.score(Q, RESPONSES), abs=1e-5)
        assert service.stats["groups"] == 1
    finally:
        server.stop(0).wait(5)
        service.close()
        patient.close()
        client.close()


def test_a_stop_still_scores_a_group_a_live_server_answers(tmp_path, monkeypatch, scorer, rm_dir):
    """A worker told to stop finishes its batch: the stop cuts a wait for a server, not a call
    that a live one answers (launch.local's end of run cut the batch in scoring: the killed-
    server test's groups_unscored was 32 in a loaded full run)."""
    monkeypatch.setenv("TANDEM_GRPC_TOKEN", TOKEN)
    root = str(tmp_path / "run")
    served = Served(root, scorer, model_checksum(rm_dir), "r0")
    try:
        client = worker_run(root).reward_client([], wait_s=30, call_timeout_s=10, max_inflight=2)
        replies = client.score_groups([("g0", Q, RESPONSES), ("g1", Q, RESPONSES[1:])], should_stop=lambda: True)
        assert [r is not None and r.scores == pytest.approx(scorer.score(Q, rs), abs=1e-5) for r, rs in
                zip(replies, (RESPONSES, RESPONSES[1:]))] == [True, True]  # fmt: skip
        client.close()
    finally:
        served.stop()


def test_a_stop_while_waiting_gives_the_group_back_unscored(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_GRPC_TOKEN", TOKEN)
    buffer = build(WorkerConfig, {"root": str(tmp_path), "data.train_files": "[a]"}).buffer
    client = GrpcRewardClient(StaticEndpoints([f"127.0.0.1:{free_port()}"]), buffer, 60, 2, 1)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    assert client.score("g", Q, ["1"], should_stop=stop.is_set) is None
    assert time.monotonic() - t0 < 10  # the stop ends the wait, not reward_model.wait_s (60 s)
    client.close()


# --- a run whose reward server dies ----------------------------------------------------------------
def reward_server(root: Path, rm: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rollout.reward_server", "--run", str(root), "--model", rm, "--id", "r0"]
    cmd += ["--device", "cpu", "--host", "127.0.0.1", "--set", "server.beat_s=0.5"]
    log = open(root.parent / f"reward-{time.monotonic_ns()}.log", "wb")
    env = {**subprocess_env(), "TANDEM_GRPC_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def shards(root: Path) -> list[str]:
    return sorted(glob.glob(str(root / "experience" / "*" / "*.arrow")))


def worker_lines(root: Path, text: str) -> list[str]:
    return [
        line
        for f in glob.glob(str(root / "logs" / "worker-*.log"))
        for line in Path(f).read_text(errors="replace").splitlines()
        if text in line
    ]


@pytest.mark.slow
def test_a_killed_reward_server_is_waited_for_and_no_group_is_lost_or_scored_twice(tmp_path, rm_dir):
    root = tmp_path / "run"
    cmd = launch_local("--root", str(root), "--steps", "4", "--test-freq", "0")
    cmd += ["--timeout", "500", "--trainer", "buffer.retention=keep"]  # every shard stays to be counted
    for kv in ("reward_model.enable=true", f"reward_model.model.path={rm_dir}", "reward_model.wait_s=300"):
        cmd += ["--worker", kv]
    run = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**subprocess_env(), "TANDEM_GRPC_TOKEN": TOKEN}
    )
    first = second = None
    try:
        wait_for(lambda: (root / "logs").is_dir(), 120, "launch.local to create the run folder")
        first = reward_server(root, rm_dir)
        wait_for(lambda: shards(root), 300, "a first scored shard")
        first.send_signal(signal.SIGKILL)  # our own process handle: never by name
        first.wait(timeout=30)
        killed_at = time.time()
        waiting = wait_for(
            lambda: [ln for ln in worker_lines(root, "waiting for a reward server") if _after(ln, killed_at)],
            120,
            "a worker saying which reward server it waits for",
        )
        assert "127.0.0.1:" in waiting[0] or f"{root}/reward" in waiting[0], waiting
        beats = setup_trainer_run(str(root)).heartbeats
        wait_for(  # the waiting worker's heartbeat stays fresh (launch.status: waiting, not silent)
            lambda: any(b["state"] == "waiting" and b["last_beat"] > killed_at + 6 for b in beats.all()),
            60,
            "a fresh 'waiting' heartbeat during the outage",
        )
        written_while_down = len(shards(root))
        second = reward_server(root, rm_dir)
        out, _ = run.communicate(timeout=600)
    finally:
        for p in (run, first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    text = out.decode(errors="replace")
    assert run.returncode == 0, text[-3000:]
    # The workers waited through the outage: none died (a restarted worker loses the groups it
    # held unscored), and the one that waited went on with the new server.
    assert "starting it again" not in text, text[-3000:]
    assert [ln for ln in worker_lines(root, "answers (after") if _after(ln, killed_at)], "no worker resumed"
    files = shards(root)
    assert len(files) > written_while_down  # scored again after the restart
    checksum = model_checksum(rm_dir)
    groups: dict[str, int] = {}
    per_worker: dict[str, int] = {}
    for f in files:
        for s in from_table(decode(Path(f).read_bytes())):
            groups[s.group_id] = groups.get(s.group_id, 0) + 1
            per_worker[s.worker_id] = per_worker.get(s.worker_id, 0) + 1
            assert s.scorer == checksum and 0 <= s.rule_reward <= 1, s
    assert set(groups.values()) == {16}, groups  # each group once, whole (rollout.n=16 in the recipe)
    for beat in setup_trainer_run(str(root)).heartbeats.all():
        # every group a worker generated is in the experience: written once, none cut off unscored
        assert per_worker[beat["worker_id"]] == beat["samples_written"], (beat, per_worker)
        assert beat["reward_model"]["groups_unscored"] == 0 and beat["rewards_dropped"] == 0, beat
        seqs = sorted(int(Path(f).stem) for f in files if f"/{beat['worker_id']}/" in f)
        assert seqs == list(range(len(seqs))), seqs  # no shard number missing


def _after(line: str, t: float) -> bool:
    """A log line ("2026-12-02 15:47:42,988 ...") written after unix time `t` (1 s of slack)."""
    try:
        stamp = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
    except ValueError:
        return False
    return stamp >= int(t) - 1


def test_submit_renders_one_reward_server_per_gpu(tmp_path):
    root = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "launch.submit", "reward", "--root", root, "--partition", "rm", "--nodes", "2"]
    cmd += ["--gpus-per-node", "4", "--dry-run", "reward_model.model.path=/models/rm", "reward_model.max_length=4096"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=4" in script and "--gpus-per-node=4" in script
    assert f"-m rollout.reward_server --run {root} --set reward_model.model.path=/models/rm" in script
    assert "reward_task.sh" in script and "TANDEM_BIND_GPU=1" in script
    bad = subprocess.run([*cmd, "server.id=x"], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert bad.returncode == 2 and "server.id: set per task" in bad.stderr, bad.stderr
    none = subprocess.run(
        [sys.executable, "-m", "launch.submit", "reward", "--root", root, "--dry-run"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert none.returncode == 2 and "reward_model.model.path" in none.stderr, none.stderr


def test_without_the_run_folder_servers_are_found_through_the_run_service(tmp_path, scorer, rm_dir):
    """buffer.transport=grpc: the reward server announces itself to the trainer's run service
    and the worker finds it there; neither has the trainer's folder."""
    from buffer.config import BufferConfig
    from rollout.config import RewardServerConfig

    port = free_port()
    (tmp_path / "token").write_text(TOKEN)
    buffer = BufferConfig(
        transport="grpc",
        grpc_bind=f"127.0.0.1:{port}",
        grpc_address=f"127.0.0.1:{port}",
        grpc_token_file=str(tmp_path / "token"),
        grpc_call_timeout_s=10,
        grpc_trainer_wait_s=20,
        grpc_linger_s=0,
    )
    trainer = setup_trainer_run(str(tmp_path / "trainer"))
    trainer.state.ensure_run_id()
    service = trainer.serve(buffer)
    checksum = model_checksum(rm_dir)
    reward = RewardService(scorer, Row, checksum, "r0", TOKEN)
    server, rport = serve(reward, buffer, "127.0.0.1", 0)
    try:
        announcer = setup_reward_server_run(RewardServerConfig(root=str(tmp_path / "rm-own"), buffer=buffer))
        announcer.announce(RewardEndpoint("r0", f"127.0.0.1:{rport}", checksum, 1, "h", 0, time.time(), 1.0))
        assert [e.server_id for e in trainer.reward.live()] == ["r0"]  # in the trainer's folder
        worker = setup_worker_run(WorkerConfig(root=str(tmp_path / "worker"), buffer=buffer))
        client = worker.reward_client([], wait_s=30, call_timeout_s=10, max_inflight=2)
        reply = client.score("g0", Q, RESPONSES)
        assert reply.scorer == checksum and reply.scores == pytest.approx(scorer.score(Q, RESPONSES), abs=1e-5)
        client.close()
        announcer.withdraw("r0")
        assert worker.reward_endpoints.live() == []
        assert not (tmp_path / "worker" / "reward").exists()  # nothing of it in the worker's own folder
    finally:
        server.stop(0).wait(5)
        reward.close()
        service.stop(grace_s=1)


# --- the reward pool: launch.pool pool.role=reward, grown and shrunk by the control file ----------
def test_the_control_file_grows_and_shrinks_a_pool_of_reward_servers(tmp_path, rm_dir):
    """`launch.pool pool.role=reward` runs reward servers as the control commands of role
    'reward' say, and ignores the rollout pool's: `add 1` announces a second server, `remove 1`
    drains the newest (withdrawn, exit 0), a rollout command changes nothing; SIGTERM drains all."""
    root = tmp_path / "run"
    root.mkdir()
    endpoints = setup_trainer_run(str(root)).reward
    cmd = [sys.executable, "-m", "launch.pool", f"root={root}", "pool.id=rm", "pool.role=reward"]
    cmd += ["pool.initial_workers=1", "pool.poll_interval=0.2", f"reward_model.model.path={rm_dir}"]
    cmd += ["server.device=cpu", "server.host=127.0.0.1", "server.beat_s=0.5"]
    log_path = tmp_path / "pool.log"
    env = {**subprocess_env(), "TANDEM_GRPC_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}

    def control(*args: str) -> None:
        subprocess.run([sys.executable, "-m", "launch.control", "--root", str(root), *args], check=True, timeout=60)

    def live() -> set[str]:
        return {e.server_id for e in endpoints.live()}

    with open(log_path, "wb") as log:
        pool = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: live() == {"rm-r0"}, 120, "the first reward server's endpoint")
        control("add", "3")  # the rollout pool's command: not this pool's
        control("--role", "reward", "add", "1")
        wait_for(lambda: live() == {"rm-r0", "rm-r1"}, 120, "a second reward server after 'add 1'")
        control("--role", "reward", "remove", "1")
        wait_for(lambda: live() == {"rm-r0"}, 60, "the newest server withdrawn after 'remove 1'")
        wait_for(lambda: "rm-r1 exited with code 0" in log_path.read_text(), 60, "the drained server's exit")
        state = json.loads((root / "pool" / "rm.json").read_text())
        assert state["target"] == 1 and len(state["applied"]) == 2, state  # the rollout 'add 3' not applied
        pool.send_signal(signal.SIGTERM)
        assert pool.wait(timeout=120) == 0
    finally:
        if pool.poll() is None:
            pool.kill()
            pool.wait(timeout=30)
    text = log_path.read_text()
    assert "rm-r0 exited with code 0" in text and "crashed" not in text, text[-3000:]
    assert live() == set(), "a drained server withdraws its endpoint"
