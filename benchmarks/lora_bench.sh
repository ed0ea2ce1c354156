#!/usr/bin/env bash
# Issue 27's LoRA benchmark on one H200 (benchmarks/lora_bench.py): Qwen2.5-0.5B and 1.5B shapes
# (random init, built here from a config, no hub), full fine-tuning against LoRA rank 16 and 64:
# bytes per weight version, publish seconds, trainer tokens/s and peak GPU memory.
#   bash benchmarks/lora_bench.sh OUT            # OUT/lora_bench.json and OUT/lora_bench.log (< 8 min)
#   bash benchmarks/lora_bench.sh OUT --tiny --device cpu   # wiring check on a CPU machine
# PYTHON: the interpreter (python3).
set -euo pipefail
out="${1:?usage: bash benchmarks/lora_bench.sh OUT [extra lora_bench.py arguments]}"
shift
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/lora_bench.py \
    --work "${TMPDIR:-/tmp}/lora_bench" --out "$out/lora_bench.json" "$@" 2>&1 | tee "$out/lora_bench.log"
