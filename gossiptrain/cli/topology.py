"""`gossiptrain topology`: look at a topology before training on it.

    gossiptrain topology erdos-renyi:p=0.3,seed=1 --peers 16 [--round R] [--json] [--png FILE]

prints the numbers that predict how fast gossip mixes on it (degree,
diameter, spectral gap) and can draw it. The spec is the same one-string
form that `--topology` and the config file take, so what you inspect here is
exactly what a run would use. ``--peers`` is required, except for a ``file:``
topology, which knows its size. A bad spec or peer count exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import topologies
from gossiptrain.cli.common import EXIT_USAGE
from topologies.drawing import save_png


def add_parser(subparsers: Any) -> None:
    """Add the `topology` sub-command to a `parser.add_subparsers()` object."""
    p = subparsers.add_parser(
        "topology",
        help="print a topology's degree, diameter and spectral gap; optionally draw it",
        # argparse cannot say "required unless the spec is a file": the usage says it, cmd_topology enforces it.
        usage=(
            "%(prog)s [-h] NAME[:PARAMS] --peers N [--round R] [--json] [--png FILE]\n"
            "       %(prog)s [-h] file:path=FILE [--peers N] [--round R] [--json] [--png FILE]"
        ),
        description=(
            "Describe the graph a topology spec gives on N peers. Specs: NAME or "
            "NAME:param=value,...; names: " + ", ".join(topologies.names()) + "."
        ),
    )
    p.add_argument("spec", metavar="NAME[:PARAMS]", help='e.g. ring, "erdos-renyi:p=0.3,seed=1", file:path=graph.txt')
    p.add_argument(
        "--peers",
        type=int,
        metavar="N",
        help="number of peers: required, except for file: topologies (default there: the file's)",
    )
    p.add_argument("--round", type=int, default=0, metavar="R", help="first round described and drawn (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--png", metavar="FILE", help="draw round R's graph to a PNG file (default: none)")
    p.set_defaults(func=cmd_topology)


def cmd_topology(args: argparse.Namespace) -> int:
    """Run the sub-command; 0 on success, 2 with a one-line message on a bad spec or size."""
    try:
        topology = topologies.parse(args.spec)
        peers = args.peers if args.peers is not None else topology.fixed_n
        if peers is None:
            raise ValueError(f"--peers is required for {topology.name!r} (only file: topologies know their size)")
        summary = topologies.describe(topology, peers, args.round)
        if args.png:
            summary["png"] = args.png
            summary["drawn_with"] = save_png(
                topology.adjacency(peers, args.round),
                args.png,
                directed=topology.directed,
                title=f"{topology.spec}, {peers} peers, round {args.round}",
            )
    except (ValueError, OSError) as e:
        print(f"gossiptrain topology: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(summary) if args.json else _text(summary))
    return 0


def _text(s: dict[str, Any]) -> str:
    diameter = "disconnected" if s["diameter"] is None else str(s["diameter"])
    if s["time_varying"]:
        scope = f" (union of {s['period']} rounds from round {s['round']})" if s["period"] > 1 else f" (round {s['round']})"
    else:
        scope = ""
    lines = [
        f"topology      {s['spec']}",
        f"peers         {s['peers']}",
        f"degree        {s['degree']:.3g} mean, {s['max_degree']} max (out-degree per round)",
        f"diameter      {diameter}{scope}",
        f"spectral gap  {s['spectral_gap']:.6f} ({s['weights']} weights"
        + (f", product over {s['period']} rounds)" if s["period"] > 1 else ")"),
        f"directed      {'yes' if s['directed'] else 'no'}",
        f"time-varying  {'yes, period ' + str(s['period']) if s['time_varying'] else 'no'}",
    ]
    if "png" in s:
        lines.append(f"drawn to      {s['png']} ({s['drawn_with']})")
    return "\n".join(lines)
