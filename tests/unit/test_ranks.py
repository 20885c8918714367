"""Rank discovery (megabam/parallel/ranks.py): every launcher's variables mapped onto torch's, and the
rendezvous addresses that would hang a job refused with the reason."""

import socket

import pytest

from megabam.errors import LaunchError
from megabam.parallel.ranks import free_port, job_port, launch_environment, launcher_of, tasks_on_node

TORCH = dict(
    RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.0.0.7", MASTER_PORT="29400"
)


def test_torch_variables_are_kept_as_given():
    assert launch_environment(TORCH) == TORCH


def test_deepspeed_launchers_local_size_counts_the_ranks_on_this_node():
    env = {k: v for k, v in TORCH.items() if k != "LOCAL_WORLD_SIZE"} | {"LOCAL_SIZE": "2"}
    assert launch_environment(env)["LOCAL_WORLD_SIZE"] == "2"


def test_openmpi_ranks_map_to_torch_names_and_keep_a_given_master_address():
    env = dict(
        OMPI_COMM_WORLD_RANK="5",
        OMPI_COMM_WORLD_SIZE="8",
        OMPI_COMM_WORLD_LOCAL_RANK="1",
        OMPI_COMM_WORLD_LOCAL_SIZE="4",
        MASTER_ADDR="10.1.2.3",
        MASTER_PORT="29500",
        SLURM_PROCID="0",  # mpirun inside an allocation: OpenMPI's ranks win over the batch shell's
    )
    assert launch_environment(env) == dict(
        RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", MASTER_ADDR="10.1.2.3", MASTER_PORT="29500"
    )


def test_hydra_pmi_ranks_map_to_torch_names():
    env = dict(
        PMI_RANK="2", PMI_SIZE="4", MPI_LOCALRANKID="0", MPI_LOCALNRANKS="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="1"
    )
    got = launch_environment(env)
    assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_RANK"], got["LOCAL_WORLD_SIZE"]) == ("2", "4", "0", "2")


def slurm_task(procid: int, localid: int, node: int, **extra) -> dict:
    return dict(
        SLURM_PROCID=str(procid),
        SLURM_LOCALID=str(localid),
        SLURM_NODEID=str(node),
        SLURM_STEP_ID="0",
        SLURM_STEP_NUM_TASKS="6",
        SLURM_STEP_TASKS_PER_NODE="4,2",
        SLURM_STEP_NODELIST="gpu[01-02]",
        SLURM_JOB_ID="12345",
        **extra,
    )


def test_srun_tasks_map_to_torch_names_with_the_job_ids_port():
    got = launch_environment(slurm_task(5, 1, 1, MASTER_ADDR="10.0.0.1"))
    assert got == dict(
        RANK="5", WORLD_SIZE="6", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.0.0.1",
        MASTER_PORT=str(job_port("12345")),
    )  # fmt: skip


def test_srun_without_scontrol_is_an_error_not_a_one_node_world(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    with pytest.raises(LaunchError, match="scontrol is not on PATH.*gpu\\[01-02\\]"):
        launch_environment(slurm_task(0, 0, 0))


def test_a_batch_scripts_own_shell_is_one_process_not_rank_zero_of_the_job():
    batch = {k: v for k, v in slurm_task(0, 0, 0).items() if k != "SLURM_STEP_ID"} | {"SLURM_NTASKS": "6"}
    assert launcher_of(batch) == "none"
    assert launch_environment(batch)["WORLD_SIZE"] == "1"


def test_slurm_tasks_per_node_lists_are_read_per_node():
    assert [tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    with pytest.raises(LaunchError, match="SLURM_STEP_TASKS_PER_NODE"):
        tasks_on_node("2(x3)", 3)


def test_job_ports_differ_between_jobs_and_stay_out_of_the_ephemeral_range():
    ports = {job_port(str(i)) for i in range(1000, 1100)}
    assert len(ports) == 100 and max(ports) < 32768 and min(ports) >= 1024


def test_free_ports_come_from_outside_the_ephemeral_range_and_skip_ports_in_use(monkeypatch):
    """A port from the ephemeral range, released and bound again later by the rendezvous, can meanwhile
    become the local port of another job's outgoing connection; free_port draws below that range,
    away from the job ports, and skips a port something listens on."""
    from megabam.parallel import ranks

    ports = [free_port() for _ in range(50)]
    assert all(
        ranks.FREE_PORTS.start <= p < ranks.PORT_BASE < ranks.PORT_BASE + ranks.PORT_SPAN <= 32768 for p in ports
    )
    assert len(set(ports)) > 40
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports[0]))
        held.listen()
        draws = iter([ports[0], ports[1]])
        monkeypatch.setattr(ranks.random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        assert free_port() == ports[1]


@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost", "::1"])
def test_a_loopback_address_for_a_job_spanning_nodes_is_refused_on_every_rank(addr):
    for rank, local in [(0, 0), (3, 1)]:
        env = TORCH | dict(RANK=str(rank), LOCAL_RANK=str(local), MASTER_ADDR=addr)
        with pytest.raises(LaunchError, match=f"MASTER_ADDR: '{addr}' is loopback on this node .* span nodes"):
            launch_environment(env)


def test_a_name_resolving_to_loopback_is_refused_off_the_first_node_only(monkeypatch):
    """Debian maps a host's own name to 127.0.1.1: harmless on that host, a hang everywhere else."""
    real = socket.getaddrinfo
    fake = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: fake if host == "head" else real(host, *a, **k))
    first_node = TORCH | dict(RANK="1", LOCAL_RANK="1", MASTER_ADDR="head")
    assert launch_environment(first_node)["MASTER_ADDR"] == "head"
    with pytest.raises(LaunchError, match="'head' is loopback on this node \\(rank 3\\)"):
        launch_environment(TORCH | dict(MASTER_ADDR="head"))


def test_one_node_jobs_may_rendezvous_on_loopback():
    env = TORCH | dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1")
    assert launch_environment(env)["MASTER_ADDR"] == "127.0.0.1"


@pytest.mark.parametrize(
    "change, key",
    [(dict(RANK="x"), "RANK"), (dict(RANK="4"), "RANK"), (dict(MASTER_PORT="70000"), "MASTER_PORT")],
)
def test_bad_launcher_variables_are_named(change, key):
    with pytest.raises(LaunchError, match=f"environment: {key}"):
        launch_environment(TORCH | change)


def test_no_launcher_is_a_one_rank_world_on_loopback():
    got = launch_environment({})
    assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_WORLD_SIZE"], got["MASTER_ADDR"]) == ("0", "1", "1", "127.0.0.1")


def test_each_rank_takes_the_gpu_of_its_local_rank_and_the_cpu_without_cuda(monkeypatch):
    """megabam/parallel/distributed.py: the engine's device, and the one the dataset's prefix is
    all-gathered on under NCCL (before DeepSpeed sets a current GPU, every rank's is GPU 0)."""
    import torch

    from megabam.parallel.distributed import rank_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert rank_device() == torch.device("cuda", 3)
