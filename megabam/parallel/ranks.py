"""Who this process is in the job, read in one place from whichever launcher started it.

torchrun and the deepspeed launcher set torch.distributed's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). OpenMPI's mpirun sets OMPI_COMM_WORLD_*, MPICH's and
Intel MPI's hydra PMI_RANK / PMI_SIZE, PMIx launchers PMIX_RANK, and srun (one task per GPU) SLURM_PROCID
and friends. `launch_environment` maps whichever is present onto torch's names, so that DeepSpeed never
runs its own MPI discovery (which replaces MASTER_ADDR with the host's first interface address).

The rendezvous address: MASTER_ADDR when set (kept as given, never replaced); else, under MPI, rank 0's
host name shared through mpi4py; under srun, the step's first node from `scontrol show hostnames`. The
port: MASTER_PORT when set; else under srun derived from the job id (two jobs on one node must not
collide), under MPI a free port of rank 0's, shared. A job spanning nodes whose rendezvous address
resolves to loopback (Debian maps the host name to 127.0.1.1) is refused: the other nodes would wait
for ever on their own loopback.

`python -m megabam.parallel.ranks slurm-rendezvous` prints "ADDR PORT" for launch/slurm.sbatch.
"""

import argparse
import ipaddress
import os
import random
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping

from megabam.errors import LaunchError

TORCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PORT_BASE, PORT_SPAN = 20000, 10000  # below Linux's ephemeral range (32768-60999), where clients bind
FREE_PORTS = range(10000, PORT_BASE)  # free_port's: below the job ports, also out of the ephemeral range


def job_port(job_id: str) -> int:
    """The rendezvous port of scheduler job `job_id`: distinct for jobs sharing a node (unless their
    ids are PORT_SPAN apart), the same on every node of one job and across its requeues."""
    if not job_id.isdigit():
        raise LaunchError("environment", "SLURM_JOB_ID", f"must be a number, got {job_id!r}")
    return PORT_BASE + int(job_id) % PORT_SPAN


def _int(environ: Mapping[str, str], key: str) -> int:
    value = environ.get(key, "")
    if not value.isdigit():
        raise LaunchError("environment", key, f"must be a non-negative integer, got {value!r}")
    return int(value)


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Slurm's compressed tasks-per-node list ("2(x3),1") read at node index `node`."""
    counts = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise LaunchError("environment", "SLURM_STEP_TASKS_PER_NODE", f"cannot read {tasks_per_node!r}")
        counts += [int(m[1])] * int(m[2] or 1)
    if node >= len(counts):
        raise LaunchError(
            "environment", "SLURM_STEP_TASKS_PER_NODE", f"{tasks_per_node!r} lists no node {node} (SLURM_NODEID)"
        )
    return counts[node]


def launcher_of(environ: Mapping[str, str]) -> str:
    """Which launcher's variables describe this process: torch, openmpi, pmi, pmix, slurm or none.

    torch's win (torchrun under srun or mpirun sets them per rank); srun's count only inside a job step
    (SLURM_STEP_ID): a batch script's own shell has SLURM_PROCID 0 and the job's SLURM_NTASKS, and a
    `megabam train` typed there is one process, not rank 0 of a world that never comes.
    """
    if "RANK" in environ:
        return "torch"
    if "OMPI_COMM_WORLD_RANK" in environ:
        return "openmpi"
    if "PMI_RANK" in environ:
        return "pmi"
    if "PMIX_RANK" in environ:
        return "pmix"
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:
        return "slurm"
    return "none"


def _mpi_world():
    try:
        from mpi4py import MPI  # only under an MPI launcher: importing it initialises MPI
    except ImportError:
        raise LaunchError(
            "environment",
            "mpi4py",
            "not installed, and an MPI launcher started this rank: install OpenMPI, then rerun tools/install.sh "
            "(or pass it --with-test-cluster, as root)",
        ) from None

    world = MPI.COMM_WORLD
    return world, world.Split_type(MPI.COMM_TYPE_SHARED)


def _ranks(launcher: str, environ: Mapping[str, str]) -> dict[str, int]:
    if launcher == "torch":
        ranks = {k: _int(environ, k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        # LOCAL_SIZE: the deepspeed launcher's name for it; neither: a one-node launcher (set below)
        local = next((k for k in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE") if k in environ), None)
        ranks["LOCAL_WORLD_SIZE"] = _int(environ, local) if local else None
        return ranks
    if launcher == "openmpi":
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
        values = [_int(environ, k) for k in names] + [_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")]
    elif launcher == "pmi" and "MPI_LOCALRANKID" in environ:  # hydra (MPICH, Intel MPI)
        values = [_int(environ, k) for k in ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")]
    elif launcher in ("pmi", "pmix"):  # the sizes are not in the environment: ask MPI
        world, node = _mpi_world()
        values = [world.Get_rank(), world.Get_size(), node.Get_rank(), node.Get_size()]
    else:  # slurm: a task of an srun step
        node_id = _int(environ, "SLURM_NODEID")
        values = [
            _int(environ, "SLURM_PROCID"),
            _int(environ, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"),
            _int(environ, "SLURM_LOCALID"),
            tasks_on_node(environ.get("SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE", "")), node_id),
        ]
    return dict(zip(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), values, strict=True))


def first_slurm_node(nodelist: str) -> str:
    """The first host of a Slurm node list ("gpu[03-05,09]"), expanded by scontrol as Slurm does."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise LaunchError(
            "environment",
            "SLURM_JOB_NODELIST",
            f"scontrol is not on PATH, so the first node of {nodelist!r} (the rendezvous host) cannot be named; "
            "put Slurm's client commands on PATH or set MASTER_ADDR",
        )
    out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        raise LaunchError(
            "environment", "SLURM_JOB_NODELIST", f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}"
        )
    return hosts[0]


def _resolves_to_loopback(host: str) -> bool:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise LaunchError("environment", "MASTER_ADDR", f"{host!r} does not resolve: {e}") from None
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _literal_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_reachable(addr: str, rank: int, world: int, local_world: int) -> None:
    """Refuse a rendezvous address the job's other nodes cannot reach: a loopback address (given as
    such, or a name this node resolves to loopback, where this node is not rank 0's) in a job that
    spans nodes. Rank 0's own node may resolve its name to 127.0.1.1 (Debian) and still be reached."""
    if world == local_world:
        return
    remote = rank >= local_world  # ranks are numbered node by node: rank 0's node holds 0..local-1
    if _literal_loopback(addr) or (remote and _resolves_to_loopback(addr)):
        raise LaunchError(
            "environment",
            "MASTER_ADDR",
            f"{addr!r} is loopback on this node (rank {rank}) but the job's {world} ranks span nodes "
            f"({local_world} per node): set MASTER_ADDR to an address every node reaches (the first node's "
            "IP on the cluster network), or fix the host's name resolution",
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that no process is listening on (at the time of asking), drawn at random
    from FREE_PORTS. Not the kernel's pick (bind to port 0): that comes from the ephemeral range, where
    every outgoing connection on the machine takes its local port, so between this call releasing the
    port and the rendezvous binding it a connection of another job could take it (two copies of the
    test suite on one machine make hundreds of connections a minute)."""
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(FREE_PORTS.start, FREE_PORTS.stop)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # in use
                continue
            return port
    raise OSError(f"no free TCP port on {host or 'any address'} in {FREE_PORTS.start}-{FREE_PORTS.stop - 1}")


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables a launcher (torchrun, the deepspeed launcher) gives rank `rank` of a one-node
    world of `world` processes rendezvousing on 127.0.0.1:`port`."""
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _rendezvous(launcher: str, environ: Mapping[str, str], ranks: dict[str, int]) -> tuple[str, int]:
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if launcher == "slurm":
        if addr is None:
            nodes = environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", ""))
            one_node = ranks["WORLD_SIZE"] == ranks["LOCAL_WORLD_SIZE"]
            addr = "127.0.0.1" if one_node else first_slurm_node(nodes)
        port = port or str(job_port(environ.get("SLURM_JOB_ID", "")))
    elif launcher in ("openmpi", "pmi", "pmix") and (addr is None or port is None):
        world, _ = _mpi_world()  # rank 0 names its host and a free port; everyone takes them
        mine = (addr or socket.gethostname(), port or str(free_port(""))) if ranks["RANK"] == 0 else None
        addr, port = world.bcast(mine, root=0)
    if addr is None or port is None:
        missing = "MASTER_ADDR" if addr is None else "MASTER_PORT"
        raise LaunchError("environment", missing, f"not set, and the {launcher} launcher's variables do not give it")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError("environment", "MASTER_PORT", f"must be a TCP port, got {port!r}")
    return addr, int(port)


def launch_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """torch.distributed's six variables for this process, from whichever launcher started it; a
    process no launcher started is the one rank of a world on loopback."""
    launcher = launcher_of(environ)
    if launcher == "none":
        return rank_environment(0, 1, free_port())
    ranks = _ranks(launcher, environ)
    if ranks["LOCAL_WORLD_SIZE"] is None:
        ranks["LOCAL_WORLD_SIZE"] = ranks["WORLD_SIZE"]
    if not ranks["RANK"] < ranks["WORLD_SIZE"] or not ranks["LOCAL_RANK"] < ranks["LOCAL_WORLD_SIZE"]:
        raise LaunchError(
            "environment", "RANK", f"rank {ranks['RANK']} (local {ranks['LOCAL_RANK']}) lies outside its world {ranks}"
        )
    addr, port = _rendezvous(launcher, environ, ranks)
    check_reachable(addr, ranks["RANK"], ranks["WORLD_SIZE"], ranks["LOCAL_WORLD_SIZE"])
    return {**{k: str(v) for k, v in ranks.items()}, "MASTER_ADDR": addr, "MASTER_PORT": str(port)}


def _slurm_rendezvous() -> str:
    """ "ADDR PORT" of the current Slurm job's rendezvous: its first node and the job id's port."""
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        raise LaunchError("environment", "SLURM_JOB_ID", "not set: not inside a Slurm job")
    nodes = _int(env, "SLURM_JOB_NUM_NODES") if "SLURM_JOB_NUM_NODES" in env else _int(env, "SLURM_NNODES")
    head = env.get("MASTER_ADDR") or first_slurm_node(env.get("SLURM_JOB_NODELIST", ""))
    check_reachable(head, rank=0, world=nodes, local_world=1)  # the batch shell runs on the first node
    return f"{head} {env.get('MASTER_PORT') or job_port(env['SLURM_JOB_ID'])}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="rank discovery for the launch scripts")
    parser.add_argument("question", choices=["slurm-rendezvous"])
    parser.parse_args()
    try:
        print(_slurm_rendezvous())
    except LaunchError as e:
        print(f"megabam: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
