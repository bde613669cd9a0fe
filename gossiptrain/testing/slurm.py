"""A single-node Slurm cluster in a temporary directory, for tests of what runs under Slurm (``deploy/slurm/``).

``slurm_cluster()`` writes a ``slurm.conf`` into a fresh temporary
directory, makes a munge key there on the spot, and starts ``munged``,
``slurmctld -D`` and ``slurmd -D`` as this process's own children (each in a
session of its own, ``SLURM_CONF`` pointing at that configuration); it
yields a ``SlurmCluster`` whose ``env`` runs ``sbatch``, ``srun``,
``squeue``, ``scontrol`` and ``scancel`` against it. There is no
``slurmdbd`` (so no ``sacct``): a job's state is ``scontrol show job``'s.
Leaving the ``with`` block cancels every job, stops the daemons, kills
whatever still runs with this cluster's ``SLURM_CONF`` in its environment
(job steps, ``slurmstepd``) and deletes the directory.

What the configuration says, and why:

- One node, this machine's hostname at 127.0.0.1 (``NodeAddr``), with
  ``cpus`` CPUs (default 8) whatever the hardware has:
  ``SlurmdParameters=config_overrides`` makes slurmd take the declared
  count instead of draining a node that has fewer. Overstating is the point:
  a swarm's steps (a coordinator and its peers, each with
  ``--cpus-per-task=1``) mostly wait on the network and on one another, so
  a coordinator and three peers as job steps fit a 2-core machine, and
  oversubscription is what the tests want to fit.
- No cgroups and no systemd (containers, gVisor): ``proctrack/linuxproc``
  (a job's processes found by parentage), ``task/none`` (no binding),
  ``jobacct_gather/none``, ``accounting_storage/none``, ``jobcomp/none``;
  so no ``cgroup.conf`` is read.
- Root runs everything (``SlurmUser=root``, ``SlurmdUser=root``); jobs run
  as whoever submits them.
- munge's socket, key, pid, log and seed files, Slurm's
  ``StateSaveLocation``, ``SlurmdSpoolDir``, pid and log files, and an empty
  ``PlugStackConfig``, all in the directory; ``AuthInfo=socket=...`` points
  Slurm at this munged, not the system's. The ports (``SlurmctldPort``,
  ``SlurmdPort``) are found free on 127.0.0.1. ``ReturnToService=2``: the
  node comes back by itself if it ever went down.

Needs root and Debian's ``slurm-wlm`` and ``munge`` (Slurm 22.05 on Debian
12; ``why_not`` says which is missing). The directory is made 0755 (munged
refuses a socket whose directory others cannot enter) under the system's
temporary directory, whose ancestors must be searchable by all too (munged
checks them), which pytest's ``tmp_path`` is not.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from gossiptrain.net.addressing import free_loopback_port

#: The programs the cluster needs, and the Debian package each comes from.
TOOLS = {
    "munged": "munge", "mungekey": "munge", "slurmctld": "slurm-wlm (slurmctld)", "slurmd": "slurm-wlm (slurmd)",
    "sbatch": "slurm-wlm (slurm-client)", "srun": "slurm-wlm (slurm-client)", "squeue": "slurm-wlm (slurm-client)",
    "scontrol": "slurm-wlm (slurm-client)", "scancel": "slurm-wlm (slurm-client)",
}


def why_not() -> str | None:
    """Why this machine cannot run the test cluster (None: it can): not root, or a program missing."""
    if os.geteuid() != 0:
        return "needs root to run slurmctld, slurmd and munged"
    for tool, package in TOOLS.items():
        if shutil.which(tool) is None:
            return f"needs {tool} (Debian's {package}; .ci/run installs it)"
    return None


class SlurmError(RuntimeError):
    """The cluster did not come up, or a Slurm command failed; the message has the tool's words or the logs' tail."""


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(none)"


@dataclass
class SlurmCluster:
    """A running single-node cluster: ``env`` (``SLURM_CONF`` set) is what Slurm's commands need to reach it."""

    dir: Path
    node: str
    cpus: int
    env: dict[str, str]
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    def run(self, cmd: Sequence[str], timeout: float = 30, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A Slurm command against this cluster (``env``: added to the cluster's); ``check``: raise on failure."""
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                              env={**self.env, **(env or {})})
        if check and done.returncode != 0:
            raise SlurmError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
        return done

    def sbatch(self, script: str | Path, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit ``script`` (``args``: sbatch's options, before it); the job id."""
        done = self.run(["sbatch", "--parsable", *args, str(script)], env=env)
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, ...); empty once the controller forgot the job."""
        done = self.run(["scontrol", "show", "job", "--oneliner", str(job_id)], check=False)
        if done.returncode != 0:
            return {}
        return dict(w.split("=", 1) for w in done.stdout.split() if "=" in w)

    def steps(self, job_id: int) -> dict[str, str]:
        """The job's running steps, step id (``JOB.N``) -> step name, from ``squeue --steps``."""
        done = self.run(["squeue", "--noheader", "--steps", "--jobs", str(job_id), "--format=%i %j"], check=False)
        return dict(line.split(None, 1) for line in done.stdout.splitlines() if len(line.split(None, 1)) == 2)

    def wait_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """Poll until the job has ended (COMPLETED, FAILED, CANCELLED, TIMEOUT, ...); its fields then."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
                return fields
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} still {fields.get('JobState')} after {timeout} s; slurmd's log:\n"
                                 f"{_tail(self.dir / 'slurmd.log')}")
            time.sleep(0.2)

    def processes(self) -> dict[int, str]:
        """Processes other than the daemons with this cluster's ``SLURM_CONF`` in their environment (slurmstepd
        and everything a job started: sbatch passes the environment on), pid -> command line."""
        marker = f"SLURM_CONF={self.conf}".encode()
        ours = {p.pid for p in self.daemons.values()}
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in ours or int(entry.name) == os.getpid():
                continue
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                    if not cmdline.endswith("slurmscriptd"):  # slurmctld's own helper, stopped with it
                        found[int(entry.name)] = cmdline
            except OSError:
                continue  # gone, or a kernel thread
        return found

    def wait_no_processes(self, timeout: float) -> dict[int, str]:
        """Poll until no process of this cluster's jobs is left (at most ``timeout``); those left then."""
        deadline = time.monotonic() + timeout
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left


def _config(d: Path, node: str, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName=gossiptrain-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={d}/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@contextmanager
def slurm_cluster(cpus: int = 8, node: str | None = None, timeout: float = 60) -> Iterator[SlurmCluster]:
    """A running cluster of one node named ``node`` (default: this machine's hostname) with ``cpus`` CPUs; waits
    (at most ``timeout``) until the node is idle. Raises SlurmError with the daemons' logs if it never is."""
    node = node or socket.gethostname()
    d = Path(tempfile.mkdtemp(prefix="gossiptrain-slurm-"))
    d.chmod(0o755)  # munged: "execute permissions for all required" on its socket's directory
    env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
    for name in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
        del env[name]  # from a surrounding job, if any: they would steer sbatch and srun elsewhere
    cluster = SlurmCluster(d, node, cpus, env)
    try:
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        (d / "plugstack.conf").write_text("")
        (d / "slurm.conf").write_text(_config(d, node, cpus, free_loopback_port(), free_loopback_port()))
        subprocess.run(["mungekey", "--create", "--keyfile", str(d / "munge.key")], check=True, capture_output=True,
                       timeout=30)
        commands = {
            "munged": ["munged", "--foreground", f"--key-file={d}/munge.key", f"--socket={d}/munge.socket",
                       f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
            "slurmctld": ["slurmctld", "-D", "-i"],
            "slurmd": ["slurmd", "-D", "-N", node],
        }
        for name, cmd in commands.items():
            with open(d / f"{name}.out", "wb") as out:
                cluster.daemons[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                         start_new_session=True, cwd=d)
            if name == "munged":
                _wait(lambda: (d / "munge.socket").exists(), timeout, cluster, "munged made no socket")
        _wait(lambda: _node_state(cluster) in ("IDLE", "MIXED", "ALLOCATED"), timeout, cluster,
              f"node {node} never became idle")
        yield cluster
    finally:
        _stop(cluster)
        shutil.rmtree(d, ignore_errors=True)


def _node_state(cluster: SlurmCluster) -> str:
    done = cluster.run(["sinfo", "--noheader", "--Node", "--format=%T"], check=False, timeout=10)
    return done.stdout.strip().upper().rstrip("*~#!%$@^-")


def _wait(ready: Callable[[], bool], timeout: float, cluster: SlurmCluster, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [n for n, p in cluster.daemons.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"--- {n}:\n{_tail(cluster.dir / f'{n}.out', 1500)}" for n in cluster.daemons)
            raise SlurmError(f"{what}{' (' + ', '.join(dead) + ' exited)' if dead else ''}; logs:\n{logs}")
        time.sleep(0.1)


def _stop(cluster: SlurmCluster) -> None:
    """Cancel every job, stop the daemons (slurmd, slurmctld, munged), kill whatever the jobs left running."""
    if "slurmctld" in cluster.daemons and cluster.daemons["slurmctld"].poll() is None:
        cluster.run(["scancel", "--full", "--user", "root"], check=False, timeout=10)  # root runs every job here
        deadline = time.monotonic() + 20
        while cluster.run(["squeue", "--noheader"], check=False, timeout=10).stdout.strip():
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    for name in ("slurmd", "slurmctld", "munged"):
        proc = cluster.daemons.get(name)
        if proc is None:
            continue
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for pid in cluster.processes():  # ours only: they carry this cluster's SLURM_CONF
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
