#!/usr/bin/env bash
# One node, NPROC processes of `megabam train` under torchrun (gloo on CPU, nccl on GPU).
# Usage: launch/torchrun.sh NPROC CONFIG [key.sub=value ...] [--resume]
#
# Exit code: the ranks' common one — 0 done, 2 bad input, 3 bad steps, 75 preempted (requeue) —
# where torchrun itself would say 1 for any failure. SIGTERM / SIGUSR1 to this script go to every
# rank (which checkpoint and exit 75), not to torchrun (which would kill them 30 s later). Ranks die
# with torchrun: they ask the kernel for SIGKILL when their parent dies (megabam/cli.py).
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

# --standalone: a private rendezvous on a free local port, so several jobs can share the node.
"$python" -m torch.distributed.run --standalone --nproc-per-node="$nproc" -m megabam.cli train "$@" &
launcher=$!
forward() { pkill -"$1" -P "$launcher" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1

while true; do
  wait "$launcher"
  rc=$?
  kill -0 "$launcher" 2>/dev/null || break  # else `wait` returned for a trapped signal: keep waiting
done
if [[ $rc != 0 ]]; then
  # The ranks' codes other than 0; torchrun's own when they disagree or none was written.
  common=$(cat "$codes"/rank* 2>/dev/null | grep -vx 0 | sort -u)
  [[ -n $common && $(wc -l <<<"$common") == 1 ]] && rc=$common
fi
exit "$rc"
