"""The public API is what the README documents: a change to it is deliberate, never a side effect of a move."""

from __future__ import annotations

import subprocess
import sys

import gossiptrain
import gossiptrain.errors
import gossiptrain.sim

PUBLIC = {
    # what a training script uses (README: Python API)
    "Peer", "Workload", "load_workload", "EvalResult",
    # the simulator (README: Simulated clusters)
    "simulate", "SimConfig", "SimResult",
    # configuration (README: Configuration)
    "RunConfig", "TrainConfig", "GossipConfig", "MembershipConfig", "Limits",
    # errors: every one gossiptrain raises on purpose
    "GossipError", "ConfigError", "ProtocolError", "JoinError", "MismatchError", "TransportClosed",
    "WorkloadError", "CheckpointError",
}


def test_the_package_exports_exactly_the_documented_names() -> None:
    assert set(gossiptrain.__all__) == PUBLIC
    assert len(gossiptrain.__all__) == len(PUBLIC)  # no name listed twice


def test_every_exported_name_resolves_to_the_object_its_module_defines() -> None:
    assert gossiptrain.Peer.__module__ == "gossiptrain.runtime.peer"
    assert gossiptrain.simulate is gossiptrain.sim.simulate
    assert gossiptrain.SimConfig is gossiptrain.sim.SimConfig
    for name in gossiptrain.__all__:
        obj = getattr(gossiptrain, name)
        assert getattr(obj, "__name__", name) == name


def test_every_error_of_the_errors_module_is_exported_and_a_gossip_error() -> None:
    errors = {n for n, v in vars(gossiptrain.errors).items() if isinstance(v, type) and issubclass(v, Exception)}
    assert errors <= set(gossiptrain.__all__)
    assert all(issubclass(getattr(gossiptrain, n), gossiptrain.GossipError) for n in errors)


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    try:
        gossiptrain.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("gossiptrain.NoSuchThing resolved")


def test_importing_the_package_pulls_in_neither_torch_nor_the_network_stack() -> None:
    code = "import sys, gossiptrain; print(sorted(m for m in ('torch', 'zmq', 'asyncio') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"
