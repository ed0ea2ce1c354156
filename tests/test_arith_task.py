"""The GSM8K-format task (rollout/tasks/arith.py): generator, verl's gsm8k reward, tokenizer and
model folder, the readers of both parquet formats, launch.local --task arith; then, as real
processes, issue 14's experiment script on CPU (build, SFT, RL, plots: benchmarks/learn_gpu.py)."""

import json
import operator
import os
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO_ROOT

from benchmarks import plot_learning
from buffer.layout import RunLayout
from buffer.run import setup_trainer_run
from launch import local
from launch.status import split_metrics
from rollout import builtin_task, reward
from rollout.dataset import load_prompts
from rollout.tasks import arith
from trainer.sft_config import SFTDataConfig
from trainer.sft_data import load_sequences

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
STEP = re.compile(r"<<(\d+)([-+*/])(\d+)=(\d+)>>(\d+) ")


def solved(solution: str) -> int:
    """The answer of a worked solution, after checking each step's arithmetic, that it starts
    from the previous result and states its result after the annotation."""
    *steps, last = solution.split("\n")
    value = None
    for line in steps:
        a, op, b, c, stated = STEP.search(line).groups()
        a, b, c = int(a), int(b), int(c)
        assert op != "/" or a % b == 0, line
        assert OPS[op](a, b) == c == int(stated), line
        assert value is None or a == value, (line, value)
        value = c
    assert last == f"#### {value}", (last, value)
    return value


def test_generator_is_seeded_and_every_solution_is_right():
    pairs = arith.make_qa(3000, seed=0)
    assert pairs == arith.make_qa(3000, seed=0)
    assert pairs != arith.make_qa(3000, seed=1)
    tiers = [solution.count("\n") for _, solution in pairs]  # one line per operation
    assert {t: tiers.count(t) for t in set(tiers)} == {1: 1000, 2: 1000, 3: 1000}
    for question, solution in pairs:
        answer = solved(solution)
        assert 0 < answer < arith.MAX_VALUE and question.endswith("have now?"), (question, solution)
    with pytest.raises(AssertionError):  # the checker itself catches a wrong step
        solved("He buys 3 more, so he has 4+3=<<4+3=8>>8 eggs.\n#### 8")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The task's files and tiny model, written by the CLI (verl's preprocessing shape)."""
    out = tmp_path_factory.mktemp("arith")
    assert (
        arith.main(
            ["--local_save_dir", str(out / "data"), "--rows", "600", "--model", str(out / "model"), "--size", "tiny"]
        )
        == 0
    )
    return out


def rows(task, kind, split):
    return pq.read_table(task / "data" / f"{kind}_{split}.parquet").to_pylist()


def test_rows_have_verl_gsm8k_shape_and_verl_reward_scores_them(task):
    score = reward.resolve(None, "compute_score")  # the workers' and validator's reward path
    train_q = {r["extra_info"]["question"] for r in rows(task, "rl", "train")}
    for split in ("train", "val"):
        rl, sft = rows(task, "rl", split), rows(task, "sft", split)
        assert len(rl) == len(sft) > 0
        for r, s in zip(rl, sft):  # written in the same order from the same pairs
            assert r["data_source"] == "openai/gsm8k" and r["ability"] == "math"
            assert r["reward_model"]["style"] == "rule"
            [message] = r["prompt"]
            assert message["role"] == "user" and message["content"] == s["prompt"]
            assert s["prompt"].endswith(' Let\'s think step by step and output the final answer after "####".')
            truth = r["reward_model"]["ground_truth"]
            assert truth == str(solved(s["response"]))
            assert score(r["data_source"], s["response"], truth, r["extra_info"]) == 1.0
            wrong = s["response"].rsplit("#### ", 1)[0] + f"#### {int(truth) + 1}"
            assert score(r["data_source"], wrong, truth, r["extra_info"]) == 0.0
            assert score(r["data_source"], s["response"].replace("####", "="), truth, {}) == 0.0
    held_out = {r["extra_info"]["question"] for r in rows(task, "rl", "val")}
    assert len(held_out) == 30 and not held_out & train_q  # 5% of 600, whole questions


def test_tokenizer_round_trips_and_has_a_qwen2_chat_template(task):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(task / "model")
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    for s in rows(task, "sft", "val"):
        for text in (s["prompt"], s["response"]):
            assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    ids = tok("123+45=168", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[:3] == ["1", "2", "3"]  # one token per digit
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    config, gen = AutoConfig.from_pretrained(task / "model"), GenerationConfig.from_pretrained(task / "model")
    assert config.model_type == "qwen2" and config.vocab_size == len(tok)
    assert config.eos_token_id == gen.eos_token_id == tok.eos_token_id
    assert (task / "model" / "model.safetensors").exists()
    # 256 bytes, 3 specials, and merges until every word of the task's text is one token (~550)
    assert 400 < len(tok) < 4096


def test_model_sizes():
    def params(size):
        with torch.device("meta"):  # shapes only
            model = builtin_task.build_model(600, **arith.MODEL_SIZES[size])
        return sum(p.numel() for p in model.parameters())

    assert params("tiny") < 1_000_000 and 10_000_000 < params("gpu") < 100_000_000


def test_both_parquet_formats_load_in_their_readers(task):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(task / "model")
    rl = str(task / "data" / "rl_train.parquet")
    prompts = load_prompts([rl], tok, "prompt", arith.MAX_PROMPT_LENGTH)
    assert len(prompts) == len(rows(task, "rl", "train"))  # none is longer than the bound
    sft = str(task / "data" / "sft_train.parquet")
    seqs = load_sequences(
        [sft], tok, SFTDataConfig(train_files=[sft], max_length=arith.MAX_PROMPT_LENGTH + arith.MAX_RESPONSE_LENGTH)
    )
    first = rows(task, "sft", "train")[0]
    assert tok.decode(seqs.ids[0][seqs.target[0]]) == first["response"] + "<|im_end|>"


def test_launch_local_task_arith_writes_the_task_and_its_recipe(tmp_path):
    args = local.parse_args(["--root", str(tmp_path), "--task", "arith"])
    layout = RunLayout(str(tmp_path))
    model, data, val = local.prepare(setup_trainer_run(layout.root), args, {})
    assert model == layout.init_model and data == layout.prepared_parquet("rl", "train")
    assert val == [layout.prepared_parquet("rl", "val")]
    assert pq.read_table(data).column("data_source").to_pylist()[0] == "openai/gsm8k"
    _, worker = local.recipe({}, args)
    assert f"data.max_response_length={arith.MAX_RESPONSE_LENGTH}" in worker
    assert local.sft_max_length(args) == arith.MAX_PROMPT_LENGTH + arith.MAX_RESPONSE_LENGTH


def _step(res, *args):
    out = subprocess.run(
        ["bash", "benchmarks/learn_gpu.sh", args[0], str(res), *args[1:], "--cpu"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHON=sys.executable),
    )  # this venv's, activated or not
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_experiment_script_runs_every_step_on_cpu(tmp_path):
    """benchmarks/learn_gpu.sh --cpu: build, SFT (trainer.sft) choosing the RL start, RL through
    launch.local --task arith in mode s1 with validation, plots; each step in a fresh results
    folder, as on a fresh machine, taking the previous step's exported parts."""
    hand1, hand2 = tmp_path / "out1", tmp_path / "out2"
    _step(tmp_path / "a", "build")
    _step(tmp_path / "a", "sft", "--export", str(hand1))
    accuracy = json.loads((tmp_path / "a" / "sft" / "accuracy.json").read_text())
    assert set(accuracy) == {"2", "4"}
    assert (tmp_path / "a" / "start").resolve().parent == tmp_path / "a" / "sft" / "weights"
    res = tmp_path / "b"
    # --validator: an extra validator setting after the profile's (a smaller batch of held-out
    # prompts than the profile's, as an 80 GB card needs on the GPU), passed through to launch.local
    out = _step(res, "rl", "s1", "--import", str(hand1), "--export", str(hand2), "--validator", "data.val_batch_size=5")
    assert "--validator data.val_batch_size=64 --validator data.val_batch_size=5" in out, out[-3000:]
    assert json.loads((res / "sft" / "accuracy.json").read_text()) == accuracy
    train, vals = split_metrics([json.loads(x) for x in open(res / "rl-s1" / "metrics.jsonl")])
    assert [r["step"] for r in train] == [1, 2, 3] and train[-1]["samples/consumed"] == 3 * 4 * 4
    assert all(r["response_length/max"] <= arith.MAX_RESPONSE_LENGTH for r in train)
    key = "val-core/openai/gsm8k/reward/mean@1"
    assert [v["step"] for v in vals if key in v] == [0, 2, 3]  # before training, test_freq 2, last
    plots = tmp_path / "c"
    out = _step(plots, "plot", "--import", str(hand2))
    names = {p.name for p in (plots / "plots").iterdir()}
    assert {
        "accuracy_time.png",
        "accuracy_samples.png",
        "throughput.png",
        "busy.png",
        "staleness.png",
        "summary.md",
    } <= names, out
    [row] = json.loads((plots / "plots" / "summary.json").read_text())
    assert row["run"] == "s1" and row["samples"] == 48 and row["metric"] == key
    assert 0 <= row["trainer_idle"] <= 1 and 0 < row["worker_busy"] <= 1 and row["ideal_speedup"] <= 2
    # against a sync run (here the same folder): time-to-accuracy and speedup are relative to it
    assert (
        plot_learning.main(
            [str(plots / "rl-s1"), str(plots / "rl-s1"), "--labels", "sync,s1", "--out", str(tmp_path / "cmp")]
        )
        == 0
    )
    table = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert [r["run"] for r in table] == ["sync", "s1"]
    assert all(r["speedup_vs_sync"] == 1.0 and r["sync_final"] == row["final"] for r in table)


def test_experiment_places_the_vllm_worker_beside_the_trainer_on_one_gpu():
    """learn_gpu's GPU placement: one GPU shares GPU 0 at the stated vLLM memory fraction (vLLM
    takes that share up front, so the trainer and validator need the rest); two keep the worker
    alone on GPU 1 at vLLM's own default."""
    from benchmarks.learn_gpu import gpu_placement

    flags, memory = gpu_placement("one", 0.25)
    assert flags == ["--trainer-gpus", "0", "--worker-gpus", "0", "--validator-gpu", "0"]
    assert memory == 0.25
    flags, memory = gpu_placement("two", 0.25)
    assert flags == ["--trainer-gpus", "0", "--worker-gpus", "1", "--validator-gpu", "0"]
    assert memory is None
    # this machine has no GPU: 'auto' is never 'one' here (0 visible), so the two-GPU flags
    assert gpu_placement("auto", 0.3)[1] is None
