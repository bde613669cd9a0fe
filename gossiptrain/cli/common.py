"""What every subcommand shares: exit codes, logging set-up, and the checks of `--join` and of paths to write.

Exit codes are part of the command's interface (scripts test them):
0 done, 1 failed, 2 bad usage or configuration (the message says what to
fix), 130 interrupted by Ctrl+C (also when a training peer then leaves
gracefully and writes its summary; SIGTERM stops it with 0).
"""

from __future__ import annotations

import logging
import sys

from gossiptrain.errors import ConfigError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def setup_logging(verbosity: int, default: int = logging.WARNING, *, wall_time: bool = True) -> None:
    """Log to stderr: ``default`` level, INFO with -v, DEBUG with -vv; ``wall_time=False``: no timestamp (the simulator's own)."""
    level = {0: default, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    stamp = "%(asctime)s " if wall_time else ""
    logging.basicConfig(level=level, format=stamp + "%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def check_join(address: str, flag: str = "--join") -> None:
    """ConfigError (exit 2, one line) for a join address that is malformed or whose host cannot be resolved.

    Every subcommand that takes ``--join`` checks it first: before a page is
    served or anything is asked, whether or not ``--advertise`` is given.
    """
    from gossiptrain.net.addressing import parse_hostport, route_address

    host, _ = parse_hostport(address, flag)
    route_address(host)  # resolves the host (no packet is sent)


def check_output_path(value: str, flag: str, *, directory: bool = False) -> None:
    """ConfigError (exit 2) if a local path to write is a directory where a file is meant, or the reverse, or lies
    under a file; before anything is downloaded or trained. A URL is left to its store."""
    from pathlib import Path

    from gossiptrain.state import storage

    target = storage.location(value, flag)
    if not isinstance(target, Path):
        return
    if not directory and target.is_dir():
        raise ConfigError(f"{flag} {value!r} is a directory: name a file, e.g. {target / 'model.safetensors'}")
    blocking = next((p for p in (target, *target.parents) if p.exists() and not p.is_dir()), None)
    if directory and blocking == target:
        raise ConfigError(f"{flag} {value!r} is a file, not a directory: name a directory (created if missing)")
    if blocking is not None and blocking != target:
        raise ConfigError(f"{flag} {value!r} cannot be created: {blocking} is a file, not a directory")
