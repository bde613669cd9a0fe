"""deploy/: what can be checked without a cluster (none runs here; deploy/README.md says so).

- Kubernetes: the manifests parse (PyYAML), hang together (the Service
  selects the coordinator's pods, the peers join the Service's name and
  port, shards match the peers), and every container's arguments are ones
  the `gossiptrain` parser accepts; kubectl, where installed, decodes them
  offline (``kubectl annotate --local``: ``create --dry-run=client`` needs
  an API server for its kinds).
- Slurm: the batch script passes ``bash -n``, and runs to the end against
  stand-in ``srun`` and ``scontrol`` on this machine: a coordinator and two
  peers that train and finish.
- Docker: the Dockerfile installs a torch the project admits and enters
  through the ``gossiptrain`` script the project installs (no docker engine
  runs here: ``docker build`` cannot be tried).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from gossiptrain.cli.main import build_parser
from gossiptrain.runtime.launch_plan import DEFAULT_PORT
from gossiptrain.train.metrics import read_metrics

from .swarm import ROOT, run_in_session

DEPLOY = ROOT / "deploy"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def one(kind: str) -> dict[str, Any]:
    found = [d for d in manifests() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def expand(args: list[str], values: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) references, as the kubelet fills them in."""
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in args]


# ---------------------------------------------------------------- Kubernetes


def test_the_manifests_are_a_coordinator_deployment_its_service_and_a_job_of_peers() -> None:
    docs = manifests()
    assert sorted((d["apiVersion"], d["kind"]) for d in docs) == [("apps/v1", "Deployment"), ("batch/v1", "Job"), ("v1", "Service")]
    assert all(isinstance(d["metadata"]["name"], str) and d["metadata"]["name"] for d in docs)


def test_the_service_reaches_the_coordinator_and_the_peers_join_through_it() -> None:
    deployment, service, job = one("Deployment"), one("Service"), one("Job")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    coordinator = container(deployment)
    named = {p["name"]: p["containerPort"] for p in coordinator["ports"]}
    assert port["port"] == named[port["targetPort"]] == DEFAULT_PORT
    args = build_parser().parse_args(expand(coordinator["args"], {"POD_IP": "10.0.0.7"}))
    assert args.bind == f"10.0.0.7:{DEFAULT_PORT}"  # the pod's own address: a listener binds to an interface's address
    env = {e["name"]: e.get("value") for e in container(job)["env"]}
    assert env["GOSSIPTRAIN_JOIN"] == f"{service['metadata']['name']}:{port['port']}"
    assert int(args.shards) == job["spec"]["completions"] == job["spec"]["parallelism"]  # one shard per peer


def test_the_peers_arguments_parse_with_the_join_address_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    job = one("Job")
    peer = container(job)
    env = {e["name"]: e.get("value") for e in peer["env"]}
    monkeypatch.setenv("GOSSIPTRAIN_JOIN", env["GOSSIPTRAIN_JOIN"])
    args = build_parser().parse_args(expand(peer["args"], {"CPUS": "1"}))
    assert args.command == "peer" and args.join == env["GOSSIPTRAIN_JOIN"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert peer["image"] == container(one("Deployment"))["image"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_decodes_the_manifests_offline(tmp_path: Path) -> None:
    # --local: no API server is asked (create --dry-run=client would ask one for the kinds, and fail without a cluster);
    # HOME and KUBECONFIG point nowhere, so no real cluster's configuration is read either.
    done = subprocess.run(
        ["kubectl", "annotate", "--local", "-f", str(DEPLOY / "k8s"), "checked=offline", "-o", "name"],
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"], "HOME": str(tmp_path),
                                                         "KUBECONFIG": str(tmp_path / "none")},
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == [
        "deployment.apps/gossiptrain-coordinator", "job.batch/gossiptrain-peers", "service/gossiptrain-coordinator"]


# ---------------------------------------------------------------- Slurm

SBATCH = DEPLOY / "slurm" / "gossiptrain.sbatch"

# Stand-ins for Slurm's commands, enough for the script: srun runs its command --ntasks times here, with
# SLURM_PROCID set (each line labelled with it under --label) and passes SIGTERM on; scontrol names one node.
FAKE_SRUN = r"""#!/bin/bash
ntasks=1; label=0
while [[ "$1" == --* ]]; do
    case "$1" in --ntasks=*) ntasks="${1#--ntasks=}" ;; --label) label=1 ;; esac
    shift
done
pids=()
for ((i = 0; i < ntasks; i++)); do
    if ((label)); then SLURM_PROCID=$i "$@" 2>&1 | sed "s/^/$i: /" & else SLURM_PROCID=$i "$@" & fi
    pids+=("$!")
done
trap 'kill -TERM "${pids[@]}" 2> /dev/null' TERM
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
"""
FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && echo localhost
"""
FAKE_SCANCEL = "#!/bin/bash\nexit 1\n"  # no controller: the script falls back to signalling srun's processes


def test_the_batch_script_is_valid_bash() -> None:
    done = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash\n")
    directives = re.findall(r"^#SBATCH (--[\w-]+)", text, re.M)
    assert {"--nodes", "--ntasks-per-node", "--time"} <= set(directives)


@pytest.mark.slow  # a real coordinator and 2 peers through the script, 7 s: `make test-slow`; `bash -n` stays in the default run
@pytest.mark.skipif(shutil.which("getent") is None, reason="the script resolves the first node with getent")
def test_the_batch_script_runs_a_coordinator_and_peers_that_finish(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
        "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2",
        "GOSSIPTRAIN": f"{sys.executable} -m gossiptrain", "GOSSIPTRAIN_PORT": "0",  # any free port
        "GOSSIPTRAIN_RUN_ARGS": "--workload digits-small --steps 100", "GOSSIPTRAIN_PEER_ARGS": "--wait-for 2",
        "GOSSIPTRAIN_OUT": str(out),
    }
    env.pop("GOSSIPTRAIN_JOIN", None)
    done = run_in_session(["bash", str(SBATCH)], 120, "the batch script", env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"coordinator on localhost listening at 127\.0\.0\.1:\d+; starting 2 peers", done.stdout), done.stdout
    for i in range(2):
        last = read_metrics(out / f"peer-{i}.jsonl")[-1]
        assert last["event"] == "done" and last["step"] == 100 and last["exchanges"] > 0, last
    assert "join with:" in (out / "coordinator.log").read_text()


# ---------------------------------------------------------------- Docker

DOCKERFILE = (DEPLOY / "Dockerfile").read_text()


def _instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)
            if not m.group(0).lstrip().startswith("#")]


def test_the_dockerfile_installs_a_torch_the_project_admits_on_python_3_11_slim() -> None:
    steps = _instructions()
    assert steps[0] == ("FROM", "python:3.11-slim")
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    torch_spec = next(SpecifierSet(d.removeprefix("torch")) for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    assert args["TORCH_VERSION"] == "2.13.0" and args["TORCH_VERSION"] in torch_spec
    assert "/cpu" in args["TORCH_INDEX"]
    runs = [a for k, a in steps if k == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    project_at = next(i for i, r in enumerate(runs) if "pip install ." in r)
    assert torch_at < project_at  # torch first, from the CPU index: the project's install then finds it satisfied
    major_minor = tuple(int(x) for x in steps[0][1].split(":")[1].split("-")[0].split("."))
    assert f"{major_minor[0]}.{major_minor[1]}" in SpecifierSet(PYPROJECT["project"]["requires-python"])


def test_the_dockerfile_copies_what_the_project_needs_and_enters_through_gossiptrain() -> None:
    steps = _instructions()
    copied = [w for k, a in steps if k == "COPY" for w in a.split()[:-1]]
    assert all((ROOT / path).exists() for path in copied), copied
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= set(copied) and "pyproject.toml" in copied and PYPROJECT["project"]["readme"] in copied
    assert ("ENTRYPOINT", '["gossiptrain"]') in steps
    assert "gossiptrain" in PYPROJECT["project"]["scripts"]
    cmd = next(a for k, a in steps if k == "CMD")
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(yaml.safe_load(cmd))  # the default command: --help, exit 0
    assert e.value.code == 0
    assert ("EXPOSE", str(DEFAULT_PORT)) in steps


def test_the_dockerfile_runs_as_a_numbered_user_it_creates() -> None:
    # Kubernetes' runAsNonRoot (Pod Security "restricted") refuses an image whose USER is a name: it cannot tell
    # a name from root without the image's /etc/passwd (hadolint DL3066).
    steps = _instructions()
    (user,) = [a for k, a in steps if k == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user
    assert any(k == "RUN" and f"--uid {uid} " in a for k, a in steps), "the USER's uid is not the one useradd creates"
