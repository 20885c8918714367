"""The one logger of megabam: every message goes through Python logging under the `megabam` logger.

`setup_logging(rank)` sends the messages of rank 0 to stdout and drops the other ranks' (they would
repeat rank 0's); each line is written around the progress bar when one is showing (tqdm.write), so
bar and messages never overwrite each other. Module loggers are `logging.getLogger(__name__)`.
"""

import logging
import sys

from tqdm import tqdm

ROOT = "megabam"


class _ProgressAwareHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:  # logging must never take the run down
            self.handleError(record)


def setup_logging(rank: int, level: int = logging.INFO) -> None:
    """Console output of this process: rank 0 at `level`, other ranks only warnings and errors."""
    logger = logging.getLogger(ROOT)
    for handler in [h for h in logger.handlers if isinstance(h, _ProgressAwareHandler)]:
        logger.removeHandler(handler)
    handler = _ProgressAwareHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level if rank == 0 else logging.WARNING)
    logger.propagate = False
