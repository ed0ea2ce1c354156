#!/usr/bin/env bash
# Everything the GPU issues need, in one device call. Usage: bash benchmarks/gpu_all.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
python -c "import vllm, verl.trainer.ppo.core_algos; print('vllm', vllm.__version__)" 2>&1 | tail -2
VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout 400 python -m pytest -m gpu tests/gpu -rA -s -p no:cacheprovider \
    2>&1 | tail -n 40 | tee "$out/gpu_tests.txt"
timeout 500 python benchmarks/rollout_bench.py --out "$out/rollout_bench.json" 2>&1 | tail -n 30 > "$out/rollout_bench.log"
tail -n 25 "$out/rollout_bench.log"
