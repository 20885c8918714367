"""How many intra-op threads each process gives torch: the cores it may run on ÷ the ranks sharing them.

torch's default is one thread per core of the machine in every process, so two ranks on a 2-core box
run four spinning OpenMP threads on two cores; measured: a run fell from ~7,000 to 200–400 tokens/s.
`OMP_NUM_THREADS`, when set, wins. torchrun sets it to 1 for several ranks when it is unset, so
launch/torchrun.sh asks this module first (`python -m megabam.parallel.threads --local-ranks N` prints
the count) and exports the answer.
"""

import argparse
import logging
import math
import os
import sys
from pathlib import Path

from megabam.config import ConfigError

log = logging.getLogger(__name__)
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may use: its CPU affinity (taskset, Slurm's cpuset), capped by a cgroup v2
    CPU quota (containers: "200000 100000" is 2 cores' worth of time)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota readable: the affinity alone
    return max(1, cores)


def thread_count(environ=os.environ, cores: int | None = None) -> tuple[int, str]:
    """(threads, why) for one process: OMP_NUM_THREADS if set, else available cores ÷ LOCAL_WORLD_SIZE."""
    if environ.get("OMP_NUM_THREADS"):
        value = environ["OMP_NUM_THREADS"]
        if not value.isdigit() or int(value) < 1:
            raise ConfigError("environment", "OMP_NUM_THREADS", f"must be a positive integer, got {value!r}")
        return int(value), "OMP_NUM_THREADS"
    local = environ.get("LOCAL_WORLD_SIZE", "1")
    if not local.isdigit() or int(local) < 1:
        raise ConfigError("environment", "LOCAL_WORLD_SIZE", f"must be a positive integer, got {local!r}")
    cores = available_cores() if cores is None else cores
    return max(1, cores // int(local)), f"{cores} cores ÷ {local} local ranks"


def size_threads() -> int:
    """Set torch's intra-op threads for this process (see thread_count) and return the number."""
    import torch  # here, so the launcher's question does not import torch

    threads, why = thread_count()
    torch.set_num_threads(threads)
    log.info("torch threads per process: %d (%s)", threads, why)
    return threads


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="torch threads for each of N local ranks on this machine")
    parser.add_argument("--local-ranks", type=int, required=True)
    local = parser.parse_args().local_ranks
    try:
        print(thread_count({**os.environ, "LOCAL_WORLD_SIZE": str(local)})[0])
    except ConfigError as e:
        print(f"megabam: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
