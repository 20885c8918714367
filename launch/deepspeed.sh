#!/usr/bin/env bash
# `megabam train` under the DeepSpeed launcher, one rank per slot of a hostfile ("host slots=N" lines).
# Usage: launch/deepspeed.sh HOSTFILE CONFIG [key.sub=value ...] [--resume]
#
# MEGABAM_DS_LAUNCHER: how the launcher reaches the other hosts (its --launcher: pdsh, the default;
# openmpi, mvapich, slurm, ...). MASTER_ADDR / MASTER_PORT: the rendezvous, passed on when set (the
# launcher's default: the hostfile's first host, port 29500). --no_local_rank: megabam reads LOCAL_RANK
# from the environment, not from an argument. Ranks size their threads from the launcher's LOCAL_SIZE
# (megabam/parallel/threads.py).
#
# On several hosts `megabam train`'s arguments cross each host's shell as one base64 word
# (megabam/remote_args.py): pdsh would otherwise run `$(...)` in an override there.
#
# Exit code: the launcher's (on one host, the first failing rank's: 2 bad input, 75 preempted, ...).
set -uo pipefail
hostfile=${1:?usage: launch/deepspeed.sh HOSTFILE CONFIG [key.sub=value ...] [--resume]}
shift
here=$(cd "$(dirname "$0")" && pwd)
python=${MEGABAM_PYTHON:-$here/../.venv/bin/python}
if [[ ! -r $hostfile ]]; then
  echo "launch/deepspeed.sh: error: cannot read the hostfile $hostfile" >&2
  exit 2
fi
args=(--hostfile="$hostfile" --no_local_rank)
[[ -n ${MEGABAM_DS_LAUNCHER:-} ]] && args+=(--launcher="$MEGABAM_DS_LAUNCHER")
hosts=$(grep -cv '^[[:space:]]*\(#\|$\)' "$hostfile")
if [[ $hosts == 1 ]]; then
  # One host runs locally (the launcher's own one-node path), where it would still ssh to the host
  # to check it and to ask its address.
  args+=(--no_ssh_check --master_addr="${MASTER_ADDR:-127.0.0.1}")
elif [[ -n ${MASTER_ADDR:-} ]]; then
  args+=(--master_addr="$MASTER_ADDR")
fi
[[ -n ${MASTER_PORT:-} ]] && args+=(--master_port="$MASTER_PORT")
train_args=("$@")
if [[ $hosts != 1 ]]; then
  # The launcher reaches the other hosts through a remote shell (pdsh's ssh by default), which parses
  # the command line again: the arguments travel as one word of base64 (megabam/remote_args.py).
  train_args=("$("$python" -m megabam.remote_args "$@")") || exit 2
fi
exec "$python" -m deepspeed.launcher.runner "${args[@]}" --module megabam.cli train "${train_args[@]}"
