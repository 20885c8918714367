"""`python -m megabam.prebuild`: build now what a first start would build at first use — the C
libraries of the CPU path (kernels/cpu_build.py) and DeepSpeed's CPU communication op
(megabam/parallel/distributed.py; ~20 s) — into megabam's cache. tools/install.sh runs it, so that
neither a newcomer's first run nor the test suite waits for them. Nothing here is needed: without it
they are built when first used, as before. A C library that cannot be built is reported
("unavailable": the PyTorch forms then run) and the exit code stays 0; a DeepSpeed op that fails to
build is one line on stderr and exit code 1, since the first training start would fail on it too."""

import os
import sys

from megabam import process


def main() -> int:
    process.cpu_accelerator_without_cuda()  # as the trainer does
    from megabam.kernels import bam_attention_cpu, cpu_fused
    from megabam.parallel.distributed import build_ops

    for what, library in (("C tiles", bam_attention_cpu.library), ("fused C ops", cpu_fused.library)):
        print(f"megabam.prebuild: {what} {'built' if library() is not None else 'unavailable'}")
    try:
        build_ops()
    except Exception as e:  # DeepSpeed's builder raises what its compiler run gave; its output is above
        print(
            f"megabam.prebuild: DeepSpeed's CPU communication op did not build in "
            f"{os.environ['TORCH_EXTENSIONS_DIR']} ({type(e).__name__}: {e}); training on the CPU needs it",
            file=sys.stderr,
        )
        return 1
    print(f"megabam.prebuild: DeepSpeed's ops in {os.environ['TORCH_EXTENSIONS_DIR']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
