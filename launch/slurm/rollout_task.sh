#!/bin/bash
# One rollout task of a tandem rollout job (run by srun): name the worker, bind its GPU, exec it.
# worker.id = <prefix>[-a<array task>][-t<task rank>]; the prefix defaults to w-j<job id>.
set -euo pipefail
id=${TANDEM_WORKER_PREFIX:-}
[ -n "$id" ] || id="w-j${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}"
[ -n "${SLURM_ARRAY_TASK_ID:-}" ] && id="$id-a$SLURM_ARRAY_TASK_ID"
[ "${SLURM_NTASKS:-1}" -gt 1 ] && id="$id-t$SLURM_PROCID"
if [ "${TANDEM_BIND_GPU:-0}" = 1 ]; then
  # one GPU per worker: the node's local task rank picks one of the GPUs SLURM gave the job
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
    # already one GPU per task (--gpus-per-task=1): keep it
    (( ${#gpus[@]} > SLURM_LOCALID )) && export CUDA_VISIBLE_DEVICES=${gpus[$SLURM_LOCALID]}
  else
    export CUDA_VISIBLE_DEVICES=$SLURM_LOCALID
  fi
fi
exec "$@" "worker.id=$id"
