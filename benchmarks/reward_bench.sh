#!/usr/bin/env bash
# Issue 28 on one H200 (< 8 min): reward-model scoring throughput of a Qwen2.5-0.5B-shaped
# classifier on 512-token rows over micro-batch token budgets, then one vLLM worker batch
# (64 prompts x 8 responses, 256 + 256 tokens) and the share scoring would take of it:
#   bash benchmarks/reward_bench.sh OUT            # writes OUT/reward_bench.json and its log
# Plain torch + transformers (vLLM for the second part; without it that part records the error).
# PYTHON: the interpreter (python3). Wiring check on a CPU: add --cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bash benchmarks/reward_bench.sh OUT [--cpu]}"
shift
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 480 "${PYTHON:-python3}" benchmarks/reward_server_bench.py --out "$OUT/reward_bench.json" "$@" 2>&1 | tee "$OUT/reward_bench.log"
