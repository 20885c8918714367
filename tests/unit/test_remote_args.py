"""Multi-host DeepSpeed launches through pdsh: the command DeepSpeed's own runner builds, parsed by a
remote shell, gives `megabam train` its arguments unchanged and runs nothing of them."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

from megabam import remote_args
from megabam.cli import main

REPO = Path(__file__).resolve().parents[2]
HOSTILE = [
    "cfg.yaml",
    "run.output_dir=/x/$(touch${IFS}pwned1)",
    "run.name=a b;touch pwned2",
    "data.tokenizer=`touch pwned3`",
    'logging.wandb_project="q" $HOME',
    "--resume",
]


def remote_words(user_args: list[str], cwd: Path) -> list[str]:
    """The words each host's shell gives `megabam.cli` from DeepSpeed's PDSH command: the runner's own
    get_cmd, joined as pdsh joins its arguments, run by bash with the program replaced by printf."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    args = argparse.Namespace(
        user_args=user_args,
        user_script="megabam.cli",
        launcher_args="",
        ssh_port=None,
        master_addr="h1",
        master_port=29500,
        venv_script=None,
        no_python=False,
        module=True,
        no_local_rank=True,
        save_pid=False,
        enable_each_rank_log=None,
    )
    here = os.getcwd()
    os.chdir(cwd)  # the command begins with `cd` to the launcher's directory
    try:
        cmd, _, _ = PDSHRunner(args, "e30=").get_cmd({}, {"h1": [0], "h2": [0]})
    finally:
        os.chdir(here)
    remote = " ".join(cmd[cmd.index("h1,h2") + 1 :])  # pdsh -S -f N -w HOSTS <the remote command>
    launch = f"{sys.executable} -u -m deepspeed.launcher.launch"
    assert launch in remote
    out = subprocess.run(
        ["bash", "-c", remote.replace(launch, "printf '%s\\n'")], capture_output=True, text=True, cwd=cwd, check=True
    )
    words = out.stdout.splitlines()
    return words[words.index("megabam.cli") + 1 :]


def test_pdsh_would_run_an_override_on_every_host_without_the_encoding(tmp_path):
    """The control: the fault the encoding prevents is real with DeepSpeed's runner as installed."""
    words = remote_words(HOSTILE, tmp_path)
    assert words != HOSTILE and (tmp_path / "pwned1").exists()


def test_encoded_arguments_cross_the_remote_shell_unchanged(tmp_path):
    word = remote_args.encode(HOSTILE)
    assert remote_words([word], tmp_path) == [word]
    assert not list(tmp_path.glob("pwned*"))
    assert remote_args.decode(["train", word]) == ["train", *HOSTILE]
    assert remote_args.decode(["train", "cfg.yaml"]) == ["train", "cfg.yaml"]  # plain arguments as they are
    module = subprocess.run([sys.executable, "-m", "megabam.remote_args", *HOSTILE], capture_output=True, text=True)
    assert module.stdout == word + "\n"


def test_launch_deepspeed_sh_encodes_the_arguments_for_several_hosts_only(tmp_path):
    """The script with a stand-in python that records what the DeepSpeed runner would get."""
    fake = tmp_path / "python"
    fake.write_text(
        f'#!/bin/bash\nif [[ $2 == megabam.remote_args ]]; then exec {sys.executable} "$@"; fi\n'
        f'printf "%s\\n" "$@" > {tmp_path}/runner-args\n'
    )
    fake.chmod(0o755)
    for hosts, expected in [(["h1 slots=2"], HOSTILE), (["h1 slots=2", "h2 slots=2"], [remote_args.encode(HOSTILE)])]:
        (tmp_path / "hostfile").write_text("\n".join(hosts) + "\n")
        cmd = ["bash", str(REPO / "launch" / "deepspeed.sh"), str(tmp_path / "hostfile"), *HOSTILE]
        subprocess.run(cmd, env=dict(os.environ, MEGABAM_PYTHON=str(fake)), check=True, cwd=tmp_path)
        words = (tmp_path / "runner-args").read_text().splitlines()
        assert words[words.index("train") + 1 :] == expected
    assert not list(tmp_path.glob("pwned*"))


def test_an_encoded_word_that_does_not_decode_is_one_line(capsys):
    for word in ["--args-b64=!!!", remote_args.PREFIX + "eyJhIjogMX0=", remote_args.encode([1, 2])]:  # {"a": 1}
        assert main(["train", word]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("megabam: error: --args-b64: not the base64 of a JSON list of strings: ")
