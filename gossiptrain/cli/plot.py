"""`gossiptrain plot`: curves of a run, from the peers' metrics files or a simulator's output.

    gossiptrain plot run/peer-*.jsonl --out run.png
    gossiptrain plot series.csv --out sim.png

Six panels: test accuracy and loss against time (each peer thin, their mean
thick), exchanges per second and MB sent per second per peer, members in
each peer's view, and the staleness of merged updates (the histogram of the
last records where peers wrote one, the mean over time from a simulator).
Needs matplotlib (`pip install 'gossiptrain[plot]'`); without it, or on a
file it cannot read, it exits 2 with one line and writes nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from gossiptrain.cli.common import EXIT_USAGE
from gossiptrain.errors import ConfigError
from gossiptrain.protocol.staleness import bucket_bounds
from gossiptrain.train.series import PeerSeries, load, mean_over_peers


def add_parser(subparsers: Any) -> None:
    """Add the `plot` sub-command to a `parser.add_subparsers()` object."""
    p = subparsers.add_parser(
        "plot",
        help="accuracy, loss, exchanges, bytes, members and staleness over time, from metrics files or simulator output",
        description=__doc__.split("\n\n")[2].replace("\n", " ") if __doc__ else None,
    )
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="peers' --metrics files (JSON lines), or one simulator --out file (.csv or .jsonl)")
    p.add_argument("--out", required=True, metavar="PNG", help="the picture to write")
    p.add_argument("--title", help="a title above the panels (default: the files' folder)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.suffix.lower() != ".png":
        return _fail(f"--out {out}: name a .png file")
    if not out.parent.is_dir():
        return _fail(f"--out {out}: folder {out.parent} does not exist")
    try:
        series, clock = load(args.files)
    except ConfigError as e:
        return _fail(str(e))
    try:
        fig = figure(series, clock, args.title or default_title(series, args.files))
    except ImportError:
        return _fail("needs matplotlib: pip install 'gossiptrain[plot]'")
    fig.savefig(out, format="png", dpi=80)
    print(f"wrote {out} ({len(series)} peers, {clock} time)")
    return 0


def figure(series: list[PeerSeries], clock: str, title: str) -> Any:
    """The six panels as a matplotlib Figure (ImportError without matplotlib)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # type: ignore[import-not-found, unused-ignore]
    from matplotlib.figure import Figure  # type: ignore[import-not-found, unused-ignore]

    fig = Figure(figsize=(12, 10), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 2)
    xlabel = "virtual time (s)" if clock == "virtual" else "time (s)"
    _curves(axes[0][0], series, "test_acc", "test accuracy", xlabel)
    _curves(axes[0][1], series, "loss" if _has(series, "loss") else "test_loss", "loss", xlabel)
    _rates(axes[1][0], series, "exchanges", 1.0, "exchanges / s", xlabel)
    _rates(axes[1][1], series, "bytes_sent", 1e-6, "MB sent / s", xlabel)
    _curves(axes[2][0], series, "members", "members in view", xlabel, mean=False)
    _staleness(axes[2][1], series, xlabel)
    fig.suptitle(title)
    return fig


def _fail(message: str) -> int:
    print(f"gossiptrain plot: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def default_title(series: list[PeerSeries], files: list[str]) -> str:
    """'N peers, FOLDER': the first file's folder as given, or by its name where the file was given bare (not '.')."""
    path = Path(files[0])
    folder = str(path.parent) if path.parent != Path(".") else path.absolute().parent.name or "/"
    return f"{len(series)} peers, {folder}"


def _has(series: list[PeerSeries], key: str) -> bool:
    return any(math.isfinite(v) for s in series for v in s.values[key])


def _curves(ax: Any, series: list[PeerSeries], key: str, label: str, xlabel: str, *, mean: bool = True) -> None:
    for s in series:
        ax.plot(*s.line(key), linewidth=0.8, alpha=0.5 if mean else 0.9, label=None if mean else s.name)
    if mean and len(series) > 1:
        t, v = mean_over_peers(series, key)
        ax.plot(t, v, color="black", linewidth=2.0, label=f"mean of {len(series)} peers")
        ax.legend(loc="best", fontsize=8)
    _labels(ax, label, xlabel)


def _rates(ax: Any, series: list[PeerSeries], counter: str, scale: float, label: str, xlabel: str) -> None:
    for s in series:
        ax.plot(*s.rate(counter, scale), linewidth=0.8, alpha=0.7)
    _labels(ax, label, xlabel)


def _staleness(ax: Any, series: list[PeerSeries], xlabel: str) -> None:
    hist: dict[str, int] = {}
    for s in series:
        for bucket, count in s.staleness_hist.items():
            hist[bucket] = hist.get(bucket, 0) + count
    if hist:  # buckets as peers write them: "0", "1", "2-3", "4-7", ...
        buckets = sorted(hist, key=bucket_bounds)
        ax.bar(range(len(buckets)), [hist[b] for b in buckets])
        ax.set_xticks(range(len(buckets)), buckets, rotation=45, fontsize=8)
        ax.set_xlabel("staleness of merged updates (steps)")
        ax.set_ylabel("updates, all peers")
        return
    _curves(ax, series, "staleness_mean", "mean staleness (steps)", xlabel)


def _labels(ax: Any, label: str, xlabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
