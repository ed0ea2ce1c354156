"""Shared helpers for the tandem tests.

`make_group` builds one GRPO group of `protocol.experience.Sample` rows with deterministic,
ragged content. It is a plain function (not a fixture) so that helper scripts started as
subprocesses can import it too: `sys.path.insert(0, TESTS_DIR); from conftest import make_group`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = Path(__file__).resolve().parent

if str(REPO_ROOT) not in sys.path:  # subprocess helpers import this file directly
    sys.path.insert(0, str(REPO_ROOT))

from protocol.experience import Sample  # noqa: E402


def sample_id(worker_id: str, batch, idx: int, k: int) -> str:
    return f"{worker_id}/{batch}/{idx}/{k}"


def group_id(worker_id: str, batch, idx: int) -> str:
    return f"{worker_id}/{batch}/{idx}"


def make_group(
    worker_id: str, batch, idx: int, version: int, n: int, prompt_len: int = 7, response_len: int = 5
) -> list[Sample]:
    """`n` samples of one prompt draw, sample ids "{worker}/{batch}/{idx}/{k}".

    Response lengths differ per member (response_len + k) so list columns are ragged; logprobs
    and temperature are not exactly representable in float32, so float32 tolerance matters.
    """
    prompt = [(idx * 31 + j) % 50_000 + 1 for j in range(prompt_len)]
    out = []
    for k in range(n):
        length = response_len + k
        out.append(
            Sample(
                sample_id=sample_id(worker_id, batch, idx, k),
                group_id=group_id(worker_id, batch, idx),
                prompt_id=f"{worker_id}/{batch}/{idx}",  # survives the writer's renaming of ids
                worker_id=worker_id,
                weight_version=version,
                prompt_ids=list(prompt),
                response_ids=[(k * 7 + j) % 50_000 + 3 for j in range(length)],
                behaviour_logprobs=[-0.1 * (j % 13) - 0.0123456789 * k - 0.001 for j in range(length)],
                reward=0.1 * k - 0.3,
                finish_reason="stop" if k % 2 == 0 else "length",
                temperature=0.7,
                data_source="tests/arith",
                created_at=1_700_000_000.123456 + idx,
                finished_at=1_700_000_001.654321 + idx + k,
            )
        )
    return out


# --- two test processes (README command 2: pytest -n 2 --dist loadgroup) --------------------
# The suite is CPU-bound on 2 cores, yet serially it kept them 54% busy (per-test CPU from
# getrusage, 2026-12-03): most tests run one single-threaded process at a time (in-process, or
# one trainer importing torch), so one core idles. Two xdist processes fill it. The heaviest
# tests stay one at a time, in file order, on one of them (group "heavy"): those marked slow or
# chaos (multi-process learning runs, the soak), those sharing a session run (each xdist
# process would make it again), and the SLURM and Ray modules (one cluster, one Ray head, fixed
# paths and ports). So at most one heavy run is beside any other test: the load of the "beside a
# busy loop" runs every test must pass anyway.
#
# An xdist process builds its own copy of a module- or session-scoped fixture: the tests of one
# module split over the two processes ran cli_results, reward_model and default_run twice (30-60
# s each beside a busy loop, 2026-12-07). So the users of each costly shared fixture run in one
# group (the heavy one when any of them is heavy).
HEAVY_FIXTURES = {"status_run", "critic_reference", "slurm", "ray_head"}
HEAVY_MODULES = {"test_slurm.py", "test_ray.py"}
SHARED_FIXTURES = {"cli_results", "default_run", "lora_run", "padded_run", "reward_model"}


def _heavy(item) -> bool:
    return bool(
        item.get_closest_marker("slow")
        or item.get_closest_marker("chaos")
        or HEAVY_FIXTURES & set(item.fixturenames)
        or item.path.name in HEAVY_MODULES
    )


def xdist_groups(items) -> dict[str, str]:
    """nodeid -> xdist group, for the tests that must share one process."""
    heavy_shared = {f for item in items if _heavy(item) for f in SHARED_FIXTURES & set(item.fixturenames)}
    groups = {}
    for item in items:
        shared = sorted(SHARED_FIXTURES & set(item.fixturenames))
        if _heavy(item) or heavy_shared & set(shared):
            groups[item.nodeid] = "heavy"
        elif shared:
            groups[item.nodeid] = f"shares-{shared[0]}"
    return groups


def pytest_collection_modifyitems(config, items):
    groups = xdist_groups(items)
    for item in items:
        if item.nodeid in groups:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))


def subprocess_env() -> dict[str, str]:
    """Environment for helper subprocesses: the repo importable, no stray output buffering."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """launch.local's cache of built-in initial models, one per test session: shared by every
    run the tests start (each builds nothing after the first), never the user's ~/.cache."""
    from launch.local import CACHE_ENV

    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("tandem-cache"))
    yield os.environ[CACHE_ENV]
    if old is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = old


# launch.local's trainer has 2 ranks by default; the tests' runs have one unless they say
# --nproc. On CPU each FSDP rank of the tiny model costs about what one rank alone does (100
# steps: 78 CPU-s for 2 ranks, 38 for 1, the whole run 120 against 76; 2026-12-07), and what
# two ranks do has tests of its own: the local pipeline and Ctrl-C tests, a verl config end to
# end, a rank that dies (all `--nproc 2`), the chaos soak, test_trainer's rank comparisons.
def launch_local(*args: str) -> list[str]:
    """argv of `python -m launch.local ARGS` as the tests run it: without the HTML report at the
    end (~2 s of plotting a run; tests/test_status_report.py checks the report of its run), on
    one trainer rank unless ARGS has --nproc."""
    ranks = [] if "--nproc" in args else ["--nproc", "1"]
    return [sys.executable, "-m", "launch.local", "--no-report", *ranks, *args]


# --- fixed experience for trainer tests: identical data for every run ------------------------
STEPS, GROUPS, N = 8, 4, 4


@pytest.fixture(scope="session")
def experience(tmp_path_factory):
    """Shards generated once by the real tiny model, so trainer runs can be compared."""
    from buffer.config import BufferConfig
    from buffer.run import setup_trainer_run
    from buffer.writer import ShardWriter
    from rollout import builtin_task
    from rollout.engine import HFEngine, SamplingSettings

    base = tmp_path_factory.mktemp("experience")
    setup_trainer_run(str(base / "data")).state.ensure_run_id()  # the shards belong to the runs made by run_folder()
    builtin_task.write_model(base / "model")
    engine = HFEngine(str(base / "model"))
    prompts = [[3 + (i * 3 + j) % 5 for j in range(1 + i % 3)] + [13] for i in range(STEPS * GROUPS)]
    groups = engine.generate(prompts, SamplingSettings(n=N, temperature=1.0, top_p=1.0, max_tokens=3, seed=0))
    writer = ShardWriter.at(str(base / "data"), "w0", BufferConfig(flush_samples=GROUPS * N))
    for i, (p, g) in enumerate(zip(prompts, groups)):
        writer.add_group(
            [
                Sample(
                    "",
                    "",
                    str(i),
                    "w0",
                    0,
                    p,
                    c.token_ids,
                    c.logprobs,
                    float((i + k) % 3) / 2,
                    c.finish_reason,
                    1.0,
                    "tandem/copy",
                    0.0,
                    0.0,
                )
                for k, c in enumerate(g)
            ]
        )
    writer.flush()
    return base


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (torchrun's ranks run in sessions of their own)."""
    import glob

    out, todo = [], [pid]
    while todo:
        for children in glob.glob(f"/proc/{todo.pop()}/task/*/children"):
            try:
                with open(children) as f:
                    found = [int(c) for c in f.read().split()]
            except OSError:  # the task ended meanwhile
                continue
            out += found
            todo += found
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants, as a node failure would. torchrun starts each
    rank in a session of its own, so killpg on torchrun's group leaves the ranks running."""
    import signal

    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_folder(experience, name):
    import shutil

    root = experience / name
    shutil.copytree(experience / "data" / "experience", root / "experience")
    shutil.copy(experience / "data" / "run.json", root / "run.json")
    return root


def trainer_proc(root, model, nproc, *extra, steps=STEPS, groups=GROUPS, rendezvous=("--standalone",)):
    """trainer.main under torchrun; `rendezvous` replaces --standalone (e.g. c10d multi-node)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *rendezvous,
            f"--nproc_per_node={nproc}",
            "-m",
            "trainer.main",
            f"root={root}",
            f"actor_rollout_ref.model.path={model}",
            f"trainer.total_training_steps={steps}",
            f"data.train_batch_size={groups}",
            "trainer.max_staleness=1000",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "trainer.data_timeout_s=60",
            "buffer.poll_interval=0.1",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def uninterrupted_run(experience, name, nproc=2, *extra):
    """A trainer run over the shared experience that must succeed; its run folder."""
    root = run_folder(experience, name)
    p = trainer_proc(root, experience / "model", nproc, *extra)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    return root


# A critic (GAE) and an adaptive in-reward KL coefficient: the actor's final weights depend on
# both, so a resume (tests/test_checkpoint.py) and a second node (tests/test_multinode.py) must
# carry them exactly too.
CRITIC = (
    "algorithm.adv_estimator=gae",
    "critic.optim.lr=1e-2",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.kl_coef=0.1",
    "algorithm.kl_ctrl.horizon=10",
)


@pytest.fixture(scope="session")
def critic_reference(experience):
    """One uninterrupted 2-rank run with CRITIC and sample ids logged, the reference of both the
    resume and the two-node test (one trainer run instead of one each)."""
    return uninterrupted_run(experience, "uninterrupted", 2, "trainer.log_sample_ids=true", *CRITIC)


def ids_by_step(root) -> dict[int, list[str]]:
    """Sample ids trained at each step; a step logged twice (killed, resumed): the later line."""
    import json

    rows = [json.loads(line) for line in (Path(root) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["samples/ids"] for r in rows}


@pytest.fixture(scope="session")
def status_run(tmp_path_factory):
    """One launch.local run observed while it trains (tests/test_status_report.py's observe_run:
    (run folder, observations)), shared by its tests and tests/test_validation.py's."""
    from test_status_report import observe_run

    return observe_run(tmp_path_factory)


def final_weights(root):
    """The newest published version's tensors, checksums verified."""
    from buffer.weights.fs import WeightStore

    store = WeightStore(str(root))
    return dict(store.tensors(store.versions()[-1]))


def fill_disk(filler: str) -> None:
    """Append to `filler` until its filesystem is full to the last byte."""
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for block in (1 << 20, 4096, 1):
            try:
                while os.write(fd, b"\0" * block):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)


def small_filesystem(mountpoint, size_mb: int, argv: list[str]) -> list[str]:
    """`argv` run with a `size_mb` tmpfs mounted at `mountpoint`, in a user and mount namespace
    of its own (no root needed where unprivileged user namespaces are allowed); the test is
    skipped where they are not."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to make a small filesystem")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no user+mount namespace here ({probe.stderr.strip()}): cannot make a small filesystem")
    return [
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={size_mb}m tandem-small "{mountpoint}" && exec "$@"',
        "sh",
        *argv,
    ]


# How far two trainer runs over the same samples in the same steps may end apart when only the
# order of fp32 sums differs (e.g. a run resumed on 1 rank vs the uninterrupted 2-rank run: one
# 16-row backward instead of two 8-row ones plus a gloo sum), as a fraction of how far training
# moved the weights: L2 norms over all weights (`weight_distances`), as in test_trainer. Each
# gradient element changes by ~1e-7 of the largest terms summed into it. Adam's step
# lr*m/(sqrt(v)+eps) is scale-free, so an element whose own gradient is near zero turns that
# rounding into update noise: k_proj.bias in the slow RoPE planes (a key bias shifts all of a
# query's scores almost equally and softmax cancels it) has gradients ~1e-8 against rounding
# ~1e-12 and eps 1e-8, i.e. up to ~3e-4*lr per step. That noise sits in a few dozen elements:
# up to 1.6e-5 each after 5 steps on 1 rank instead of 2 (so an element-wise atol=1e-5 fails on
# some machines), 2e-6 of the distance moved as a norm. A resume defect moves every element:
# measured, Adam's moments restored through bf16 give 8e-4, its step count reset 0.1.
REORDER_REL_BOUND = 1e-4


def weight_distances(ref: dict, run: dict, init_dir) -> tuple[float, float, str]:
    """(|run - ref|, |ref - init|, the tensor with the largest element difference): L2 norms over
    all weights, so a test can bound the difference relative to how far training moved them."""
    from safetensors.torch import load_file

    init = load_file(str(init_dir / "model.safetensors"))
    assert ref.keys() == run.keys()
    differ = sum(((run[k] - ref[k]) ** 2).sum().item() for k in ref) ** 0.5
    moved = sum(((ref[k] - init[k]) ** 2).sum().item() for k in ref) ** 0.5
    worst = max(ref, key=lambda k: (run[k] - ref[k]).abs().max().item())
    return differ, moved, worst


def fetch_at_once(fetchers, version: int, folder) -> list[str]:
    """Every WeightFetcher of `fetchers` fetches `version` at the same time, fetcher i into
    folder/w<i>/v<version> (the peer fan-out tests); their folders, in order. Raises the first
    error of any; each thread is joined within 300 s (a transfer stuck past that fails)."""
    import threading

    dests: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            dests[i] = fetchers[i].fetch(version, str(folder / f"w{i}" / f"v{version}"))
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fetchers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a fetch did not end within 300 s"
    assert not errors, errors
    return [dests[i] for i in range(len(fetchers))]
