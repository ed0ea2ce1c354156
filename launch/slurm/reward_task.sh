#!/bin/bash
# One task of a tandem reward job (run by srun): name the server, bind its GPU, exec it.
# server.id = <prefix>[-a<array task>][-t<task rank>]; the prefix defaults to r-j<job id>.
set -euo pipefail
id=${TANDEM_SERVER_PREFIX:-}
[ -n "$id" ] || id="r-j${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}"
[ -n "${SLURM_ARRAY_TASK_ID:-}" ] && id="$id-a$SLURM_ARRAY_TASK_ID"
[ "${SLURM_NTASKS:-1}" -gt 1 ] && id="$id-t$SLURM_PROCID"
if [ "${TANDEM_BIND_GPU:-0}" = 1 ]; then
  # one GPU per server: the node's local task rank picks one of the GPUs SLURM gave the job
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
    (( ${#gpus[@]} > SLURM_LOCALID )) && export CUDA_VISIBLE_DEVICES=${gpus[$SLURM_LOCALID]}
  else
    export CUDA_VISIBLE_DEVICES=$SLURM_LOCALID
  fi
fi
exec "$@" --set "server.id=$id"
