"""`gossiptrain dashboard`: the page is self-contained, its data bounded, and a real browser renders a real swarm.

The browser test runs Debian's ``chromium`` headless against a 3-peer loopback
swarm: the rendered DOM lists the three members, and once one is killed the
page shows it quiet (red). Its screenshot (the quiet member in red) is kept as build/test-artifacts/dashboard.png.
``.ci/run`` installs chromium where it is missing; elsewhere the test skips.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gossiptrain.protocol.status import MemberStatus
from gossiptrain.runtime.dashboard import CHARTED_MEMBERS, Dashboard, history_point
from gossiptrain.runtime.swarm_status import MemberRow, SwarmStatus, summarize

from .conftest import fast_config
from .swarm import Procs

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "build" / "test-artifacts"
CHROMIUM = shutil.which("chromium")


def test_a_history_point_is_bounded_whatever_the_swarm() -> None:
    rows = tuple(MemberRow(f"m{i:04d}", "tcp://127.0.0.1:1", i, "alive", 0.0, MemberStatus(f"m{i:04d}", "x", test_acc=0.5))
                 for i in range(1000))
    totals, steps = summarize(rows)
    point = history_point(SwarmStatus("fp", "coordinator", False, 1.0, rows, totals, steps))
    assert len(point["members"]) == CHARTED_MEMBERS and point["mean_test_acc"] == 0.5


def test_the_page_loads_nothing_from_elsewhere_and_the_data_says_why_a_poll_failed() -> None:
    with Dashboard("127.0.0.1:9", host="127.0.0.1", port=0, every=0.5, timeout=0.2) as dashboard:  # nothing listens
        page = urllib.request.urlopen(dashboard.url, timeout=10).read().decode()
        assert "<table" in page and "REFRESH_MS" not in page
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # no script, style or font from anywhere else

        def failed() -> dict[str, Any] | None:
            data = json.loads(urllib.request.urlopen(dashboard.url + "status.json", timeout=10).read())
            return data if data["error"] else None

        data = _wait(failed, 30, "a failed poll")
        assert data["status"] is None and "no answer from 127.0.0.1:9" in data["error"]
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(dashboard.url + "nothing-here", timeout=10)


def _wait(condition: Any, timeout: float, what: str) -> Any:
    from .swarm import wait_for

    return wait_for(condition, timeout, what)


def _render(url: str, tmp_path: Path, shot: Path | None = None) -> str:
    """The page's DOM after its script ran, from headless chromium; and a screenshot to ``shot`` if given."""
    assert CHROMIUM is not None
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}",
             "--virtual-time-budget=8000", "--window-size=1400,1000"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=90, check=True).stdout
    if shot is not None:
        shot.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True, timeout=90, check=True)
    return dom


def _rows(dom: str) -> dict[str, str]:
    """member id -> the class of its table row, as rendered."""
    return {m: c for c, m in re.findall(r'<tr class="([^"]*)" data-member="([^"]+)"', dom)} | {
        m: c for m, c in re.findall(r'<tr data-member="([^"]+)" class="([^"]*)"', dom)
    }


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it where missing)")
def test_a_real_browser_shows_a_three_peer_swarm_and_a_member_that_went_quiet(
    procs: Procs, coordinator_factory: Any, tmp_path: Path
) -> None:
    coord = coordinator_factory(fast_config(**{"train.shards": 3, "train.max_steps": 0, "train.max_seconds": 180,
                                                "data.mode": "leased"}))  # the data's epoch has its column too
    join = coord.address.removeprefix("tcp://")
    peers = [procs.peer(join) for _ in range(3)]
    with Dashboard(join, port=0, every=0.5, timeout=2.0) as dashboard:
        latest = procs.wait_for(
            lambda: (s := dashboard.latest) and len(s.rows) == 3 and all(r.state == "alive" and r.status and r.status.step > 0
                                                                         for r in s.rows) and s,
            90, "the dashboard to see three members training",
        )
        ids = {r.id for r in latest.rows}
        dom = _render(dashboard.url, tmp_path)
        rows = _rows(dom)
        assert set(rows) == ids  # all three listed (a poll answered late on a loaded machine may show one quiet)
        assert "<th>epoch</th>" in dom and "data epoch " in dom  # leased data: the swarm's epoch, and each member's

        victim = next(p for p in peers if p.latest() and p.latest().get("peer"))
        victim_id = victim.latest()["peer"]
        victim.signal(signal.SIGKILL)
        procs.wait_for(
            lambda: (s := dashboard.latest) and any(r.id == victim_id and r.state in ("no answer", "suspect", "gone")
                                                    for r in s.rows),
            60, "the dashboard to see the killed member go quiet",
        )
        rows = _rows(_render(dashboard.url, tmp_path, ARTIFACTS / "dashboard.png"))
        assert rows[victim_id] == "quiet" and any(rows[m] == "" for m in ids - {victim_id})  # red, beside the living
