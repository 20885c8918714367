"""`megabam launch` and the launch scripts for real on CPU: OpenMPI's mpirun (2 ranks) and the DeepSpeed
launcher with a hostfile (`localhost slots=2`) train the tiny config with the losses of one process at
the same global batch; every launcher's command is an argument list (a config value holding shell
metacharacters reaches the program as one argument); layouts the GPUs cannot hold are refused before
anything starts, and a launched world the config's layout does not describe fails on every rank."""

import shlex
import shutil
import subprocess
import sys

import pytest
from helpers.runs import CONFIG, ENV, REPO, SMALL, losses, megabam_train

from megabam.parallel.ranks import free_port

RUN = ["train.steps=4", "train.eval_every=0"]
LOSS_RTOL = 1e-6  # measured ~1e-8 (float reduction order)
HOSTILE = "run.name=x; touch pwned"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("reference")
    megabam_train(root, data_cache, "run.name=one", *RUN)
    return losses(root / "one")


def launch(tmp_path, data_cache, launcher: str, *args, env=None, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megabam.cli", "launch", launcher, str(CONFIG)]
    cmd += [f"run.output_dir={tmp_path}", f"data.cache_dir={data_cache}", *SMALL, *RUN, *args]
    run_env = dict(ENV, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=600, cwd=tmp_path, **kw)


def _no_mpi() -> str | None:
    if shutil.which("mpirun") is None:
        return "no mpirun"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "no mpi4py"
    return None


@pytest.mark.skipif(_no_mpi() is not None, reason=f"{_no_mpi()}: bash tools/install.sh --with-test-cluster (as root)")
def test_mpirun_launcher_trains_like_one_process(tmp_path, data_cache, reference):
    """No MASTER_ADDR: rank 0's host name and port reach the other rank through mpi4py."""
    env = {k: v for k, v in ENV.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    result = launch(
        tmp_path, data_cache, "mpirun", "run.name=mpi", "train.micro_batch_size=2", "--gpus-per-node", "2", env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "launch/mpirun.sh 2 " in result.stdout
    parallel = losses(tmp_path / "mpi")
    assert sorted(parallel) == sorted(reference)
    for step, loss in reference.items():
        assert parallel[step] == pytest.approx(loss, rel=LOSS_RTOL), step


def test_deepspeed_launcher_with_a_hostfile_trains_tensor_parallel_like_one_process(tmp_path, data_cache, reference):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    result = launch(
        tmp_path,
        data_cache,
        "deepspeed",
        "run.name=ds",
        "parallel.tensor=2",
        "--gpus-per-node",
        "2",
        "--hostfile",
        str(hostfile),
        env=dict(MASTER_PORT=str(free_port())),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parallel = losses(tmp_path / "ds")
    for step, loss in reference.items():
        assert parallel[step] == pytest.approx(loss, rel=LOSS_RTOL), step


def test_a_world_the_configs_layout_does_not_describe_fails_on_every_rank(tmp_path, data_cache):
    """torchrun with 2 ranks for a config fixed at data 1: each rank says so (both numbers) and exits 2."""
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), "2", str(CONFIG), f"run.output_dir={tmp_path}"]
    cmd += [f"data.cache_dir={data_cache}", *SMALL, "run.name=fixed", "parallel.data=1"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    line = "parallel.data: launched world size 2 is not parallel.data · tensor · pipeline = 1·1·1 = 1"
    assert result.stderr.count(line) == 2, result.stderr[-3000:]


@pytest.mark.parametrize("launcher", ["local", "deepspeed", "mpirun", "slurm"])
def test_every_launchers_command_is_an_argument_list(tmp_path, data_cache, launcher):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    extra = {"deepspeed": ["--hostfile", str(hostfile)], "slurm": ["--job-name", "j1", "--cpu"]}.get(launcher, [])
    result = launch(tmp_path, data_cache, launcher, HOSTILE, "--gpus-per-node", "2", *extra, "--dry-run")
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("would run: ")]
    argv = shlex.split(line.removeprefix("would run: "))
    if launcher == "slurm":  # the arguments live in the script, shell-quoted; bash reads them back whole
        script = result.stdout.split("\n", 1)[1].rsplit("would run: ", 1)[0]
        (set_line,) = [x for x in script.splitlines() if x.startswith("set -- ")]
        argv = subprocess.run(
            ["bash", "-c", set_line + '; printf "%s\\n" "$@"'], capture_output=True, text=True, cwd=tmp_path
        ).stdout.splitlines()
        assert argv[0] == str(CONFIG)
    assert HOSTILE in argv
    assert not (tmp_path / "pwned").exists() and not any((tmp_path).glob("x*"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["parallel.tensor=4", "--gpus-per-node", "2"], "parallel.tensor: world size 2 is not a multiple"),
        (
            ["parallel.data=2", "parallel.tensor=2", "--gpus-per-node", "2"],
            "launched world size 2 is not parallel.data",
        ),
        (["parallel.pipeline=3", "--gpus-per-node", "3"], "parallel.pipeline: 3 stages but only model.n_layers=2"),
        (["model.n_heads=4", "parallel.tensor=3", "--gpus-per-node", "3"], "parallel.tensor: 3 does not divide"),
        (["--nodes", "2"], "--nodes: the local launcher runs on this node only"),
        (["--gpus-per-node", "0"], "--gpus-per-node: must be at least 1"),
    ],
)
def test_layouts_the_launch_cannot_hold_are_refused_before_anything_starts(tmp_path, data_cache, args, message):
    result = launch(tmp_path, data_cache, "local", "run.name=r", *args)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "running:" not in result.stdout and not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "launcher, args, message",
    [
        ("deepspeed", [], "--hostfile: the deepspeed launcher needs a hostfile"),
        ("deepspeed", ["--hostfile", "HOSTS"], "is not 'HOST slots=2'"),
        ("mpirun", ["--nodes", "2"], "--hostfile: 2 nodes need a hostfile"),
        ("slurm", ["--job-name", "a;b"], "--job-name: 'a;b' is not a plain job-name"),
        ("slurm", ["--job-name", "j", "--time", "1h"], "--time: '1h' is not a plain time"),
        ("slurm", ["--job-name", "j", "--log-root", "a b"], "--log-root:"),
    ],
)
def test_bad_launcher_options_are_named(tmp_path, data_cache, launcher, args, message):
    (tmp_path / "HOSTS").write_text("localhost slots=4\n")
    result = launch(tmp_path, data_cache, launcher, "run.name=r", "--gpus-per-node", "2", *args)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "logs").exists()


def test_slurm_script_without_scontrol_says_so_instead_of_hanging(tmp_path):
    bash = shutil.which("bash")
    env = dict(ENV, SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(tmp_path), PATH=str(tmp_path))
    result = subprocess.run(
        [bash, str(REPO / "launch" / "slurm.sbatch"), str(CONFIG)], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 2
    assert "scontrol is not on PATH" in result.stderr
