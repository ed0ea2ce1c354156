#!/usr/bin/env bash
# scripts/slurm/stop.sh - stop the daemons started by scripts/slurm/start.sh, by pid file only.
# Cancels remaining jobs first (KEEP_JOBS=1 to skip) so no slurmstepd is left.
set -uo pipefail

. "$(dirname "$0")/common.sh"

stop_one() {  # stop_one PIDFILE COMM
  local f=$1 name=$2 pid
  if ! pid_alive "$f" "$name"; then log "$name: not running (no live pid in $f)"; rm -f "$f"; return 0; fi
  pid=$(<"$f")
  kill -TERM "$pid"
  for _ in $(seq 300); do running_gone "$pid" && break; sleep 0.1; done
  if ! running_gone "$pid"; then log "$name (pid $pid) still alive after 30s, SIGKILL"; kill -KILL "$pid"; fi
  rm -f "$f"
  log "stopped $name (pid $pid)"
}

if [[ ${KEEP_JOBS:-0} != 1 ]] && pid_alive "$RUN/slurmctld.pid" slurmctld && pid_alive "$RUN/slurmd.pid" slurmd; then
  jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
  if [[ -n ${jobs// } ]]; then
    log "cancelling jobs: $jobs"
    scancel $jobs || true
    for _ in $(seq 150); do [[ -z $(squeue -h 2>/dev/null) ]] && break; sleep 0.2; done
  fi
fi

stop_one "$RUN/slurmd.pid" slurmd
stop_one "$RUN/slurmctld.pid" slurmctld
stop_one "$MUNGE_DIR/munged.pid" munged

# remove the /etc/slurm/slurm.conf link only if start-slurm.sh made it point here
[[ -L /etc/slurm/slurm.conf && $(readlink /etc/slurm/slurm.conf) == "$CONF" ]] && rm -f /etc/slurm/slurm.conf
exit 0
