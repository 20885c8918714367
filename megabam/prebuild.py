"""`python -m megabam.prebuild`: build now what a first start would build at first use — DeepSpeed's
CPU communication op (megabam/parallel/distributed.py; ~20 s) and the C libraries of the CPU path
(kernels/cpu_build.py) — into megabam's cache. tools/install.sh runs it, so that neither a newcomer's
first run nor the test suite waits for them. Nothing here is needed: without it they are built when
first used, as before. A C library that cannot be built is reported ("unavailable": the PyTorch forms
then run) and the exit code stays 0; a DeepSpeed op that fails to build fails this, as it would fail
the first training start."""

import os


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the trainer does (megabam/cli.py)
    from megabam.kernels import bam_attention_cpu, cpu_fused
    from megabam.parallel.distributed import build_ops

    build_ops()
    for what, library in (("C tiles", bam_attention_cpu.library), ("fused C ops", cpu_fused.library)):
        print(f"megabam.prebuild: {what} {'built' if library() is not None else 'unavailable'}")
    print(f"megabam.prebuild: DeepSpeed's ops in {os.environ['TORCH_EXTENSIONS_DIR']}")


if __name__ == "__main__":
    main()
