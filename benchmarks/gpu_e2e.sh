#!/usr/bin/env bash
# End-to-end on a 2-GPU machine: trainer on GPU 0, one vLLM rollout worker on GPU 1,
# Qwen2.5-0.5B-shaped model built locally, 20 trainer steps with in-place reloads.
# Usage: bash benchmarks/gpu_e2e.sh OUT_DIR [launch.local flags, e.g. --remote-workers]
set -uo pipefail
out=${1:?OUT_DIR}; shift
work=/tmp/gpu_e2e
rm -rf "$work" && mkdir -p "$work"
python - "$work" <<'PY'
import sys
sys.path.insert(0, ".")
from benchmarks.rollout_bench import build_model
from rollout import builtin_task
build_model(sys.argv[1] + "/model")
builtin_task.write_parquet(sys.argv[1] + "/train.parquet", builtin_task.make_rows(512, 3))
PY
python -m launch.local --root "$work/run" --steps 20 --workers 1 --nproc 1 \
    --model "$work/model" --data "$work/train.parquet" --timeout 540 \
    --trainer-gpus 0 --worker-gpus 1 \
    --trainer actor_rollout_ref.actor.optim.lr=1e-6 --trainer actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 \
    --worker actor_rollout_ref.rollout.name=vllm --worker actor_rollout_ref.rollout.dtype=bfloat16 \
    --worker data.max_response_length=64 "$@" \
    2>&1 | tail -n 20 | tee "$out/e2e_console.txt"
cp "$work/run/metrics.jsonl" "$out/e2e_metrics.jsonl"
cp "$work/run/logs/trainer.log" "$out/e2e_trainer.log"
# the worker's log: in the run folder, or (--remote-workers) in the worker's own folder
cp "$(find "$work/run" -name 'worker-w0.log' | head -n 1)" "$out/e2e_worker.log"
cat "$work"/run/workers/*.json > "$out/e2e_heartbeats.json"
