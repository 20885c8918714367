"""`megabam launch {local,deepspeed,mpirun,slurm} CONFIG [key.sub=value ...] --nodes N --gpus-per-node G`.

The launch is checked against the config's layout before anything starts: the world (nodes × GPUs per
node) must be divisible by tensor · pipeline, and equal data · tensor · pipeline when parallel.data is
set; the config's own rules (heads divisible by tensor, layers ≥ pipeline, ...) apply as in training.
Then the repo's script for that launcher (launch/) runs, built as an argument list, so that no value
from a config or the command line passes through a shell; for slurm a filled copy of
launch/slurm.sbatch (the #SBATCH lines, and the arguments shell-quoted) is written and submitted with
sbatch. --dry-run prints the command (and for slurm the script) instead.

The script runs in a process group of its own, with this process as its only way in: SIGTERM,
SIGUSR1 and SIGINT (Ctrl-C reaches this process alone) are passed on to it once, this process waits
for the job and exits with its code (75 preempted, 130 interrupted), and should it die outright
(kill -9), the script is sent SIGTERM by the kernel, so the ranks still save and stop.
"""

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from megabam import exit_codes, process
from megabam.config import load_config
from megabam.errors import BadArgument
from megabam.parallel.layout import check_world
from megabam.staging import write_text

REPO = Path(__file__).resolve().parents[1]
LAUNCHERS = ("local", "deepspeed", "mpirun", "slurm")
BODY_MARKER = "# megabam-launch: the body starts here"
PLAIN = re.compile(r"[A-Za-z0-9_.+-]+")  # job, partition and account names: safe on an #SBATCH line
SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d\d){0,2}")  # minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]


def add_launch_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="check a config's layout against the GPUs and start it (torchrun, deepspeed, mpirun, slurm)",
        description=__doc__,
    )
    p.add_argument("launcher", choices=LAUNCHERS)
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides of config values")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node, one per GPU (default 1)")
    p.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    p.add_argument("--hostfile", help="deepspeed (required), mpirun: hosts as 'host slots=N' lines")
    p.add_argument("--ds-launcher", help="deepspeed: how it reaches other hosts (pdsh, openmpi, mvapich, slurm)")
    slurm = p.add_argument_group("slurm")
    slurm.add_argument(
        "--mode", choices=["node", "task"], default="node", help="one torchrun per node, or one task per GPU"
    )
    slurm.add_argument("--job-name", help="default: run.name")
    slurm.add_argument("--time", help="time limit (minutes, HH:MM:SS or D-HH:MM:SS)")
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument(
        "--signal-seconds", type=int, default=120, help="SIGUSR1 this long before the time limit (default 120)"
    )
    slurm.add_argument("--cpu", action="store_true", help="ranks on CPU cores: request no GPUs")
    slurm.add_argument("--log-root", default="logs", help="where each job's log directory goes (default ./logs)")
    slurm.add_argument("--script", help="where the filled sbatch script goes (default LOG_ROOT/JOB_NAME.sbatch)")
    slurm.add_argument("--wait", action="store_true", help="sbatch --wait: return when the job ends, with its code")


def run_launch(args) -> int:
    cmd, env, script = plan_launch(args)
    shown = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    if args.dry_run:
        if script is not None:
            print(f"# {script[0]}\n{script[1]}")
        print("would run: " + " ".join([*shown, shlex.join(cmd)]))
        return exit_codes.OK
    if script is not None:
        path, text = script
        Path(args.log_root).mkdir(parents=True, exist_ok=True)  # sbatch writes the batch log there at once
        write_text(path, text)
    print("running: " + " ".join([*shown, shlex.join(cmd)]), flush=True)
    return run_passing_signals(cmd, {**os.environ, **env})


FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def run_passing_signals(cmd: list[str], env: dict[str, str]) -> int:
    """Run `cmd` in a process group of its own, pass FORWARDED signals on to it, wait, and return its
    exit code (128 + N for a death by signal N, as a shell reports it). The handlers are in place
    before the job starts: a signal that arrives while it is being started (the job may already be
    running its first lines) is held and passed on once its PID is known, instead of killing this
    process and leaving the job to run on."""
    job: list[subprocess.Popen] = []
    held: list[int] = []

    def forward(signum, frame):
        if job:
            job[0].send_signal(signum)
        else:
            held.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        proc = subprocess.Popen(
            cmd, env=env, process_group=0, preexec_fn=lambda: process.parent_death_signal(signal.SIGTERM)
        )
        job.append(proc)
        for signum in held:
            proc.send_signal(signum)
        code = proc.wait()  # resumed after each forwarding handler (PEP 475)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _bad(key: str, why: str) -> BadArgument:
    return BadArgument(None, key, why)


def plan_launch(args) -> tuple[list[str], dict[str, str], tuple[Path, str] | None]:
    """(argument list, extra environment, (path, text) of an sbatch script or None) for `args`."""
    cfg = load_config(args.config, args.overrides)  # every rule the trainer applies
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise _bad("--nodes" if args.nodes < 1 else "--gpus-per-node", "must be at least 1")
    world = args.nodes * args.gpus_per_node
    par = cfg.parallel
    check_world(world, par.tensor, par.pipeline, par.data)
    python = os.environ.get("MEGABAM_PYTHON", sys.executable)
    env = {"MEGABAM_PYTHON": python}
    train_args = [args.config, *args.overrides]
    if args.launcher == "local":
        if args.nodes != 1:
            raise _bad("--nodes", f"the local launcher runs on this node only, got {args.nodes}")
        return ["bash", str(REPO / "launch" / "torchrun.sh"), str(world), *train_args], env, None
    if args.launcher == "deepspeed":
        if not args.hostfile:
            raise _bad("--hostfile", "the deepspeed launcher needs a hostfile ('host slots=N' per line)")
        _check_hostfile(Path(args.hostfile), args.nodes, args.gpus_per_node)
        if args.ds_launcher:
            env["MEGABAM_DS_LAUNCHER"] = args.ds_launcher
        return ["bash", str(REPO / "launch" / "deepspeed.sh"), args.hostfile, *train_args], env, None
    if args.launcher == "mpirun":
        if args.hostfile:
            _check_hostfile(Path(args.hostfile), args.nodes, args.gpus_per_node)
            env["MEGABAM_HOSTFILE"] = args.hostfile
        elif args.nodes > 1:
            raise _bad("--hostfile", f"{args.nodes} nodes need a hostfile naming them")
        return ["bash", str(REPO / "launch" / "mpirun.sh"), str(world), *train_args], env, None
    script = _sbatch_script(args, cfg.run.name, python)
    cmd = ["sbatch", *(["--wait"] if args.wait else []), str(script[0])]
    return cmd, {}, script


def _check_hostfile(path: Path, nodes: int, per_node: int) -> None:
    """A hostfile of `nodes` hosts with `per_node` slots each."""
    try:
        lines = [x.split("#")[0].strip() for x in path.read_text().splitlines()]
    except OSError as e:
        raise _bad("--hostfile", f"cannot read {path}: {e.strerror}") from None
    hosts = [x for x in lines if x]
    for line in hosts:
        m = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
        if m is None or int(m[2]) != per_node:
            raise _bad("--hostfile", f"{path}: {line!r} is not 'HOST slots={per_node}' (--gpus-per-node {per_node})")
    if len(hosts) != nodes:
        raise _bad("--hostfile", f"{path} names {len(hosts)} hosts, --nodes is {nodes}")


def _sbatch_script(args, run_name: str, python: str) -> tuple[Path, str]:
    """launch/slurm.sbatch with its #SBATCH lines for this launch and its arguments filled in."""
    job = args.job_name or run_name
    for key, value, pattern in [
        ("--job-name", job, PLAIN),
        ("--partition", args.partition, PLAIN),
        ("--account", args.account, PLAIN),
        ("--time", args.time, SLURM_TIME),
    ]:
        if value is not None and not pattern.fullmatch(value):
            raise _bad(key, f"{value!r} is not a plain {key[2:]} Slurm accepts on an #SBATCH line")
    if args.signal_seconds < 1:
        raise _bad("--signal-seconds", f"must be at least 1, got {args.signal_seconds}")
    log_root = Path(args.log_root).resolve()
    if re.search(r"[\s'\"\\%]", str(log_root)):
        raise _bad("--log-root", f"{str(log_root)!r}: no spaces, quotes, backslashes or % on an #SBATCH line")
    per_node = args.gpus_per_node if args.mode == "task" else 1
    lines = [
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={args.nodes}",
        f"#SBATCH --ntasks-per-node={per_node}",
        *([] if args.cpu else [f"#SBATCH --gpus-per-node={args.gpus_per_node}"]),
        *([f"#SBATCH --time={args.time}"] if args.time else []),
        *([f"#SBATCH --partition={args.partition}"] if args.partition else []),
        *([f"#SBATCH --account={args.account}"] if args.account else []),
        f"#SBATCH --signal=B:USR1@{args.signal_seconds}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={log_root}/%x-%j.batch.log",
    ]
    template = (REPO / "launch" / "slurm.sbatch").read_text()
    head, body = template.split(BODY_MARKER + "\n")
    comments = [x for x in head.splitlines() if not x.startswith("#SBATCH")]
    q = shlex.quote
    filled = [
        f"export MEGABAM_HOME={q(str(REPO))} MEGABAM_PYTHON={q(python)} MEGABAM_SLURM_MODE={args.mode}",
        f"export MEGABAM_GPUS_PER_NODE={args.gpus_per_node} MEGABAM_LOG_ROOT={q(str(log_root))}",
        "set -- " + " ".join(q(a) for a in [str(Path(args.config).resolve()), *args.overrides]),
    ]
    text = "\n".join([*comments, *lines, BODY_MARKER, "# filled in by megabam launch slurm:", *filled, body])
    path = Path(args.script) if args.script else log_root / f"{job}.sbatch"
    return path, text
