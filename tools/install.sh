#!/usr/bin/env bash
# Install megabam and everything it needs into ./.venv (or into $MEGABAM_PYTHON's environment).
#
# Why not a plain `pip install -e .`:
#  * an unpinned torch resolves to a multi-GB CUDA build; on a CPU box we pin the local CPU wheel,
#    and where torch is already installed (a GPU cluster) we keep that torch and pin it instead;
#  * mosaicml-streaming requires torchvision, which pulls its own torch build and cannot load beside
#    the CPU wheel; megabam never uses streaming's vision part, so streaming goes in with --no-deps
#    (megabam/data/streaming_import.py explains the matching import shim);
#  * DeepSpeed builds from an sdist that imports torch, so it must see the environment's torch.
#
# Usage: bash tools/install.sh [--with-test-cluster] [--with-transformers-5]
#   --with-test-cluster   OpenMPI, Slurm and munge for the launcher tests (tools/system_packages.sh)
#   --with-transformers-5 the export tests' side environment (tests/helpers/transformers_5.py), built
#                         now instead of inside the suite's time
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
system_args=()
with_transformers_5=0
for arg in "$@"; do
  case $arg in
    --with-test-cluster) system_args+=("$arg") ;;
    --with-transformers-5) with_transformers_5=1 ;;
    *) echo "install.sh: unknown option $arg (known: --with-test-cluster, --with-transformers-5)" >&2; exit 2 ;;
  esac
done

if [[ -n "${MEGABAM_PYTHON:-}" ]]; then
  PY=$MEGABAM_PYTHON
else
  [[ -x .venv/bin/python ]] || python3 -m venv .venv
  PY=$ROOT/.venv/bin/python
fi
PIP=("$PY" -m pip install --disable-pip-version-check -q)

if "$PY" -c "import torch" 2>/dev/null; then
  TORCH_PIN="torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
else
  TORCH_PIN="torch==2.13.0"
  "${PIP[@]}" "$TORCH_PIN"
fi
mkdir -p .cache
CONSTRAINTS=$ROOT/.cache/constraints.txt
echo "$TORCH_PIN" > "$CONSTRAINTS"
export PIP_CONSTRAINT=$CONSTRAINTS

bash tools/system_packages.sh "${system_args[@]}"

"${PIP[@]}" -r tools/requirements-cpu.txt
if command -v mpicc >/dev/null; then "${PIP[@]}" "mpi4py>=4"; fi
"${PIP[@]}" --no-deps "mosaicml-streaming==0.13.0"
"$PY" -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation "deepspeed>=0.16,<0.20"
"${PIP[@]}" --no-deps --no-build-isolation -e .
# DeepSpeed's CPU communication op (~20 s) and the C libraries of the CPU path, built now rather than
# by the first run (or the first test) that needs them; where one cannot be built, the run says so.
"$PY" -m megabam.prebuild
if ((with_transformers_5)); then
  echo "install.sh: the export tests' transformers 5 environment: $("$PY" tests/helpers/transformers_5.py)"
fi
echo "install.sh: megabam installed for $PY"
