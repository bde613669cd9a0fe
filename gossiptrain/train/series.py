"""Per-peer time series from what runs leave behind, for `gossiptrain plot` (no plotting here).

Two sources, told apart by their content, not their names:

- a peer's metrics file (``--metrics``, JSON lines): its ``eval`` and
  ``done`` records; time is wall-clock seconds since the earliest ``start``
  record among all files given, so peers started apart line up;
- a simulator's ``--out`` file (``.csv`` or ``.jsonl``): one row per peer per
  sample with ``time`` (virtual seconds) and ``peer``.

Counters (exchanges, bytes) are cumulative in both; rates are their
differences over time. A peer that restarts (``--resume`` appending to the
same metrics file, a simulated peer back from a crash) counts from 0 again:
its series is cut into segments there, at a ``start`` record, a new
incarnation in the simulator's rows, or any counter that goes down, and
neither a rate nor a line spans the cut. Anything that is neither source
is a ConfigError naming the file, so a typo never gives an empty picture.
"""

from __future__ import annotations

import bisect
import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from gossiptrain.errors import ConfigError

#: Columns read from either source; missing ones stay empty (older files, the other source).
FIELDS = ("test_acc", "loss", "test_loss", "exchanges", "bytes_sent", "bytes_received", "members", "staleness_mean")
#: The cumulative ones: within a segment they never go down.
COUNTERS = ("exchanges", "bytes_sent", "bytes_received")


@dataclass
class PeerSeries:
    """One peer's samples: ``time`` in seconds from the run's start, and each field's value at that time."""

    name: str
    time: list[float] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=lambda: {f: [] for f in FIELDS})
    staleness_hist: dict[str, int] = field(default_factory=dict)  # the last record's (peers' metrics files only)
    breaks: list[int] = field(default_factory=list)  # indices of the samples that begin a new segment (a restart)

    def add(self, t: float, record: dict[str, Any], restart: bool = False) -> None:
        """Append a sample; ``restart``, or a counter lower than this segment's last, begins a new segment."""
        values = {f: _number(record.get(f)) for f in FIELDS}
        if self.time and (restart or any(values[c] < self._last(c) for c in COUNTERS)):
            self.breaks.append(len(self.time))
        self.time.append(t)
        for f in FIELDS:
            self.values[f].append(values[f])

    def _last(self, key: str) -> float:
        """``key``'s last finite value in the current segment (NaN: none), which a counter never goes below."""
        start = self.breaks[-1] if self.breaks else 0
        return next((v for v in reversed(self.values[key][start:]) if math.isfinite(v)), math.nan)

    def line(self, key: str) -> tuple[list[float], list[float]]:
        """(times, values) of ``key``, a NaN between segments: a plotted line breaks there."""
        out_t, out_v = [], []
        for i, (t, v) in enumerate(zip(self.time, self.values[key])):
            if i in self.breaks:
                out_t.append(t)
                out_v.append(math.nan)
            out_t.append(t)
            out_v.append(v)
        return out_t, out_v

    def rate(self, counter: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
        """(times, d counter / dt * scale) between consecutive samples of a segment: exchanges/s, MB/s.

        A segment's first sample gives a NaN: no rate across a restart, and a plotted line breaks there.
        """
        ts, vs = self.time, self.values[counter]
        out_t, out_v = [], []
        for i in range(1, len(ts)):
            dt = ts[i] - ts[i - 1]
            if i in self.breaks:
                out_t.append(ts[i])
                out_v.append(math.nan)
            elif dt > 0 and math.isfinite(vs[i]) and math.isfinite(vs[i - 1]):
                out_t.append(ts[i])
                out_v.append((vs[i] - vs[i - 1]) / dt * scale)
        return out_t, out_v


def _number(v: Any) -> float:
    if isinstance(v, bool) or v is None or v == "":
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def load(paths: Iterable[str | Path]) -> tuple[list[PeerSeries], str]:
    """The peers' series in ``paths`` and their clock ("wall" or "virtual"); ConfigError for what cannot be read."""
    peer_files: list[tuple[Path, list[dict[str, Any]]]] = []
    series: list[PeerSeries] = []
    for p in map(Path, paths):
        rows = _read(p)
        if rows and "peer" in rows[0] and "time" in rows[0] and "event" not in rows[0]:
            series.extend(_simulated(p, rows))
        elif any(r.get("event") in ("eval", "done") for r in rows):
            peer_files.append((p, rows))
        else:
            raise ConfigError(f"{p}: neither a peer's metrics file (no eval records) nor a simulator's --out file")
    if peer_files and series:
        raise ConfigError("give either peers' metrics files or simulator output, not both: their clocks differ")
    if series:
        return series, "virtual"
    starts = [r["time"] for _, rows in peer_files for r in rows if r.get("event") == "start" and _finite(r.get("time"))]
    evals = [r["time"] for _, rows in peer_files for r in rows if r.get("event") in ("eval", "done") and _finite(r.get("time"))]
    if not evals:
        raise ConfigError(f"{peer_files[0][0]}: its eval records carry no time")
    origin = min(starts or evals)
    for p, rows in peer_files:
        s = PeerSeries(str(rows[0].get("peer") or p.stem))
        restarted = False  # a start record after samples: the file goes on across a restart (--resume)
        for r in rows:
            restarted = restarted or (r.get("event") == "start" and bool(s.time))
            if r.get("event") in ("eval", "done") and _finite(r.get("time")):
                s.add(float(r["time"]) - origin, r, restart=restarted)
                restarted = False
                if isinstance(r.get("staleness_hist"), dict):
                    s.staleness_hist = {str(k): int(v) for k, v in r["staleness_hist"].items() if isinstance(v, int)}
        series.append(s)
    return series, "wall"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read(p: Path) -> list[dict[str, Any]]:
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot be read: {e.strerror or e}") from None
    if p.suffix == ".csv":
        return list(csv.DictReader(text.splitlines()))
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{lineno}: not a JSON line ({e.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{p}:{lineno}: not a JSON object")
        rows.append(row)
    return rows


def _simulated(p: Path, rows: list[dict[str, Any]]) -> list[PeerSeries]:
    by_peer: dict[str, PeerSeries] = {}
    incarnation: dict[str, tuple[Any, Any]] = {}  # per peer slot: the (id, generation) of its last row
    for r in rows:
        t = _number(r.get("time"))
        if not math.isfinite(t):
            raise ConfigError(f"{p}: a row without a numeric time: {str(r)[:80]}")
        name = f"peer {r.get('peer')}"
        now = (r.get("id"), r.get("generation"))
        restart = name in incarnation and incarnation[name] != now  # back from a crash: a new incarnation
        incarnation[name] = now
        by_peer.setdefault(name, PeerSeries(name)).add(t, r, restart=restart)
    return list(by_peer.values())


def mean_over_peers(series: list[PeerSeries], key: str, grid: int = 200) -> tuple[list[float], list[float]]:
    """The mean of ``key`` over the peers, each at its latest value, on ``grid`` even steps of time.

    It starts once every peer with a value has reported one: a mean over the first peers alone jumps
    as the others come in.
    """
    end = max((s.time[-1] for s in series if s.time), default=0.0)
    if end <= 0:
        return [], []
    known = []  # per peer: (times, values) of its finite samples
    for s in series:
        pairs = [(t, v) for t, v in zip(s.time, s.values[key]) if math.isfinite(v)]
        if pairs:
            known.append(([t for t, _ in pairs], [v for _, v in pairs]))
    everyone = max((ts[0] for ts, _ in known), default=end)
    out_t, out_v = [], []
    for i in range(grid):
        t = end * (i + 1) / grid
        vals = [vs[k - 1] for ts, vs in known if (k := bisect.bisect_right(ts, t)) > 0]
        if vals and t >= everyone:
            out_t.append(t)
            out_v.append(sum(vals) / len(vals))
    return out_t, out_v
