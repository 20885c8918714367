"""`python -m megabam.parallel.torchrun ARGS`: torchrun (torch.distributed.run) as launch/torchrun.sh
runs it, without its report of a failure the ranks already explained.

When a rank exits non-zero, torchrun ends with a ~40-line ChildFailedError traceback — after a rank's
one-line "megabam: error: ..." for a bad config, which it buries. Here, when every failed rank exited
with a code megabam gives with such a line (bad input 2, bad steps 3, preempted 75, interrupted 130:
megabam/exit_codes.py) — or died of the SIGTERM torchrun sends the others then — torchrun exits 1
without the report and launch/torchrun.sh exits with the ranks' code. Any other failure (a crash, a
signal, exit 1 after a traceback) keeps torchrun's report.
"""

import signal
import sys

from megabam import exit_codes

EXPLAINED = {exit_codes.BAD_INPUT, exit_codes.BAD_STEPS, exit_codes.PREEMPTED, exit_codes.INTERRUPTED}


def main() -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun()
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        # A rank torchrun itself stopped with SIGTERM after another's failure, before that rank could
        # install its handler, died of the signal: a consequence, explained by the other's line.
        if any(c in EXPLAINED for c in codes) and all(c in EXPLAINED or c == -signal.SIGTERM for c in codes):
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
