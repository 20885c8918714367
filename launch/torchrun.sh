#!/usr/bin/env bash
# One node, NPROC processes of `megabam train` under torchrun (gloo on CPU, nccl on GPU).
# Usage: launch/torchrun.sh NPROC CONFIG [key.sub=value ...] [--resume]
# The SLURM, deepspeed-hostfile and mpirun launchers will sit beside this one.
set -euo pipefail
nproc=${1:?usage: launch/torchrun.sh NPROC CONFIG [key.sub=value ...] [--resume]}
shift
here=$(cd "$(dirname "$0")" && pwd)
python=${MEGABAM_PYTHON:-$here/../.venv/bin/python}
# --standalone: a private rendezvous on a free local port, so several jobs can share the node.
exec "$python" -m torch.distributed.run --standalone --nproc-per-node="$nproc" -m megabam.cli train "$@"
