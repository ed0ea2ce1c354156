# scripts/slurm/common.sh - paths and pid helpers shared by start.sh and stop.sh (sourced).
BASE=${SLURM_BASE:-/tmp/tandem-slurm}
CONF=$BASE/etc/slurm.conf
RUN=$BASE/run                 # slurmctld.pid / slurmd.pid (written by the daemons)
MUNGE_DIR=$BASE/munge         # munged.pid / munged.log (owned by user munge)
export SLURM_CONF=$CONF

log() { echo "[slurm/$(basename "$0") $(date +%T)] $*"; }

# running_gone PID: true if PID has exited (zombies count as exited: without a
# real init, PID 1 may reap them only every second or two)
running_gone() { local st; st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 0; [[ -z $st || $st == Z ]]; }

# pid_alive PIDFILE COMM: true if PIDFILE names a live (non-zombie) process called COMM
pid_alive() {
  local pid
  [[ -s $1 ]] || return 1
  pid=$(<"$1")
  [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm && $(</proc/$pid/comm) == "$2" ]] && ! running_gone "$pid"
}
