#!/usr/bin/env bash
# Issue 27's worker-side figures on one H200 (two device calls of <= 8 minutes, see STAGES below):
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
# A stage's engine start took 85 s (full) and 130 s (LoRA) on a fresh H200 (2026-12-03), so the
# three stages do not fit one 10-minute call: run them in two (STAGES="full r16", then
# STAGES=r64 SKIP_PREP=1 on the same warm machine; the table reads every stage-*.json in OUT).
STAGES=${STAGES:-full r16 r64}
LIMIT=${LIMIT:-200}
SHAPE=${SHAPE:-0.5b}  # or 1.5b (its own OUT: the table reads OUT/stage-*.json)
if [ -z "${SKIP_PREP:-}" ]; then
  echo "== prep (limit 80 s) $(date -u +%T)"
  timeout -k 5 80 "$PY" -m benchmarks.lora_worker_bench --work "$WORK" --prep --shape "$SHAPE" $CPU >"$OUT/prep.log" 2>&1
  echo "   exit $?"; tail -n 1 "$OUT/prep.log"
fi
for s in $STAGES; do
  echo "== $s (limit $LIMIT s) $(date -u +%T)"
  timeout -k 10 "$LIMIT" "$PY" -m benchmarks.lora_worker_bench --work "$WORK" --stage "$s" --out "$OUT/stage-$s.json" $CPU \
    >"$OUT/stage-$s.log" 2>&1
  echo "   exit $? $(date -u +%T); last lines:"
  grep -v -i warn "$OUT/stage-$s.log" | tail -n 3 | cut -c1-300
done
"$PY" -m benchmarks.lora_worker_bench --table "$OUT"
