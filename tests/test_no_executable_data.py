"""Nothing that came from a peer or a file may be executed: no pickle, marshal, torch.load, eval.

Walks the source of every shipped package (and the experiments) with ``ast``
and fails on any call or import that deserializes executable data, so that
such a call cannot slip in unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .swarm import ROOT

PACKAGES = ("gossiptrain", "peers", "topologies", "experiments")
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "torch.load", "numpy.load", "np.load", "yaml.load", "yaml.unsafe_load", "pickle.loads"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def offences(source: str, filename: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [f"{filename}:{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call) and _dotted(node.func) in FORBIDDEN_CALLS:
            found.append(f"{filename}:{node.lineno}: {_dotted(node.func)}(...)")
    return found


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_the_walk_sees_the_packages() -> None:
    names = {p.relative_to(ROOT).parts[0] for p in sources()}
    assert {"gossiptrain", "peers", "topologies"} <= names


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_executable_deserialization(path: Path) -> None:
    assert offences(path.read_text(), str(path.relative_to(ROOT))) == []


@pytest.mark.parametrize(
    "snippet",
    ["import pickle", "from marshal import loads", "torch.load(f)", "eval(s)", "import cloudpickle as cp", "np.load(p)"],
)
def test_the_checker_catches_each_form(snippet: str) -> None:
    assert offences(snippet, "x.py"), snippet
