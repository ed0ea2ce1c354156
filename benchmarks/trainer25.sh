#!/usr/bin/env bash
# Issue 25's acceptance table on one H200 in one device call (<= 9 minutes):
#   bash benchmarks/trainer25.sh OUT          # OUT/table.md, OUT/trainer25.json, OUT/stage-*.json
#   bash benchmarks/trainer25.sh OUT --cpu    # wiring check on this machine's CPU, tiny shape
#   bash benchmarks/trainer25.sh OUT compile  # a second call: trainer.compile_layers (fused element-
#                                             # wise work) against eager, 1.5B and 4B, side by side
#                                             # (the 4B also without checkpointing, and every other layer)
#   bash benchmarks/trainer25.sh OUT reduce   # one rank reducing gradients once per optimizer step
#                                             # against after every pass (25c), same process, 1.5B
#                                             # and 4B at settings that fit 80 GB as well
#   bash benchmarks/trainer25.sh OUT h100     # what fits one 80 GB H100 (not the acceptance set, which
#                                             # is an H200's: its 1.5B and 4B rows peak at 94.5 and 127 GiB)
# The acceptance set: each row at the settings that measured best on H200 (2026-12-04), side by
# side in one call, each stage in its own process under its own time limit (a slow or failing one
# leaves the others' rows; benchmarks/trainer_mix.py): 0.5B packed vs today's padded path (same
# process, same samples), 1.5B packed with compiled layers (and torch.profiler over one more
# step: OUT/profile-1.5b-compile.txt), 4B packed with compiled layers, no checkpointing, 16k tokens
# per micro-batch; 8 timed steps each after a warm-up step (4 steps of the mix spread 3.5 % run
# to run at 4B); the 1.5B and 4B each first with the logprob blocks eager (their compile's A/B,
# same process). Stage limits 130 + 170 + 300 s (seen on H200 without the A/B: 96, ~90, 101 s;
# the 4B's first compile did not end within 100 s once). PYTHON: the interpreter (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${1:?usage: trainer25.sh OUT [--cpu] [compile|h100|reduce]}
CPU="" SET=acceptance
for a in "${@:2}"; do case $a in --cpu) CPU=--cpu ;; compile | h100 | reduce) SET=$a ;; *) echo "unknown: $a" >&2; exit 2 ;; esac; done
PY=${PYTHON:-python3}
mkdir -p "$OUT"
WORK=${TANDEM_BENCH_WORK:-/tmp/trainer25}
stage() {  # name, seconds, arguments...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s) $(date -u +%T)"
  timeout -k 10 "$limit" "$PY" -m benchmarks.trainer_mix --work "$WORK" --out "$OUT/stage-$name.json" $CPU "$@" \
    >"$OUT/stage-$name.log" 2>&1
  echo "   exit $? $(date -u +%T); last lines:"
  grep -v -i warn "$OUT/stage-$name.log" | tail -n 3
}
if [ "$SET" = compile ]; then  # seen on H200 (2026-12-04): 36, 97, 149 s (c2, c3 before 25a's fix)
  stage c1-1.5b 60 --shape 1.5b --paths packed
  # with the profile of one more step: where the compiled step's time goes (OUT/profile-1.5b-compile.txt)
  stage c2-1.5b-compile 150 --shape 1.5b --paths packed --compile --profile "$OUT/profile-1.5b-compile.txt"
  # compiled layers keep fewer activations for backward (the partitioner recomputes cheap
  # element-wise work), so the 4B may train without checkpointing's extra forward, or with
  # every other layer checkpointed (trainer.checkpoint_every=2: half the recompute)
  stage c4-4b-compile-nockpt 100 --shape 4b --paths packed --token-budget 16384 --compile
  stage c5-4b-compile-ckpt2 110 --shape 4b --paths packed --grad-ckpt --ckpt-every 2 --token-budget 16384 --compile
  # last: a call cut at its limit loses this row only (the table is rebuilt from the stage JSONs)
  stage c3-4b-compile 160 --shape 4b --paths packed --grad-ckpt --token-budget 32768 --compile
  "$PY" -m benchmarks.trainer_mix --table "$OUT"
  exit 0
fi
if [ "$SET" = reduce ]; then  # each shape: the old way first, then once per step, 8 timed steps each
  stage r1-1.5b-compile-16k 150 --shape 1.5b --paths packed-every-pass,packed --compile --steps 8 --token-budget 16384
  stage r2-4b-compile-ckpt-16k 300 --shape 4b --paths packed-every-pass,packed --grad-ckpt --token-budget 16384 \
    --compile --steps 8
  "$PY" -m benchmarks.trainer_mix --table "$OUT"
  exit 0
fi
if [ "$SET" = h100 ]; then  # 80 GB: half the 1.5B's tokens per micro-batch; the 4B (60 GiB of
  # weights, gradients and Adam state alone) only with every layer checkpointed, at 16k tokens;
  # the padded path at 2 rows per micro-batch (8 and 4 ran out of memory on 80 GB, 2026-12-06)
  stage 1-0.5b 130 --shape 0.5b --paths packed,padded --padded-micro 2
  stage 2-1.5b-compile-16k 150 --shape 1.5b --paths packed --compile --steps 8 --token-budget 16384
  stage 3-4b-compile-ckpt-16k 260 --shape 4b --paths packed --grad-ckpt --token-budget 16384 --compile --steps 8
  "$PY" -m benchmarks.trainer_mix --table "$OUT"
  exit 0
fi
stage 1-0.5b 130 --shape 0.5b --paths packed,padded
stage 2-1.5b-compile 170 --shape 1.5b --paths packed-eager-logprob,packed --compile --steps 8 \
  --profile "$OUT/profile-1.5b-compile.txt"
stage 3-4b-compile-nockpt 300 --shape 4b --paths packed-eager-logprob,packed --token-budget 16384 --compile --steps 8
"$PY" -m benchmarks.trainer_mix --table "$OUT"
