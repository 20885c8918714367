"""Exit codes of the megabam commands; launch scripts and requeue logic act on them."""

import contextlib
import os
from pathlib import Path

OK = 0
BAD_INPUT = 2  # a config, run directory, data or checkpoint that cannot be used; nothing was lost
BAD_STEPS = 3  # train.max_bad_steps consecutive non-finite steps; the last good checkpoint is named
PREEMPTED = 75  # EX_TEMPFAIL: SIGTERM/SIGUSR1 after a checkpoint was saved; requeue the job
INTERRUPTED = 130  # 128 + SIGINT, the shell's code for Ctrl-C: stopped by the user after a checkpoint was saved


def record(code: int) -> None:
    """Leave this rank's exit code where the launch script reads it (launch/torchrun.sh), which
    exits with the ranks' common code instead of the launcher's."""
    folder = os.environ.get("MEGABAM_EXIT_CODE_DIR")
    if folder:
        with contextlib.suppress(OSError):
            Path(folder, f"rank{os.environ.get('RANK', '0')}").write_text(f"{code}\n")
