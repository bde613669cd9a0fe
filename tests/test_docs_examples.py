"""The code blocks of README.md and docs/: each says how it is checked, and the cheap ones run as written.

Every fenced block of language sh, bash, console, shell, python or toml is preceded, on the line right
before its fence, by exactly one marker (docs plan, issue 47):

- ``<!-- example: NAME -->``: run here (NAME unique over all pages, and one this file knows how to check);
- ``<!-- tested-by: tests/test_x.py::test_name -->``: an existing test runs that command or code;
- ``<!-- not-run: REASON -->``: not runnable here (several hosts, a GPU, a cluster, root, minutes).

The examples run as a user would run them: python blocks as a script with the repository on PYTHONPATH,
sh blocks line by line with this interpreter's bin first on PATH, each in its own temporary directory,
on loopback only, each command bounded by a timeout that kills its whole process group.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from .swarm import ROOT, run_in_session

MARKED_LANGUAGES = {"sh", "bash", "console", "shell", "python", "toml"}
MARKER = re.compile(r"^\s*<!--\s*(example|tested-by|not-run)\s*:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([A-Za-z0-9_+-]*)")
COMMAND_TIMEOUT = 60  # seconds, per sh line or python script: every example here takes a few seconds
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    language: str
    kind: str | None  # example, tested-by, not-run; None: no marker
    value: str
    code: str
    markers_before: int  # marker lines right above the fence (1 expected)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def doc_files() -> list[Path]:
    files = [ROOT / "README.md"]
    docs = ROOT / "docs"
    if docs.is_dir():
        files += sorted(docs.rglob("*.md"))
    return [f for f in files if f.is_file()]


def parse_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = path.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, fence, language = opened.group(1), opened.group(2), opened.group(3).lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            closing = FENCE.match(lines[i])
            if closing and closing.group(2)[0] == fence[0] and len(closing.group(2)) >= len(fence) and not closing.group(3):
                break
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1  # past the closing fence
        markers = 0
        j = start - 1
        while j >= 0 and MARKER.match(lines[j]):
            markers += 1
            j -= 1
        found = MARKER.match(lines[start - 1]) if start > 0 else None
        blocks.append(Block(rel, start + 1, language, found.group(1) if found else None,
                            found.group(2) if found else "", "\n".join(body) + "\n", markers))
    return blocks


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in parse_blocks(f)]


def marked_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.language in MARKED_LANGUAGES]


# --- what each example must show ------------------------------------------------------------------------

Check = Callable[[str, Path], None]


def _help(out: str, _: Path) -> None:
    assert "coordinator" in out and "peer" in out and "simulate" in out, out


def _config(out: str, _: Path) -> None:
    for section in ("[train]", "[gossip]", "[membership]", "[state]", "[limits]"):
        assert section in out, out


def _keys(out: str, tmp: Path) -> None:
    assert (tmp / "keys" / "coordinator.key").is_file() and (tmp / "keys" / "coordinator.key_secret").is_file(), out
    assert "public key" in out, out


def _simulate_json(out: str, _: Path) -> None:
    summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])  # --json: one object
    assert summary["peers"] == 4 and summary["live_peers"] == 4 and not summary["interrupted"], summary
    assert summary["mean_test_acc"] > 0.6 and summary["exchanges_per_peer"] > 0, summary  # it trained and averaged


def _simulate_python(out: str, _: Path) -> None:
    found = re.search(r"(\d+) rows, mean test accuracy ([0-9.]+)", out)
    assert found, out
    assert int(found.group(1)) > 0 and float(found.group(2)) > 0.6, out


def _plot(out: str, tmp: Path) -> None:
    assert (tmp / "series.csv").is_file(), out
    picture = tmp / "run.png"
    assert picture.is_file() and picture.read_bytes().startswith(PNG_MAGIC), out
    assert "wrote run.png" in out and "virtual time" in out, out


# Examples run by another test, which this file only checks exists (test_tested_by_names_an_existing_test).
DELEGATED = {
    # the README's Python API example: a coordinator and two processes running it (tests/test_cli.py reads it)
    "python-api": "tests/test_cli.py::test_readme_python_api_example_runs",
}

CHECKS: dict[str, Check] = {
    "tutorial-help": _help,
    "tutorial-config": _config,
    "keys-new": _keys,
    "simulate-small": _simulate_json,
    "simulate-python": _simulate_python,
    "plot-simulated-run": _plot,
}


# --- the rules every page follows ------------------------------------------------------------------------


def test_the_pages_are_found() -> None:
    files = [f.relative_to(ROOT).as_posix() for f in doc_files()]
    assert "README.md" in files
    assert any(b.kind == "example" and b.value == "python-api" for b in parse_blocks(ROOT / "README.md"))


def test_every_marked_language_block_carries_exactly_one_marker() -> None:
    problems = []
    for b in marked_blocks():
        if b.kind is None:
            problems.append(f"{b.where}: a ```{b.language} block without a marker on the line before its fence "
                            "(<!-- example: NAME -->, <!-- tested-by: tests/FILE.py::TEST -->, <!-- not-run: REASON -->)")
        elif b.markers_before > 1:
            problems.append(f"{b.where}: {b.markers_before} markers before one block; exactly one is allowed")
        elif not b.value:
            problems.append(f"{b.where}: `{b.kind}:` with nothing after it (a name, a test or a reason)")
    assert not problems, "\n".join(problems)


def test_example_names_are_unique_and_known() -> None:
    problems = []
    seen: dict[str, str] = {}
    for b in marked_blocks():
        if b.kind != "example":
            continue
        if b.value in seen:
            problems.append(f"{b.where}: example {b.value!r} is also at {seen[b.value]}; names are unique over all pages")
        seen.setdefault(b.value, b.where)
        if b.value not in CHECKS and b.value not in DELEGATED:
            problems.append(f"{b.where}: example {b.value!r} is not one tests/test_docs_examples.py knows how to run "
                            "(add a check to CHECKS, or mark the block tested-by or not-run)")
        elif b.value in CHECKS and b.language not in ("python", "sh", "bash", "shell", "console"):
            problems.append(f"{b.where}: example {b.value!r} is a ```{b.language} block, which cannot be run")
    assert not problems, "\n".join(problems)


def _test_exists(reference: str) -> str | None:
    """None if `tests/x.py::name` (or `::Class::name`) names a test function; else what is wrong."""
    path, _, name = reference.partition("::")
    if not name:
        return f"{reference!r} is not tests/FILE.py::TEST"
    file = ROOT / path
    if not file.is_file():
        return f"{path} does not exist"
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    scope: list[ast.stmt] = tree.body
    *classes, function = name.split("::")
    for cls in classes:
        found = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls]
        if not found:
            return f"{path} has no class {cls}"
        scope = found[0].body
    function = function.split("[")[0]  # a parametrized case names its function
    if not any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == function for n in scope):
        return f"{path} has no test {function}"
    return None


def test_tested_by_names_an_existing_test() -> None:
    problems = []
    for b in marked_blocks():
        if b.kind == "tested-by":
            wrong = _test_exists(b.value)
            if wrong:
                problems.append(f"{b.where}: tested-by {wrong}")
    for name, reference in DELEGATED.items():
        wrong = _test_exists(reference)
        if wrong:
            problems.append(f"example {name!r} is delegated to a missing test: {wrong}")
    assert not problems, "\n".join(problems)


# --- running the examples --------------------------------------------------------------------------------


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run one command in `cwd`, in its own session: on a timeout its whole process group is killed."""
    command = ["bash", "-c", f"cd {shlex.quote(str(cwd))} && exec {shlex.join(argv)}"]
    result = run_in_session(command, COMMAND_TIMEOUT, " ".join(argv), env=env)
    return result.returncode, result.stdout + result.stderr


def _shell_lines(code: str) -> list[str]:
    """The block's commands: continuation lines joined, blank lines and whole-line comments left out."""
    joined = code.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GOSSIPTRAIN_")}  # no $GOSSIPTRAIN_JOIN from outside
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["MPLBACKEND"] = "Agg"
    return env


RUNNABLE = [b for b in marked_blocks() if b.kind == "example" and b.value in CHECKS]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.value for b in RUNNABLE])
def test_example_runs_and_does_its_job(block: Block, tmp_path: Path) -> None:
    env = _environment()
    outputs = []
    if block.language == "python":
        script = tmp_path / "example.py"
        script.write_text(block.code, encoding="utf-8")
        status, out = _run([sys.executable, str(script)], tmp_path, env)
        assert status == 0, f"{block.where}: exit {status}\n{out}"
        outputs.append(out)
    else:
        lines = _shell_lines(block.code)
        assert lines, f"{block.where}: no command in the block"
        for line in lines:
            status, out = _run(["bash", "-c", line], tmp_path, env)
            assert status == 0, f"{block.where}: `{line}` exited {status}\n{out}"
            outputs.append(out)
    CHECKS[block.value]("\n".join(outputs), tmp_path)
