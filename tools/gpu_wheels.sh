#!/usr/bin/env bash
# Prepare .gpu/: the wheels tools/gpu_check.sh installs on the GPU image (Python 3.12, torch 2.11,
# Triton 3.6, transformers; no package index there), made here where PyPI is reachable. cp312 wheels
# of what the image lacks, DeepSpeed and megabam built as pure-Python wheels. Then, from this machine:
#
#   bash tools/gpu_wheels.sh
#   then the two device calls in tools/gpu_check.sh's header
#
# .gpu/ is ignored by git; gpu_check.sh installs only the wheels whose module the image lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu && mkdir .gpu
PIP=("$PY" -m pip --disable-pip-version-check -q)
# The needs of DeepSpeed and mosaicml-streaming (their own wheels come after), and the gpu extra.
"${PIP[@]}" download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .gpu \
  hjson py-cpuinfo msgpack einops "pydantic>=2" pydantic-core annotated-types typing-inspection psutil \
  "zstd>=1.5.2.5,<2" zstandard "python-snappy>=0.6.1,<1" cramjam brotli "catalogue>=2,<3" "xxhash>=3,<4" \
  "fla-core>=0.6,<0.7" "mlstm-kernels>=2.0.6,<2.1" "mosaicml-streaming==0.13.0"
# pydantic pins its core exactly: take the core its wheel names.
core=$(unzip -p .gpu/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
rm -f .gpu/pydantic_core-*.whl
"${PIP[@]}" download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d .gpu "pydantic-core==$core"
DS_BUILD_OPS=0 "${PIP[@]}" wheel --no-deps --no-build-isolation -w .gpu "deepspeed>=0.16,<0.20"
"${PIP[@]}" wheel --no-deps --no-build-isolation -w .gpu .
bash tools/gpu_check.sh --source-digest > .gpu/megabam.digest  # gpu_check.sh refuses a wheel older than the tree
ls .gpu
