"""deploy/slurm/gossiptrain.sbatch on a real Slurm (22.05, Debian's slurm-wlm): a one-node cluster of this
machine (gossiptrain.testing.slurm: munged, slurmctld and slurmd in a temporary directory, stopped at teardown).

In the default run: the cluster comes up and a batch job with one srun step completes (about 4 s). In the slow
set (a real coordinator and 3 peers per job, three jobs, about a minute in all: `make test-slow`): the script,
submitted with sbatch unchanged, runs to the end with a merged model; one peer killed mid-run leaves the others
training to the end; scancel of the whole job leaves no process behind.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from gossiptrain.testing import slurm
from gossiptrain.train.metrics import read_metrics

from .swarm import ROOT

pytestmark = pytest.mark.skipif(slurm.why_not() is not None, reason=f"Slurm test cluster: {slurm.why_not()}")

SBATCH = ROOT / "deploy" / "slurm" / "gossiptrain.sbatch"
PEERS = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[slurm.SlurmCluster]:
    with slurm.slurm_cluster() as c:
        yield c


def test_the_cluster_runs_a_batch_job_with_an_srun_step(cluster: slurm.SlurmCluster) -> None:
    script = cluster.dir / "hello.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=2\nsrun --label hostname\n")
    out = cluster.dir / "hello.out"
    job = cluster.sbatch(script, f"--output={out}")
    state = cluster.wait_job(job, 60)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", state
    assert sorted(out.read_text().split("\n")[:2]) == [f"0: {cluster.node}", f"1: {cluster.node}"]
    assert cluster.wait_no_processes(30) == {}


# ---------------------------------------------------------------- the batch script, submitted for real


def submit(cluster: slurm.SlurmCluster, out: Path, run_args: str) -> int:
    """gossiptrain.sbatch as it is, one node, a coordinator and PEERS peers of one CPU each (overlapping)."""
    env = {
        "GOSSIPTRAIN": f"{sys.executable} -m gossiptrain", "PYTHONPATH": str(ROOT), "GOSSIPTRAIN_PORT": "0",
        "GOSSIPTRAIN_RUN_ARGS": f"--workload digits-small {run_args}", "GOSSIPTRAIN_PEER_ARGS": f"--wait-for {PEERS}",
        "GOSSIPTRAIN_OUT": str(out),
    }
    return cluster.sbatch(SBATCH, "--nodes=1", f"--ntasks-per-node={PEERS}", "--cpus-per-task=1",
                          f"--output={out}.log", f"--chdir={cluster.dir}", env=env)


def metrics(out: Path, task: int) -> list[dict[str, Any]]:
    path = out / f"peer-{task}.jsonl"
    return read_metrics(path) if path.exists() else []


def wait_training(cluster: slurm.SlurmCluster, job: int, out: Path, timeout: float) -> None:
    """Until every peer's metrics show steps taken (the job still running)."""
    deadline = time.monotonic() + timeout
    while not all(any(r.get("step", 0) > 0 for r in metrics(out, i)) for i in range(PEERS)):
        state = cluster.job(job).get("JobState")
        assert state == "RUNNING" or (state == "PENDING" and time.monotonic() < deadline), (
            state, Path(f"{out}.log").read_text() if Path(f"{out}.log").exists() else "")
        assert time.monotonic() < deadline, f"the peers did not train within {timeout} s"
        time.sleep(0.2)


def done(out: Path, task: int) -> dict[str, Any]:
    last = metrics(out, task)[-1]
    assert last["event"] == "done", last
    return last


@pytest.mark.slow  # a coordinator and 3 peers training digits-small for 300 steps under Slurm, about 10 s
def test_the_batch_script_runs_to_the_end_and_writes_the_merged_model(cluster: slurm.SlurmCluster) -> None:
    out = cluster.dir / "full"
    job = submit(cluster, out, "--steps 300")
    state = cluster.wait_job(job, 150)
    log = Path(f"{out}.log").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, log)
    assert re.search(rf"coordinator on {re.escape(cluster.node)} listening at 127\.0\.0\.1:\d+; starting {PEERS} peers", log), log
    for i in range(PEERS):
        last = done(out, i)
        assert last["step"] == 300 and last["exchanges"] > 0 and last["finish"] == "budget", last
        assert last["final_all_done"] and last["final_rounds"] > 0, last  # the final consensus, all together
    assert done(out, 0)["final_model"] == str(out / "model.safetensors")
    assert (out / "model.safetensors").stat().st_size > 0 and (out / "model.json").exists()
    # The coordinator's step was sent SIGTERM (scancel --signal), not SIGKILL (srun's answer to its own SIGTERM):
    coordinator = (out / "coordinator.log").read_text()
    assert "forcing job termination" not in coordinator and "Killed" not in coordinator, coordinator
    assert cluster.wait_no_processes(30) == {}


@pytest.mark.slow  # 3 peers for 12 s of training, one of them killed after its first steps: about 20 s
def test_a_peer_killed_mid_run_leaves_the_others_training_to_the_end(cluster: slurm.SlurmCluster) -> None:
    out = cluster.dir / "churn"
    job = submit(cluster, out, "--seconds 12")
    wait_training(cluster, job, out, 90)
    victim = [pid for pid, cmd in cluster.processes().items()
              if " peer " in cmd and cmd.endswith(f"--metrics {out}/peer-1.jsonl")]
    assert len(victim) == 1, cluster.processes()
    os.kill(victim[0], signal.SIGKILL)  # one task of the peers' step dies, as with its node: no goodbye
    state = cluster.wait_job(job, 150)
    log = Path(f"{out}.log").read_text()
    assert state["JobState"] in ("COMPLETED", "FAILED"), (state, log)  # the step's status is the dead task's
    assert metrics(out, 1)[-1]["event"] != "done"
    for i in (0, 2):
        last = done(out, i)
        assert last["finish"] == "budget" and last["final_all_done"], last
        assert last["members_dead"] + last["members_left"] >= 1, last  # the survivors noticed it gone
    assert (out / "model.safetensors").exists()
    assert cluster.wait_no_processes(30) == {}


@pytest.mark.slow  # 3 peers started for 120 s, cancelled once they train: about 8 s
def test_scancel_of_the_job_leaves_no_process_behind(cluster: slurm.SlurmCluster) -> None:
    out = cluster.dir / "cancel"
    job = submit(cluster, out, "--seconds 120")
    wait_training(cluster, job, out, 90)
    assert cluster.processes()
    cluster.run(["scancel", str(job)])
    state = cluster.wait_job(job, 60)
    assert state["JobState"] == "CANCELLED", state
    assert cluster.wait_no_processes(30) == {}
    # Slurm sent each peer SIGTERM itself; most write a last record (finish "signal") before srun, which got one
    # too as a process of the batch step, has its tasks killed: a race of Slurm's, so not asserted.
