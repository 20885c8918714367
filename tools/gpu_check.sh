#!/usr/bin/env bash
# The standing GPU check: first the recurrent cells' library kernels (fla's Gated DeltaNet, TFLA's
# mLSTM) against megabam's references and beside their direct calls, then the Triton kernels'
# instruction budget as the image's Triton compiles them, their benchmark (correctness first, then
# its tables), then short bf16 trainings of the tiny configs on
# CUDA through the ops model.kernels=auto picks on CUDA tensors (the dispatch logs each choice and why):
# BAM's learnable prior on the Triton kernel, SWAX's windowed RoPE layers on compiled FlexAttention, and
# the BAM config with RoPE instead of its prior (SSMax kept) on torch's SDPA; last, the end-to-end
# benchmark of realistic widths at the configs' lengths (tools/bench_gpu_train.py: BAM 1.1B with its prior
# and with RoPE, SWAX 1.4B at 16k with mLSTM and with Gated DeltaNet; ~3 minutes), which leaves its table in
# $OUT/bench_gpu_train.json and the per-op efficiencies it measured in $OUT/calibration.json (merge that
# entry into megabam/plan/calibration.json to ship it). Its steps' time limits add up to more than
# one 10-minute device call (measured so far: attention tables 46 s, trainings 106 s), so run it as
# two calls, correctness and kernels first:
#
#   run(command="GPU_CHECK_TRAIN=0 GPU_CHECK_E2E=0 bash tools/gpu_check.sh", carry=[".gpu"], timeout_s=540)
#   run(command="GPU_CHECK_RECURRENT=0 GPU_CHECK_BUDGET=0 GPU_CHECK_BENCH=0 bash tools/gpu_check.sh",
#       carry=[".gpu"], timeout_s=540)
#
# The GPU image has torch, triton and transformers but not DeepSpeed, streaming or their needs, and
# no package index: prepare .gpu/ here first with `bash tools/gpu_wheels.sh` (cp312 wheels, DeepSpeed
# and megabam built here; rerun it after changing megabam). Only the wheels whose module the image lacks are
# installed. Everything printed also goes to $OUT/gpu_check.log.
#
# GPU_CHECK_RECURRENT=0 skips the recurrent cells' check and timing (tools/bench_recurrent_kernels.py),
# GPU_CHECK_BENCH=0 the attention and mLSTM benchmark, GPU_CHECK_BUDGET=0 the instruction budget
# (tools/kernel_budget.py), GPU_CHECK_E2E=0 the end-to-end benchmark; GPU_CHECK_TRAIN names the
# trainings (bam, swax, rope; 0: none). GPU_CHECK_DRY=1 runs the same steps on CPU at tiny sizes (the
# benchmark under the Triton interpreter, 3 training steps, the benchmarks' --dry-run): it proves the
# script, not the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
source_digest() {  # of the sources the megabam wheel is built from (tools/gpu_wheels.sh records it)
  find megabam kernels -name __pycache__ -prune -o -type f \( -name '*.py' -o -name '*.c' -o -name '*.h' -o -name '*.json' \) -print |
    LC_ALL=C sort | xargs sha1sum | sha1sum | cut -d' ' -f1
}
if [[ ${1:-} == --source-digest ]]; then source_digest; exit 0; fi
if [[ "$(cat .gpu/megabam.digest 2>/dev/null)" != "$(source_digest)" ]]; then
  echo "gpu_check: .gpu/'s megabam wheel was not built from this tree: run bash tools/gpu_wheels.sh first" >&2
  exit 2
fi
OUT=${OUT:-runs/gpu_check}
PY=${PY:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/megabam-site}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 MEGABAM_CACHE=${MEGABAM_CACHE:-/tmp/megabam-cache}

wheels=()
need() {  # need MODULE-CHECK WHEEL...: the wheels, unless the check imports
  "$PY" -c "import $1" 2>/dev/null || for w in "${@:2}"; do wheels+=(.gpu/"$w"-*.whl); done
}
need deepspeed deepspeed
need hjson hjson
need cpuinfo py_cpuinfo
need msgpack msgpack
need einops einops
need "pydantic; assert int(pydantic.VERSION[0]) >= 2" pydantic pydantic_core annotated_types typing_inspection
need psutil psutil
need "importlib.util; assert importlib.util.find_spec('streaming')" mosaicml_streaming
need zstd zstd
need zstandard zstandard
need snappy python_snappy cramjam
need brotli brotli
need catalogue catalogue
need xxhash xxhash
need "fla.ops" fla_core                  # the gpu extra: flash-linear-attention's kernels
need mlstm_kernels mlstm_kernels          # and TFLA's
wheels+=(.gpu/megabam-*.whl)
echo "gpu_check: installing ${wheels[*]}"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" || exit 1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
"$PY" -c "import torch, triton, deepspeed, sys, megabam.kernels.dispatch
from megabam.data.streaming_import import import_streaming
streaming = import_streaming()
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton',
      triton.__version__, 'deepspeed', deepspeed.__version__, 'streaming', streaming.__version__)" || exit 1

# First: the recurrent cells' CUDA ops (fla's Gated DeltaNet, TFLA's mLSTM, through the dispatch)
# against megabam's references, then their speed beside the libraries' direct calls (about a minute).
if [[ ${GPU_CHECK_RECURRENT:-1} == 1 ]]; then
  echo "== gpu_check: tools/bench_recurrent_kernels.py"
  SECONDS=0
  timeout 150 "$PY" tools/bench_recurrent_kernels.py ${GPU_CHECK_DRY:+--dry-run}
  echo "gpu_check: bench_recurrent_kernels exit $? after $SECONDS s"
fi

if [[ -n ${GPU_CHECK_DRY:-} ]]; then
  bench=(--dry-run) steps=3 warmup=1 bench_limit=300 budget=(--kernels bam_fwd --variants prior) e2e=(--dry-run)
else
  bench=(--variants bam sdpa flex --reps 5 ${GPU_CHECK_BENCH_ARGS:-}) steps=100 warmup=20 bench_limit=260
  budget=() e2e=()
fi
# The kernels' instruction budget as the image's own Triton compiles them (sm_90, bf16; no GPU used,
# 38 compiles, well under a minute on its cores): MUFU per score and spills per autotune config.
if [[ ${GPU_CHECK_BUDGET:-1} == 1 ]]; then
  echo "== gpu_check: tools/kernel_budget.py --arch 90 ${budget[*]}"
  SECONDS=0
  env -u TRITON_INTERPRET timeout 90 "$PY" tools/kernel_budget.py --arch 90 "${budget[@]}"
  echo "gpu_check: kernel_budget exit $? after $SECONDS s"
fi
if [[ ${GPU_CHECK_BENCH:-1} == 1 ]]; then  # GPU_CHECK_BENCH=0: the trainings alone
  echo "== gpu_check: tools/bench_kernels.py ${bench[*]}"
  SECONDS=0
  timeout "$bench_limit" "$PY" tools/bench_kernels.py "${bench[@]}"
  echo "gpu_check: bench_kernels exit $? after $SECONDS s"
fi

train() {  # train NAME CONFIG LIMIT OVERRIDES...
  echo "== gpu_check: train $1 (${*:4})"
  SECONDS=0
  timeout "$3" "$PY" -c 'import sys; from megabam.cli import run; sys.exit(run())' train --fresh "yaml_configs/$2.yaml" \
    run.name="$1" run.output_dir=/tmp/megabam-runs train.precision=bf16 train.steps=$steps schedule.warmup_steps=$warmup \
    train.eval_every=$steps train.eval_batches=4 checkpoint.every=$steps logging.wandb_mode=disabled \
    logging.log_every=10 "${@:4}"
  echo "gpu_check: train $1 exit $? after $SECONDS s"
}
runs=${GPU_CHECK_TRAIN:-bam swax rope}  # which trainings; GPU_CHECK_TRAIN=0: the benchmark alone
[[ " $runs " == *" bam "* ]] && train bam tiny_cpu 100 logging.peak_tflops=989
# SWAX compiles FlexAttention on its first step (forward and backward) and again for evaluation.
[[ " $runs " == *" swax "* ]] && train swax swax_tiny_cpu 120 logging.peak_tflops=989
[[ " $runs " == *" rope "* ]] && train rope tiny_cpu 80 logging.peak_tflops=989 model.attention.positional=rope
# Each model in a process of its own, within 170 s in all (the script's --budget-s; a model past its own
# 75 s, or out of memory, is a row saying so and the others still run).
if [[ ${GPU_CHECK_E2E:-1} == 1 ]]; then
  echo "== gpu_check: tools/bench_gpu_train.py ${e2e[*]}"
  SECONDS=0
  timeout 200 "$PY" tools/bench_gpu_train.py "${e2e[@]}" --out "$OUT/bench_gpu_train.json" \
    --write-calibration "$OUT/calibration.json"
  echo "gpu_check: bench_gpu_train exit $? after $SECONDS s"
fi
exit 0
