"""The docs site builds in strict mode: every nav page exists, every link and anchor resolves, every snippet's file exists.

mkdocs.yml makes broken links, missing anchors, unrecognised links and pages missing from (or missing for) the
nav warnings, and strict mode fails on any warning. The build needs no network (Material's fonts are off) and
takes a few seconds. mkdocs comes with the `docs` extra, which `make test` installs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NEEDED = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "pymdownx")


def _missing() -> list[str]:
    missing = []
    for name in NEEDED:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a missing parent package of a dotted name
            found = False
        if not found:
            missing.append(name)
    return missing


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    missing = _missing()
    if missing:
        pytest.skip(
            f"the docs tools are not installed ({', '.join(missing)}): `make test` installs them "
            "(the `docs` extra: pip install -e '.[docs]')"
        )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner, printed on every build
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )
    if run.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed (make docs-build shows the same):\n{run.stdout}{run.stderr}", pytrace=False)
    for page in ("index.html", "reference/cli/index.html", "reference/config/index.html", "reference/api/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_every_file_a_page_includes_is_committed() -> None:
    """A snippet (``--8<-- "experiments/results/..."``) of a file this checkout has but git ignores builds here and
    fails on a clean clone (CI): results folders are ignored unless .gitignore lets them in."""
    try:
        tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=30,
                                     check=True).stdout.splitlines())
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): nothing to compare with")
    if not tracked:
        pytest.skip("git lists no files here (an export, not a checkout)")
    pages = [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    included = {
        line.split('"')[1].split(":")[0]
        for page in pages for line in page.read_text().splitlines() if line.startswith('--8<-- "')
    }
    assert included, "no snippets found: the pattern no longer matches how the pages include files"
    missing = sorted(path for path in included if path not in tracked)
    assert not missing, f"included by the docs but not committed (see .gitignore's results folders): {missing}"
