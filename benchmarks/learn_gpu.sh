#!/usr/bin/env bash
# Issue 14's experiment on one or two H200s, one step per command (each under 10 minutes),
# every step resuming from the files the previous one left in RES (benchmarks/learn_gpu.py):
#   bash benchmarks/learn_gpu.sh build RES          # task, BPE tokenizer, 27M Qwen2   (~1 min)
#   bash benchmarks/learn_gpu.sh sft RES            # SFT on GPU 0, choose the RL start (~5 min)
#   bash benchmarks/learn_gpu.sh rl RES sync        # then s1, s2, s4: vLLM worker on GPU 1,
#                                                   # trainer + validator on GPU 0     (<9 min each)
#                                                   # (one GPU visible: all on GPU 0, --placement)
#   bash benchmarks/learn_gpu.sh plot RES           # RES/plots: PNGs and summary.md
# Fresh machine per step: sft --export DIR (RL start as <=15 MiB parts), rl --import DIR
# --export DIR2 (the run's metrics), plot --import DIR2 (see benchmarks/learn_gpu.py).
# Add --cpu to any step to run it on this machine's CPU with the tiny model (wiring check).
# Sync mode: TANDEM_SYNC_SETTING (trainer) and TANDEM_SYNC_WORKER_SETTING (workers) hold the
# settings, space-separated; default trainer.max_staleness=0. PYTHON: the interpreter (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m benchmarks.learn_gpu "$@"
