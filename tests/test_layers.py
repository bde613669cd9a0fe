"""The layers of gossiptrain/__init__.py hold: import-linter's contracts (pyproject.toml) pass, and they bite.

A broken contract fails this test with import-linter's report, which names
the offending import and its line. The last test plants violations in a
copy of the tree to show that the contracts catch them.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gossiptrain", "peers", "topologies")
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    env_path = f"{cwd}"  # the packages are found from cwd first, as in the checkout
    return subprocess.run(
        [sys.executable, "-c", LINT], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )


def test_every_layer_contract_is_kept() -> None:
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout and "kept" in run.stdout


def test_the_contracts_name_a_planted_violation(tmp_path: Path) -> None:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "gossiptrain/protocol/planted.py").write_text("import asyncio\n")
    (tmp_path / "gossiptrain/net/planted.py").write_text("from gossiptrain.runtime import peer\n")
    (tmp_path / "gossiptrain/runtime/planted.py").write_text("from gossiptrain.integrations import hf\n")
    run = lint_imports(tmp_path)
    assert run.returncode != 0
    assert "gossiptrain.protocol.planted -> asyncio" in run.stdout
    assert "gossiptrain.net.planted -> gossiptrain.runtime.peer" in run.stdout
    assert "gossiptrain.runtime.planted -> gossiptrain.integrations.hf" in run.stdout


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_another_modules_private_names() -> None:
    offences = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            here = _module_of(path)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    if node.module.split(".")[0] not in PACKAGES or node.module == here:
                        continue
                    for alias in node.names:
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            offences.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{alias.name}")
    assert not offences, "\n".join(offences)
