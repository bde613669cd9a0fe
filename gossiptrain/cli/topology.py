"""`gossiptrain topology`: look at a topology before training on it.

    gossiptrain topology erdos-renyi:p=0.3,seed=1 --peers 16 [--round R] [--json] [--png FILE]

prints the numbers that predict how fast gossip mixes on it (degree,
diameter, spectral gap) and can draw it. The spec is the same one-string
form that `--topology` and the config file take, so what you inspect here is
exactly what a run would use. ``--peers`` is required, except for a ``file:``
topology, which knows its size. A bad spec or peer count exits 2 with one line.

Graphs that look the same from every member (ring, exponential, complete,
one-peer-exponential at any size; torus with full rows, hypercube and base-k
at their exact sizes) are described in closed form at any size. Others take
dense n x n matrices: their memory and time are estimated first, printed on
stderr when large, and the command refuses (exit 2) above ``--max-memory``
(default: the memory available now).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import topologies
from gossiptrain.cli import memory
from gossiptrain.cli.common import EXIT_USAGE
from gossiptrain.errors import ConfigError
from topologies.drawing import save_png


def add_parser(subparsers: Any) -> None:
    """Add the `topology` sub-command to a `parser.add_subparsers()` object."""
    p = subparsers.add_parser(
        "topology",
        help="print a topology's degree, diameter and spectral gap; optionally draw it",
        # argparse cannot say "required unless the spec is a file": the usage says it, cmd_topology enforces it.
        usage=(
            "%(prog)s [-h] NAME[:PARAMS] --peers N [--round R] [--json] [--png FILE] [--max-memory SIZE]\n"
            "       %(prog)s [-h] file:path=FILE [--peers N] [--round R] [--json] [--png FILE] [--max-memory SIZE]"
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
    p.add_argument("--max-memory", type=memory.max_memory, metavar="SIZE", help=memory.MAX_MEMORY_HELP)
    p.set_defaults(func=cmd_topology)


def cmd_topology(args: argparse.Namespace) -> int:
    """Run the sub-command; 0 on success, 2 with a one-line message on a bad spec or size."""
    try:
        topology = topologies.parse(args.spec)
        peers = args.peers if args.peers is not None else topology.fixed_n
        if peers is None:
            raise ValueError(f"--peers is required for {topology.name!r} (only file: topologies know their size)")
        _check_cost(topology, peers, args)
        summary = topologies.describe(topology, peers, args.round)
        if args.png:
            summary["png"] = args.png
            summary["drawn_with"] = save_png(
                topology.adjacency(peers, args.round),
                args.png,
                directed=topology.directed,
                title=f"{topology.spec}, {peers} peers, round {args.round}",
            )
    except (ValueError, OSError, ConfigError) as e:
        print(f"gossiptrain topology: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(summary) if args.json else _text(summary))
    return 0


def _check_cost(topology: topologies.Topology, peers: int, args: argparse.Namespace) -> None:
    """Estimate memory and time before building anything; say so on stderr when large; refuse above the limit."""
    need, seconds = topologies.describe_cost(topology, peers, args.round)
    if args.png:
        need += 4 * peers * peers  # the drawing takes the round's adjacency matrix and copies of it
    limit, default = memory.limit(args)
    dense = "" if topology.cayley(peers, args.round) is not None else " (dense n x n matrices: no closed form for it here)"
    what = f"{topology.spec} on {peers} peers{dense}{' with --png' if args.png else ''}"
    fix = "use fewer --peers" + ("" if not args.png else ", or leave out --png")
    if dense:
        fix += ("; closed forms: ring, exponential, complete, one-peer-exponential at any size, torus where "
                "ceil(sqrt(n)) divides n, hypercube at a power of 2, base-k at a power of k+1")
    memory.check(what, need, limit, default, fix)
    if seconds >= 5 or need >= 1 << 30:
        print(f"gossiptrain topology: {what}: about {memory.size(need)} and {memory.duration(seconds)} estimated",
              file=sys.stderr, flush=True)


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
        f"spectral gap  {_gap(s['spectral_gap'])} ({s['weights']} weights"
        + (f", product over {s['period']} rounds)" if s["period"] > 1 else ")"),
        f"directed      {'yes' if s['directed'] else 'no'}",
        f"time-varying  {'yes, period ' + str(s['period']) if s['time_varying'] else 'no'}",
    ]
    if "png" in s:
        lines.append(f"drawn to      {s['png']} ({s['drawn_with']})")
    return "\n".join(lines)


def _gap(gap: float) -> str:
    """Six decimals, or three significant digits where that would print 0.000000 (a ring of 100,000: 1.32e-09)."""
    return f"{gap:.6f}" if abs(gap) >= 1e-3 or gap == 0 else f"{gap:.3e}"
