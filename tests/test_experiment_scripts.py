"""Every experiment script starts: its imports resolve and its flags parse (cheap; the full --quick runs of the
heaviest scripts are in the slow set, `make test-slow`).

All the scripts run ``--help`` in one process of their own, one after the
other as ``__main__``: the imports they share (torch above all) load once,
where a process per script spent about 30 s of the default run on them. That
process is forked from the test fork server (tests/zygote.py), which has
imported torch already.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .swarm import run_forked

ROOT = Path(__file__).resolve().parent.parent
HELPERS = ("harness", "lying_member", "model_parallel_ranks")  # modules the scripts run or import, not experiments
SCRIPTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if p.stem not in HELPERS)


def test_the_scripts_are_all_here() -> None:
    assert set(SCRIPTS) >= {"churn", "compression", "exchange", "fidelity", "parity", "staleness", "stragglers", "topologies"}


#: Runs each script named in argv with --help as __main__; prints {name: [exit status or error, output]} as JSON.
HELP_EACH = """
import contextlib, io, json, runpy, sys, traceback
names, shown = sys.argv[1:], {}
for name in names:
    buf = io.StringIO()
    sys.argv = [f"experiments/{name}.py", "--help"]
    status = 0
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            runpy.run_path(f"experiments/{name}.py", run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else str(e.code))
    except BaseException:
        status = traceback.format_exc()
    shown[name] = [status, buf.getvalue()]
print(json.dumps(shown))
"""


@pytest.fixture(scope="module")
def helps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("helps")
    script = work / "help_each.py"
    script.write_text(HELP_EACH)
    result = run_forked(SCRIPTS, 300, "every experiment script --help", work, module=str(script))
    assert result.returncode == 0, result.stdout + result.stderr
    shown: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return shown


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_experiment_script_imports_and_shows_its_help(name: str, helps: dict[str, Any]) -> None:
    status, output = helps[name]
    assert status == 0, output if status in (1, 2) else status
    assert "--quick" in output and "--out" in output
