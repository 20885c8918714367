"""A real single-node Slurm (Debian's slurm-wlm and munge) for the launcher tests, run as root
without systemd; everything it writes lives under one folder. ../shared/docs/platform-notes.md
records what made it run here.

Another copy of the suite may run its own cluster on the same machine at the same time, so nothing
is shared with it: the daemons listen on free ports (Slurm's defaults, 6817/6818, would let the second
cluster's clients reach the first), job ids start at a random number (megabam derives a job's
rendezvous port from its id: two clusters both counting from 1 would give their jobs the same port),
and stopping kills this cluster's step daemons only."""

import glob
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from megabam.parallel.ranks import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")


def missing() -> str | None:
    """Why no cluster can start here, or None."""
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge; tools/install.sh does as root)"
    if os.geteuid() != 0:
        return "the test cluster runs its daemons as root"
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """munged + slurmctld + slurmd on this host; `env` is what a client (sbatch, scontrol) needs."""

    def __init__(self, root: Path):
        self.root = root
        for sub in ("munge", "state", "spool", "log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o755)  # else munged: "Socket is inaccessible"
        self.socket = root / "munge" / "munge.socket"
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self) -> "SlurmCluster":
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        m = self.root / "munge"
        subprocess.run(
            [_exe("munged"), f"--key-file={key}", f"--socket={self.socket}", f"--pid-file={m}/munged.pid",
             f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed", "--force"],
            check=True, capture_output=True,
        )  # fmt: skip
        node = subprocess.run([_exe("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
        topology = " ".join(node.splitlines()[0].split()[1:])  # CPUs=... RealMemory=..., NodeName dropped
        host = socket.gethostname().split(".")[0]
        r = self.root
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=megabamtest",
                    f"SlurmctldHost={host}(127.0.0.1)",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    f"FirstJobId={random.randrange(1000, 1_000_000)}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"AuthInfo=socket={self.socket},cred_expire=5",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "MinJobAge=2",
                    "KillWait=10",
                    "SchedulerParameters=sched_interval=1",
                    f"PlugStackConfig={r}/plugstack.conf",
                    f"StateSaveLocation={r}/state",
                    f"SlurmdSpoolDir={r}/spool",
                    f"SlurmctldPidFile={r}/slurmctld.pid",
                    f"SlurmdPidFile={r}/slurmd.pid",
                    f"SlurmctldLogFile={r}/log/slurmctld.log",
                    f"SlurmdLogFile={r}/log/slurmd.log",
                    f"NodeName={host} NodeAddr=127.0.0.1 {topology} State=UNKNOWN",
                    f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        (r / "plugstack.conf").write_text("")
        subprocess.run([_exe("slurmctld"), "-c", "-f", str(self.conf)], check=True, env=self.env)
        subprocess.run([_exe("slurmd"), "-f", str(self.conf)], check=True, env=self.env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=self.env)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated"):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the test Slurm did not come up: {out.stdout} {out.stderr}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in sorted((self.root / "log").glob("*.log")))

    def stop(self) -> None:
        subprocess.run(["scancel", "--user=root"], capture_output=True, env=self.env)
        subprocess.run(["scontrol", "shutdown"], capture_output=True, env=self.env)
        time.sleep(1)
        subprocess.run([_exe("munged"), "--stop", f"--socket={self.socket}"], capture_output=True)
        for pid_file in (self.root / "slurmctld.pid", self.root / "slurmd.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        # slurmstepd survives a controller shutdown; this cluster's inherit its slurmd's SLURM_CONF
        for pid in self._step_daemons():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _step_daemons(self) -> list[int]:
        mine = f"SLURM_CONF={self.conf}".encode()
        found = []
        for comm in glob.glob("/proc/[0-9]*/comm"):
            try:
                if open(comm).read().strip() != "slurmstepd":
                    continue
                pid = int(comm.split("/")[2])
                if mine in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                    found.append(pid)
            except OSError:  # ended while we looked
                continue
        return found
