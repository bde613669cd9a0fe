"""`gossiptrain status`: every live member of a running swarm in one table, from any member's view.

    gossiptrain status --join 127.0.0.1:7070
    gossiptrain status --join 127.0.0.1:7070 --watch 2
    gossiptrain status --join 127.0.0.1:7070 --json

A read-only visitor, as ``export`` is: it asks the member at ``--join`` who
is alive, then each member how it is doing (``gossiptrain.runtime.swarm_status``),
and never joins. Open swarms answer anyone who can reach them; secure ones
(``--secure``) only keys in their allow-list. The last line says the
swarm's totals and who lags; ``--watch`` redraws every SECONDS until Ctrl+C,
``--json`` prints one object per poll instead of the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any, Callable

from gossiptrain.cli.common import EXIT_FAILED, check_join, setup_logging
from gossiptrain.errors import ConfigError, GossipError
from gossiptrain.net.addressing import plain_address
from gossiptrain.runtime.loop_thread import new_event_loop

_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen: --watch on a terminal redraws in place


def add_parser(
    sub: Any, add_security: Callable[[argparse.ArgumentParser, bool], None], security: Callable[[argparse.Namespace], Any]
) -> None:
    """Add the `status` sub-command; the security flags and their parsing are the CLI's own."""
    p = sub.add_parser("status", help="a table of every live member of a running swarm: steps, accuracy, traffic, who lags")
    p.add_argument("--join", required=True, metavar="HOST:PORT", help="the coordinator or any live peer")
    p.add_argument("--advertise", metavar="HOST", help="host the members reach us at (default: our address on the route to --join)")
    p.add_argument("--watch", type=positive_seconds, metavar="SECONDS", help="redraw every SECONDS until Ctrl+C (default: once)")
    p.add_argument("--json", action="store_true", help="one JSON object per poll instead of the table")
    p.add_argument("--timeout", type=positive_seconds, default=2.0, metavar="SECONDS",
                   help="wait this long for each answer, twice at most (default 2)")
    add_security(p, True)
    p.set_defaults(func=lambda args: cmd_status(args, security(args)))


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def cmd_status(args: argparse.Namespace, security: Any) -> int:
    check_join(args.join)  # before anything heavy is imported
    from gossiptrain.runtime.swarm_client import SwarmClient
    from gossiptrain.runtime.swarm_status import StatusBoard

    setup_logging(args.verbose)
    redraw = args.watch is not None and not args.json and sys.stdout.isatty()

    async def main() -> int:
        async with SwarmClient(args.join, advertise=args.advertise, security=security) as client:
            board = StatusBoard(client, timeout=args.timeout)
            while True:
                status = await board.poll()
                if args.json:
                    print(json.dumps(status.to_dict()), flush=True)
                else:
                    print((_CLEAR if redraw else "") + render(status.to_dict()), flush=True)
                if args.watch is None:
                    return 0
                await asyncio.sleep(args.watch)

    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(main())
    except KeyboardInterrupt:  # how --watch ends
        return 0
    except ConfigError:  # bad input: exit 2, as every subcommand
        raise
    except GossipError as e:
        print(f"gossiptrain status: error: {e}", file=sys.stderr)
        return EXIT_FAILED


# -- the table ----------------------------------------------------------------------------------

COLUMNS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    # header, field of a member's row, how it is shown ("-": not known)
    ("ID", "id", str),
    ("ADDRESS", "addr", lambda a: plain_address(a).removeprefix("tcp://")),
    ("SHARD", "shard", str),
    ("ROLE", "role", str),  # relay (peer --relay), client (behind NAT), - (neither)
    ("STATE", "state", str),
    ("STEP", "step", str),
    ("SAMPLES", "samples", str),
    ("LOSS", "loss", lambda v: f"{v:.3f}"),
    ("ACC", "test_acc", lambda v: f"{v:.3f}"),
    ("EX/S", "exchanges_per_s", lambda v: f"{v:.1f}"),
    ("MB OUT", "bytes_sent", lambda v: f"{v / 1e6:.1f}"),
    ("MB IN", "bytes_received", lambda v: f"{v / 1e6:.1f}"),
    ("STALE", "staleness_mean", lambda v: f"{v:.1f}"),
    ("RTT MS", "rtt_ms", lambda v: f"{v:.1f}"),
    ("IDLE S", "idle_s", lambda v: f"{v:.1f}"),
    ("OFF", "backed_off", str),  # added methods the stability guard turned off (0: the defaults all run)
    ("NAN", "restores", str),  # times the model went non-finite and was restored
    ("EPOCH", "lease_epoch", str),  # leased data: the swarm's epoch as the member sees it (-: a fixed shard)
    ("HEARD", "heard_s_ago", lambda v: f"{v:.0f}s ago"),
)
_LEFT_ALIGNED = {"ID", "ADDRESS", "ROLE", "STATE"}


def render(status: dict[str, Any]) -> str:
    """The table of a ``SwarmStatus.to_dict()``, its totals and the spread of steps, as lines of text."""
    rows = [[("-" if m.get(key) is None else show(m[key])) for _, key, show in COLUMNS] for m in status["members"]]
    headers = [h for h, _, _ in COLUMNS]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if h in _LEFT_ALIGNED else c.rjust(w) for c, w, h in zip(cells, widths, headers)).rstrip()

    t, s = status["totals"], status["steps"]
    acc = "-" if t["mean_test_acc"] is None else f"{t['mean_test_acc']:.3f}"
    out = [
        f"run {status['run']} as {status['answered_by']} sees it" + (" (stopping)" if status["stopping"] else ""),
        line(headers),
        *(line(r) for r in rows),
        f"{t['members']} members, {t['answered']} answered | {t['steps']} steps, {t['samples']} samples | "
        f"mean acc {acc} | {t['exchanges_per_s']:.1f} ex/s | {t['mb_sent']:.1f} MB out, {t['mb_received']:.1f} MB in",
    ]
    if s["median"] is not None:
        lag = f"; lagging: {', '.join(s['lagging'])}" if s["lagging"] else "; nobody lags"
        out.append(f"steps: min {s['min']}, median {s['median']:g}, max {s['max']}{lag}")
    return "\n".join(out)
