#!/usr/bin/env bash
# Everything the GPU issues need, in one device call. Usage: bash benchmarks/gpu_all.sh OUT_DIR [tests|bench|e2e|e2e-remote]...
set -uo pipefail
out=${1:?OUT_DIR}; shift
export PYTHONPATH=$PWD:${PYTHONPATH:-}
for what in "$@"; do
  case $what in
    tests) timeout 300 python -m pytest -m gpu tests/gpu -rA -s -p no:cacheprovider > "$out/gpu_tests.txt" 2>&1 ;;
    bench) timeout 420 python benchmarks/rollout_bench.py --out "$out/rollout_bench.json" > "$out/rollout_bench.log" 2>&1 ;;
    e2e) timeout 400 bash benchmarks/gpu_e2e.sh "$out" > "$out/e2e.log" 2>&1 ;;
    e2e-remote) mkdir -p "$out/remote" && timeout 400 bash benchmarks/gpu_e2e.sh "$out/remote" \
                --remote-workers > "$out/remote/e2e.log" 2>&1 ;;
    trainer1) timeout 250 torchrun --standalone --nproc_per_node 1 benchmarks/trainer_bench.py \
                --out "$out/trainer_bench_1gpu.json" > "$out/trainer_bench_1gpu.log" 2>&1 ;;
    trainer1m16) timeout 250 torchrun --standalone --nproc_per_node 1 benchmarks/trainer_bench.py \
                --micro 16 --out "$out/trainer_bench_1gpu_m16.json" > "$out/trainer_bench_1gpu_m16.log" 2>&1 ;;
    trainer2) timeout 250 torchrun --standalone --nproc_per_node 2 benchmarks/trainer_bench.py \
                --out "$out/trainer_bench_2gpu.json" > "$out/trainer_bench_2gpu.log" 2>&1 ;;
  esac
  echo "$what: exit $?"
done
