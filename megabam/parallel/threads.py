"""How each process sets up torch on the CPU: its intra-op threads (the cores it may run on ÷ the
ranks sharing them), with denormals flushed.

torch's default is one thread per core of the machine in every process, so two ranks on a 2-core box
run four spinning OpenMP threads on two cores; measured: a run fell from ~7,000 to 200–400 tokens/s.
`OMP_NUM_THREADS`, when set, wins. torchrun sets it to 1 for several ranks when it is unset, so
launch/torchrun.sh asks this module first (`python -m megabam.parallel.threads --local-ranks N` prints
the count) and exports the answer.

The same threads flush denormal floats to zero (x86's FTZ/DAZ). A softmax over a prior's far keys
(ALiBi's slopes, a GGD prior) is full of probabilities below float32's 1.2e-38, and a CPU computes
with those ~100× slower: measured, torch's fused attention with ALiBi's bias at 2,048 tokens ran 3.2×
faster flushed (docs/benchmarks.md). The flag is per thread and OpenMP's workers copy it from the
main thread only when they start, so it is set before the first parallel op and then checked on
every thread.
"""

import argparse
import logging
import math
import os
import sys
import warnings
from pathlib import Path

from megabam.errors import LaunchError

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
            raise LaunchError("environment", "OMP_NUM_THREADS", f"must be a positive integer, got {value!r}")
        return int(value), "OMP_NUM_THREADS"
    local = environ.get("LOCAL_WORLD_SIZE", "1")
    if not local.isdigit() or int(local) < 1:
        raise LaunchError("environment", "LOCAL_WORLD_SIZE", f"must be a positive integer, got {local!r}")
    cores = available_cores() if cores is None else cores
    return max(1, cores // int(local)), f"{cores} cores ÷ {local} local ranks"


def configure_cpu() -> int:
    """Set torch's intra-op threads for this process (see thread_count), flush denormals on all of
    them, and return the number."""
    import torch  # here, so the launcher's question does not import torch

    threads, why = thread_count()
    # Attention probabilities under a sharp prior underflow into denormals, which x86 CPUs multiply ~100x
    # slower than normal floats; flushed to zero, no result that matters changes. Before set_num_threads
    # and any parallel op: the pool's workers copy the flag when they start.
    torch.set_flush_denormal(True)
    # numpy then finds float64's smallest subnormal to be 0 when it first describes the type, and says
    # so in a warning per process: the flag is chosen, not a fault.
    warnings.filterwarnings("ignore", "The value of the smallest subnormal", UserWarning, r"numpy\.")
    torch.set_num_threads(threads)
    log.info("torch threads per process: %d (%s)", threads, why)
    if not denormals_flushed(threads):
        log.warning(
            "denormal floats are not flushed on every torch thread (its thread pool started before "
            "configure_cpu): CPU attention with a prior may run up to 3x slower"
        )
    return threads


def denormals_flushed(threads: int) -> bool:
    """Whether every one of torch's intra-op threads flushes denormals: an elementwise op long enough
    to be split across all of them (torch splits it in 32,768-element grains) on a denormal input.
    The input is written as bits: converting 6e-39 to float32 on a flushing thread gives 0."""
    import torch

    tiny = torch.full((threads * 65536,), 1 << 22, dtype=torch.int32).view(torch.float32)  # 5.9e-39
    return not bool((tiny * 1.0).count_nonzero())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="torch threads for each of N local ranks on this machine")
    parser.add_argument("--local-ranks", type=int, required=True)
    local = parser.parse_args().local_ranks
    try:
        print(thread_count({**os.environ, "LOCAL_WORLD_SIZE": str(local)})[0])
    except LaunchError as e:
        print(f"megabam: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
