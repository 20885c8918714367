#!/usr/bin/env bash
# NP ranks of `megabam train` under OpenMPI's mpirun (on this host, or the hosts of MEGABAM_HOSTFILE).
# Usage: launch/mpirun.sh NP CONFIG [key.sub=value ...] [--resume]
#
# Each rank reads OMPI_COMM_WORLD_* (megabam/parallel/ranks.py, the one place that maps launchers'
# variables to torch's); MASTER_ADDR / MASTER_PORT, when unset, are rank 0's host and a free port,
# shared through mpi4py; when set they are used as given. MEGABAM_HOSTFILE: an OpenMPI hostfile
# ("host slots=N"). MEGABAM_MPIRUN_ARGS: more mpirun options, split on spaces (e.g. "--mca btl_tcp_if_include eth0").
# SIGUSR1 / SIGTERM to mpirun reach every rank (OpenMPI forwards them), which checkpoint and exit 75.
#
# Exit code: mpirun's (the first failing rank's: 2 bad input, 75 preempted, ...).
set -uo pipefail
np=${1:?usage: launch/mpirun.sh NP CONFIG [key.sub=value ...] [--resume]}
shift
here=$(cd "$(dirname "$0")" && pwd)
python=${MEGABAM_PYTHON:-$here/../.venv/bin/python}
args=(-np "$np" --bind-to none)
[[ $(id -u) == 0 ]] && args+=(--allow-run-as-root)  # containers and CI run as root
[[ -n ${MEGABAM_HOSTFILE:-} ]] && args+=(--hostfile "$MEGABAM_HOSTFILE")
read -r -a extra <<<"${MEGABAM_MPIRUN_ARGS:-}"
# The variables the ranks need on other hosts too (mpirun passes its environment only to local ranks).
for var in MASTER_ADDR MASTER_PORT OMP_NUM_THREADS DS_ACCELERATOR MEGABAM_CACHE PYTHONPATH; do
  [[ -n ${!var:-} ]] && args+=(-x "$var")
done
exec mpirun "${args[@]}" "${extra[@]}" "$python" -m megabam.cli train "$@"
