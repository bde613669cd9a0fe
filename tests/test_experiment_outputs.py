"""A --quick smoke run writes to a scratch folder, never over the committed results the README shows."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402

SCRIPTS = sorted(p for p in (ROOT / "experiments").glob("*.py") if "--quick" in p.read_text() and p.stem != "harness")


def test_quick_without_out_gets_a_fresh_scratch_folder_outside_the_results() -> None:
    results = ROOT / "experiments" / "results"
    first = harness.results_dir("topologies", None, quick=True)
    second = harness.results_dir("topologies", None, quick=True)
    try:
        assert first != second and first.is_dir() and second.is_dir()
        assert results not in first.parents and results not in second.parents
    finally:
        shutil.rmtree(first)
        shutil.rmtree(second)


def test_out_wins_and_a_full_run_writes_the_committed_results(tmp_path: Path) -> None:
    assert harness.results_dir("churn", tmp_path, quick=True) == tmp_path
    assert harness.results_dir("churn", None, quick=False) == ROOT / "experiments" / "results" / "churn"


def test_every_experiment_with_a_quick_mode_chooses_its_folder_through_the_harness() -> None:
    assert len(SCRIPTS) >= 8
    for script in SCRIPTS:
        text = script.read_text()
        assert f'harness.results_dir("{script.stem}", args.out, args.quick)' in text, script.name
        assert not re.search(r'"--out".*default=ROOT', text), f"{script.name} still defaults --out to the results"
