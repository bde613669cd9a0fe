"""The Makefile's setup rule, run for real by `make` against a stand-in Python (no venv, no pip, no network)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .swarm import ROOT

# Stands in for python3: `-m venv DIR` makes DIR/bin/python, which logs each pip run's start and end (with a pause
# between them, so two runs at once would overlap in the log).
FAKE_PYTHON = """#!/bin/sh
log="$(dirname "$0")/calls.log"
if [ "$1" = -m ] && [ "$2" = venv ]; then
    echo "venv $$" >> "$log"
    mkdir -p "$3/bin"
    cp "$0" "$3/bin/python"
    ln -sf "$log" "$3/bin/calls.log"
    exit 0
fi
echo "start $$ $*" >> "$log"
sleep 0.5
echo "end $$" >> "$log"
"""


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("flock") is None, reason="needs make and flock")
def test_two_makes_at_once_in_a_fresh_clone_set_up_once(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, clone / name)
    fake = clone / "fakepython"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    makes = [subprocess.Popen(["make", "-C", str(clone), "setup", f"PYTHON={fake}"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for _ in range(2)]
    try:
        outputs = [m.communicate(timeout=60)[0] for m in makes]
    finally:
        for m in makes:
            m.kill()
    assert [m.returncode for m in makes] == [0, 0], outputs
    calls = (clone / "calls.log").read_text().split("\n")[:-1]
    # One venv, then the two pip runs one after the other: before the lock, both makes ran all three at once.
    assert [c.split()[0] for c in calls] == ["venv", "start", "end", "start", "end"], calls
    assert "torch==2.13.0" in calls[1] and "-e .[dev," in calls[3], calls
    assert (clone / ".venv" / ".installed-stamp").exists()
