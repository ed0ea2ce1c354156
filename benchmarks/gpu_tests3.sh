#!/usr/bin/env bash
# Issue 22's GPU test proof on one H200, in one device call: (1) the worker-process test against
# the engine as it was before the fix (rollout/vllm_engine.py from a file given as $1; it must
# fail; '-' skips it), then (2) `pytest -m gpu tests/gpu` whole, three times in a row ($RUNS), in vLLM's default engine
# mode (nothing in the environment changes it). Logs in OUT_DIR ($2).
set -uo pipefail
before=${1:?before-fix copy of rollout/vllm_engine.py}; out=${2:?OUT_DIR}
export PYTHONPATH=$PWD:${PYTHONPATH:-} HF_HUB_OFFLINE=1
unset VLLM_WORKER_MULTIPROC_METHOD VLLM_ENABLE_V1_MULTIPROCESSING
if [ "$before" != - ]; then  # '-': skip this part
  cp rollout/vllm_engine.py /tmp/fixed_vllm_engine.py
  cp "$before" rollout/vllm_engine.py
  timeout 300 python -m pytest -m gpu tests/gpu/test_vllm_worker_process.py -rA -p no:cacheprovider \
    > "$out/before_fix.txt" 2>&1
  echo "before the fix: exit $? (1: the test failed, as it must)"; tail -n 3 "$out/before_fix.txt"
  cp /tmp/fixed_vllm_engine.py rollout/vllm_engine.py
fi
for i in $(seq 1 "${RUNS:-3}"); do
  timeout 570 python -m pytest -m gpu tests/gpu -rA -s -p no:cacheprovider > "$out/gpu_tests_$i.txt" 2>&1
  echo "run $i: exit $?"; tail -n 4 "$out/gpu_tests_$i.txt"
  # the worker process's own log (engine processes included) stays in pytest's tmp folder
  cp "$(ls -td /tmp/pytest-of-*/pytest-*/test_worker_scoring_with_verl*/ | head -1)worker.log" \
    "$out/worker_$i.log" 2>/dev/null
done
