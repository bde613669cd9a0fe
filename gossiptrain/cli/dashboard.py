"""`gossiptrain dashboard`: a live page of a running swarm for people who would rather look than read.

    gossiptrain dashboard --join 127.0.0.1:7070          # then open http://127.0.0.1:8080/

The members table, the mean and per-member accuracy and loss against time,
the bytes the swarm sends, and the topology as a graph, refreshed every few
seconds; a member that went quiet shows in red. Fed by the same polls as
``gossiptrain status`` (``gossiptrain.runtime.dashboard``). Serves
127.0.0.1:8080 unless ``--listen`` says otherwise; runs until Ctrl+C, or
exits with one line once it cannot poll at all (status 2 for bad input: a
``--join`` host that does not resolve, an ``--advertise`` host not of this
machine).
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any, Callable

from gossiptrain.cli.common import EXIT_FAILED, check_join, setup_logging
from gossiptrain.cli.status import positive_seconds
from gossiptrain.errors import ConfigError
from gossiptrain.net.addressing import parse_listen


def add_parser(
    sub: Any, add_security: Callable[[argparse.ArgumentParser, bool], None], security: Callable[[argparse.Namespace], Any]
) -> None:
    """Add the `dashboard` sub-command; the security flags and their parsing are the CLI's own."""
    p = sub.add_parser("dashboard", help="serve a live web page of a running swarm: members, curves, topology")
    p.add_argument("--join", required=True, metavar="HOST:PORT", help="the coordinator or any live peer")
    p.add_argument("--listen", default="127.0.0.1:8080", metavar="[HOST:]PORT",
                   help="where to serve the page (default 127.0.0.1:8080; port 0: any free one)")
    p.add_argument("--advertise", metavar="HOST", help="host the members reach us at (default: our address on the route to --join)")
    p.add_argument("--every", type=positive_seconds, default=2.0, metavar="SECONDS", help="poll the swarm this often (default 2)")
    add_security(p, True)
    p.set_defaults(func=lambda args: cmd_dashboard(args, security(args)))


def cmd_dashboard(args: argparse.Namespace, security: Any, ready: Callable[[str], None] | None = None,
                  stop: threading.Event | None = None) -> int:
    check_join(args.join)  # before anything heavy is imported
    """Serve until Ctrl+C (or ``stop``, for tests); ``ready(url)`` is told where the page is."""
    from gossiptrain.runtime.dashboard import Dashboard

    setup_logging(args.verbose)
    host, port = parse_listen(args.listen, "--listen")
    try:
        dashboard = Dashboard(args.join, host=host, port=port, every=args.every, advertise=args.advertise, security=security)
    except OSError as e:
        raise ConfigError(f"--listen {args.listen}: cannot serve there: {e.strerror or e}") from None
    with dashboard:
        print(f"dashboard of the swarm at {args.join}: {dashboard.url} (Ctrl+C to stop)", flush=True)
        if ready is not None:
            ready(dashboard.url)
        stop = stop or threading.Event()
        try:
            while not stop.wait(0.5) and dashboard.failure is None:
                pass
        except KeyboardInterrupt:
            pass
    if isinstance(dashboard.failure, ConfigError):  # e.g. an --advertise host not of this machine: bad input, exit 2
        raise dashboard.failure
    if dashboard.failure is not None:
        print(f"gossiptrain dashboard: error: {dashboard.error}", file=sys.stderr)
        return EXIT_FAILED
    if dashboard.polls and dashboard.latest is None:
        print(f"gossiptrain dashboard: error: {dashboard.error}", file=sys.stderr)
        return EXIT_FAILED
    return 0
