#!/usr/bin/env bash
# NPROC processes of `megabam train` on this node under torchrun (gloo on CPU, nccl on GPU).
# Usage: launch/torchrun.sh NPROC CONFIG [key.sub=value ...] [--resume]
#
# One node: a private rendezvous on a free local port (--standalone), so several jobs share a node.
# Several nodes (launch/slurm.sbatch runs this once per node): MEGABAM_NNODES, MEGABAM_RDZV_ENDPOINT
# (host:port, the same on every node) and MEGABAM_RDZV_ID give torchrun a c10d rendezvous; the node's
# rank comes from the rendezvous, never from a variable expanded on another host. MEGABAM_LOG_DIR: one
# log file per rank there (console lines prefixed by the local rank).
#
# Exit code: the ranks' common one — 0 done, 2 bad input, 3 bad steps, 75 preempted (requeue), 130
# interrupted — where torchrun itself would say 1 for any failure. SIGTERM / SIGUSR1 / SIGINT to this
# script go to every rank (which checkpoint and exit 75, or 130 for SIGINT; a second SIGINT stops them
# at once), not to torchrun (which would kill them 30 s later, or die). torchrun dies with this script
# (setpriv's parent-death signal, where util-linux has it: kill -9 of the script leaves nothing
# running), and the ranks with torchrun: they ask the kernel for SIGKILL when their parent dies
# (megabam/cli.py).
set -uo pipefail
nproc=${1:?usage: launch/torchrun.sh NPROC CONFIG [key.sub=value ...] [--resume]}
shift
here=$(cd "$(dirname "$0")" && pwd)
python=${MEGABAM_PYTHON:-$here/../.venv/bin/python}
codes=$(mktemp -d "${TMPDIR:-/tmp}/megabam-exit.XXXXXX") || exit 1
trap 'rm -rf "$codes"' EXIT
export MEGABAM_EXIT_CODE_DIR=$codes  # each rank writes its exit code here
# torchrun would set 1 thread per rank when unset; megabam's rule gives each rank its share of the cores.
if [[ -z ${OMP_NUM_THREADS:-} ]]; then
  OMP_NUM_THREADS=$("$python" -m megabam.parallel.threads --local-ranks "$nproc") || exit 2
  export OMP_NUM_THREADS
fi

if [[ -n ${MEGABAM_RDZV_ENDPOINT:-} ]]; then
  rdzv=(--nnodes="${MEGABAM_NNODES:?MEGABAM_NNODES must be set with MEGABAM_RDZV_ENDPOINT}" --rdzv-backend=c10d
    --rdzv-endpoint="$MEGABAM_RDZV_ENDPOINT" --rdzv-id="${MEGABAM_RDZV_ID:-megabam}")
else
  rdzv=(--standalone)
fi
logs=()
[[ -n ${MEGABAM_LOG_DIR:-} ]] && logs=(--log-dir="$MEGABAM_LOG_DIR" --tee=3)
# torchrun starts with SIGTERM, SIGUSR1 and SIGINT ignored: Slurm signals every process of a step, and
# torchrun would die of SIGUSR1 or stop the ranks 30 s after SIGTERM; Ctrl-C reaches the terminal's
# whole process group, and torchrun would turn it into a SIGTERM for the ranks (not told from a
# preemption). It takes back SIGTERM for itself (its safety net), not SIGINT. The ranks install their
# own handlers.
trap '' TERM USR1 INT
export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGHUP,SIGQUIT
dies_with_me=()
command -v setpriv >/dev/null && dies_with_me=(setpriv --pdeathsig KILL --)
# torchrun through megabam/parallel/torchrun.py: without its 40-line report when the ranks said why.
"${dies_with_me[@]}" "$python" -m megabam.parallel.torchrun "${rdzv[@]}" "${logs[@]}" --nproc-per-node="$nproc" \
  -m megabam.cli train "$@" &
launcher=$!
forward() { pkill -"$1" -P "$launcher" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap 'forward INT' INT

while true; do
  wait "$launcher"
  rc=$?
  kill -0 "$launcher" 2>/dev/null || break  # else `wait` returned for a trapped signal: keep waiting
done
if [[ $rc != 0 ]]; then
  # The ranks' codes other than 0; torchrun's own when they disagree or none was written.
  common=$(cat "$codes"/rank* 2>/dev/null | grep -vx 0 | sort -u)
  # A rank torchrun stopped after another's failure (its SIGTERM, during start-up) says 75: the other's
  # code is the job's.
  [[ $(wc -l <<<"$common") -gt 1 ]] && common=$(grep -vx 75 <<<"$common")
  [[ -n $common && $(wc -l <<<"$common") == 1 ]] && rc=$common
fi
exit "$rc"
