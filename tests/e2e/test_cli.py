"""The `megabam` command's help texts and config listing (through the installed console script)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

MEGABAM = str(Path(sys.executable).parent / "megabam")


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"]])
def test_help(args):
    result = subprocess.run([MEGABAM, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "usage: megabam" in result.stdout


def test_help_config_lists_every_section():
    result = subprocess.run(
        [sys.executable, "-m", "megabam.cli", "train", "x.yaml", "--help-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    for key in [
        "model.attention.bam.init",
        "optim.prior_lr_mult",
        "schedule.kind",
        "data.seq_len",
        "eval.passkey_lengths",
    ]:
        assert key in result.stdout


def test_help_config_needs_no_config_file():
    """The README's example: `megabam train --help-config`."""
    result = subprocess.run([MEGABAM, "train", "--help-config"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "optim.prior_lr_mult" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["train"], "CONFIG: train needs a config file"),
        (
            ["train", "yaml_configs/tiny_cpu.yaml", "--fresh", "--resume"],
            "--fresh: starts a new run, --resume continues one",
        ),
    ],
    ids=["no-config", "fresh-and-resume"],
)
def test_contradictory_or_missing_arguments_are_one_line_errors(tmp_path, args, message):
    result = subprocess.run([MEGABAM, *args], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert result.returncode == 2
    assert result.stderr.strip().startswith(f"megabam: error: {message}") and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("user_setting, loaded", [(None, False), ("0", True)])
def test_a_megabam_process_does_not_load_the_compiler_deepspeed_asks_for(user_setting, loaded):
    """DeepSpeed's ZeRO optimizer check imports its Muon module, whose module-level torch.compile
    loads the inductor backend (~0.8 s a process); build_engine imports it first with dynamo disabled
    for that import alone (megabam/train/engine.py), so that torch.compile returns Muon's functions as
    they are, unless the user set TORCHDYNAMO_DISABLE. Neither the entry point nor that import leaves
    the variable set: train.compile, FlexAttention and the user's torch.compile work in this process
    and in those it starts."""
    code = (
        "import os, sys\n"
        "from megabam import process\n"
        "from megabam.train.engine import import_muon_uncompiled\n"
        "process.begin()\n"
        "import_muon_uncompiled()\n"
        "import deepspeed.runtime.zero.muon.muon_optimizer  # as DeepSpeed's check does\n"
        "loaded = 'torch._inductor.compile_fx' in sys.modules\n"
        "print('inductor loaded:', loaded, os.environ.get('TORCHDYNAMO_DISABLE'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    if user_setting is not None:
        env["TORCHDYNAMO_DISABLE"] = user_setting
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"inductor loaded: {loaded} {user_setting}" in result.stdout


def test_a_megabam_process_holds_the_garbage_collector_through_its_start_up(tmp_path):
    """The entry point runs no collection while start-up imports build their long-lived objects, then
    freezes those and collects again (megabam/cli.py: ~0.9 s of a tiny training run). Through train up
    to the point where it refuses a resume with nothing to resume: every import a run needs is done."""
    code = (
        "import gc, sys\n"
        "from megabam import cli, process\n"
        "seen, start = {}, process.start_collecting\n"
        "def spy():\n"
        "    seen.update(held=not gc.isenabled(), full=gc.get_stats()[2]['collections'] - before)\n"
        "    start()\n"
        "    seen.update(collecting=gc.isenabled(), frozen=gc.get_freeze_count())\n"
        "process.start_collecting = spy\n"
        f"sys.argv = ['megabam', 'train', 'yaml_configs/tiny_cpu.yaml', 'run.output_dir={tmp_path}', '--resume']\n"
        "before = gc.get_stats()[2]['collections']  # full collections so far\n"
        "try:\n"
        "    cli.run()\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code, seen, 'megabam.train.trainer' in sys.modules)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=repo)
    assert "no checkpoint to resume from" in result.stderr, result.stderr[-2000:]
    out = result.stdout.strip()
    assert out.startswith("exit 2 {'held': True, 'full': 0, 'collecting': True, 'frozen': ") and out.endswith("True")
    assert int(out.split("'frozen': ")[1].split("}")[0]) > 100_000  # torch, DeepSpeed, the trainer


def test_prebuild_builds_or_finds_what_a_first_start_needs():
    """`python -m megabam.prebuild` (tools/install.sh runs it) leaves DeepSpeed's CPU communication op
    and the C libraries in megabam's cache, where the trainer's first start finds them: the same
    folders the trainer reads (megabam/parallel/distributed.py, kernels/cpu_build.py). Run on this
    environment's cache, which install.sh has filled (else this builds it, as a first run would)."""
    from megabam.kernels.cpu_build import cache_folder

    result = subprocess.run([sys.executable, "-m", "megabam.prebuild"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "C tiles built" in result.stdout and "fused C ops built" in result.stdout, result.stdout
    folder = Path(result.stdout.split("DeepSpeed's ops in ")[1].split()[0])
    assert list(folder.glob("deepspeed_shm_comm/*.so")), folder
    assert {p.name.split("-")[0] for p in cache_folder().glob("*.so")} >= {"bam_attention_cpu", "cpu_fused"}


def test_prebuild_without_a_working_compiler_says_so_in_one_line(tmp_path):
    """No working compiler (CC and CXX fail): the C libraries are reported unavailable (the PyTorch
    forms run; exit code unaffected), and DeepSpeed's op, which CPU training cannot do without, fails
    the command with one line naming it and its folder rather than a traceback."""
    env = dict(os.environ, MEGABAM_CACHE=str(tmp_path), CC="/bin/false", CXX="/bin/false")
    env.pop("TORCH_EXTENSIONS_DIR", None)
    result = subprocess.run(
        [sys.executable, "-m", "megabam.prebuild"], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert "C tiles unavailable" in result.stdout and "fused C ops unavailable" in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("megabam.prebuild: DeepSpeed's CPU communication op did not build in " + str(tmp_path))
    assert "Traceback" not in result.stderr
