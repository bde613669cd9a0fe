"""What the simulated peers log: warnings counted for the summary, shown one by one only when asked, in virtual time.

A simulated fault is meant to happen: during a scheduled partition hundreds
of exchanges time out and are given up, and rejoining peers find nobody
answering. Each is a WARNING of the real runtime (for a real peer, something
to look at), so a few dozen simulated peers turned one scheduled fault into
over a thousand lines, stamped with the wall clock. While a simulation runs,
``LogGate`` takes the records of the ``gossiptrain`` loggers: a warning is
counted by what it says (its message up to the first argument) for the
summary, and passed on one by one only where its logger lets INFO through
(``gossiptrain simulate -v``); errors always pass. A record
passed on starts with the virtual time it was logged at
(``virtual 12.345 s: ...``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

from gossiptrain.sim.vtime import VirtualTimeLoop

LOGGER = "gossiptrain"


class LogGate(logging.Handler):
    """Counts the simulated stack's warnings (``counts``: what each says -> how many) and holds them back unless verbose."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._forward = True  # the gossiptrain logger propagated before: pass records on to the root's handlers

    @contextmanager
    def installed(self) -> Iterator["LogGate"]:
        """Within the block, every record of the ``gossiptrain`` loggers goes through this gate (then as before)."""
        logger = logging.getLogger(LOGGER)
        self._forward = logger.propagate
        logger.addHandler(self)
        logger.propagate = False
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.propagate = self._forward

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.WARNING:
            self.counts[_what(record)] += 1
            if not logging.getLogger(record.name).isEnabledFor(logging.INFO):
                return  # counted for the summary; -v shows each
        now = _virtual_now()
        if now is not None and isinstance(record.msg, str):
            record.msg = f"virtual {now:.3f} s: {record.msg}"
        if self._forward:
            logging.getLogger().callHandlers(record)  # as propagation would have (Python's last resort included)


def _what(record: logging.LogRecord) -> str:
    """A warning's kind: its message up to the first argument ("gave up on the exchange with")."""
    template = record.msg if isinstance(record.msg, str) else str(record.msg)
    return template.split("%", 1)[0].strip(" :,(") or record.getMessage()[:80]


def _virtual_now() -> float | None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.time() if isinstance(loop, VirtualTimeLoop) else None
