"""What every subcommand shares: exit codes and logging set-up.

Exit codes are part of the command's interface (scripts test them):
0 done, 1 failed, 2 bad usage or configuration (the message says what to
fix), 130 interrupted by Ctrl+C (also when a training peer then leaves
gracefully and writes its summary; SIGTERM stops it with 0).
"""

from __future__ import annotations

import logging
import sys

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def setup_logging(verbosity: int, default: int = logging.WARNING) -> None:
    """Log to stderr: ``default`` level, INFO with -v, DEBUG with -vv."""
    level = {0: default, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
