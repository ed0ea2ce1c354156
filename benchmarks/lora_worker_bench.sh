#!/usr/bin/env bash
# Issue 27's worker-side figures on one H200 in one device call (<= 6 minutes):
#   bash benchmarks/lora_worker_bench.sh OUT          # OUT/table.md, OUT/lora_worker.json, OUT/stage-*.{json,log}
#   bash benchmarks/lora_worker_bench.sh OUT --cpu    # wiring check on a CPU, tiny model, hf engine
# A CPU step builds the Qwen2.5-0.5B-shaped base and rank-16/64 adapters; then three stages, one
# process each (vLLM's default engine, one at a time on the GPU), each under its own time limit
# so a slow or failing one leaves the others' rows: full weights, rank 16, rank 64
# (benchmarks/lora_worker_bench.py). PYTHON: the interpreter (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
OUT=${1:?usage: lora_worker_bench.sh OUT [--cpu]}
CPU=${2:-}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
WORK=${TANDEM_BENCH_WORK:-/tmp/lora_worker_bench}
echo "== prep (limit 80 s) $(date -u +%T)"
timeout -k 5 80 "$PY" -m benchmarks.lora_worker_bench --work "$WORK" --prep $CPU >"$OUT/prep.log" 2>&1
echo "   exit $?"; tail -n 1 "$OUT/prep.log"
for s in full r16 r64; do
  echo "== $s (limit 90 s) $(date -u +%T)"
  timeout -k 10 90 "$PY" -m benchmarks.lora_worker_bench --work "$WORK" --stage "$s" --out "$OUT/stage-$s.json" $CPU \
    >"$OUT/stage-$s.log" 2>&1
  echo "   exit $? $(date -u +%T); last lines:"
  grep -v -i warn "$OUT/stage-$s.log" | tail -n 3 | cut -c1-300
done
"$PY" -m benchmarks.lora_worker_bench --table "$OUT"
