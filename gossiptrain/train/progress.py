"""Live progress for people: one rewritten status line on a terminal, sparse log lines elsewhere.

Other output must not land on the live line: ``line(text)`` prints a whole
line above it (the live line is cleared, the text written, the live line
drawn again), and inside ``logs_above(...)`` the log handlers that write to
the same stream go through ``line`` too, and the records of one events
logger (a peer's membership changes, say) are printed as plain lines.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO


class Progress:
    """Shows the latest status; on a non-terminal stream prints at most every ``plain_every`` seconds."""

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True, plain_every: float = 10.0) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self.plain_every = plain_every
        self._last_plain = -float("inf")
        self._width = 0
        self._text = ""  # the live line as shown (empty: none)
        self._lock = threading.RLock()  # log lines come from the network thread, updates from the training thread

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self.live:
                pad = " " * max(0, self._width - len(text))
                self.stream.write("\r" + text + pad)
                self.stream.flush()
                self._width = len(text)
                self._text = text
            elif time.monotonic() - self._last_plain >= self.plain_every:
                self._last_plain = time.monotonic()
                self.stream.write(text + "\n")
                self.stream.flush()

    def line(self, text: str) -> None:
        """Print ``text`` as a line of its own, above the live line (which is drawn again below it)."""
        if not self.enabled:
            return
        with self._lock:
            if self.live and self._width:
                self.stream.write("\r" + " " * self._width + "\r" + text + "\n" + self._text)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def finish(self, text: str = "") -> None:
        """End the live line (so later output starts on a fresh line) and print ``text``."""
        if not self.enabled:
            return
        with self._lock:
            if self.live and self._width:
                self.stream.write("\n")
            if text:
                self.stream.write(text + "\n")
            self.stream.flush()
            self._width = 0
            self._text = ""

    @contextmanager
    def logs_above(self, events: str | None = None, accept: Callable[[logging.LogRecord], bool] = lambda r: True) -> Iterator[None]:
        """While inside: log output to our stream goes above the live line; ``events`` records become plain lines.

        On a live terminal, every ``logging.StreamHandler`` of the root logger
        that writes to our stream (and Python's last-resort handler) writes
        through ``line`` instead. With ``events`` (a logger name), that
        logger's records at INFO and above that ``accept`` takes are printed
        as their bare message, whatever the log level, and not passed on to
        the root logger's handlers (the terminal shows them once). Everything
        is put back on the way out. Disabled progress changes nothing.
        """
        if not self.enabled:
            yield
            return
        redirected: list[tuple[logging.StreamHandler, TextIO]] = []
        writer = _LineWriter(self)
        last_resort = logging.lastResort
        if self.live:
            for h in logging.getLogger().handlers:
                if type(h) is logging.StreamHandler and _same_stream(h.stream, self.stream):
                    redirected.append((h, h.stream))
                    h.setStream(writer)  # type: ignore[arg-type]
            if last_resort is not None and _same_stream(sys.stderr, self.stream):
                replacement = logging.StreamHandler(writer)  # type: ignore[arg-type]
                replacement.setLevel(last_resort.level)
                logging.lastResort = replacement
        handler = _EventLines(self, accept) if events is not None else None
        if handler is not None:
            _attach_events(events or "", handler)
        try:
            yield
        finally:
            if handler is not None:
                _detach_events(events or "", handler)
            if self.live and logging.lastResort is not last_resort:
                logging.lastResort = last_resort
            for h, stream in redirected:
                if h.stream is writer:
                    h.setStream(stream)
            writer.close()


class _LineWriter:
    """A file-like object for log handlers: each complete line goes to ``Progress.line``."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
        for line in lines:
            self._progress.line(line)
        return len(text)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        with self._lock:
            rest, self._partial = self._partial, ""
        if rest:
            self._progress.line(rest)

    def isatty(self) -> bool:
        return self._progress.live


class _EventLines(logging.Handler):
    """Prints the messages of one events logger as lines above the live line."""

    def __init__(self, progress: Progress, accept: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__(logging.INFO)
        self._progress = progress
        self._accept = accept

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self._accept(record):
                self._progress.line(record.getMessage())
        except Exception:
            self.handleError(record)


_events_lock = threading.Lock()
_events_saved: dict[str, tuple[int, bool, int]] = {}  # logger name -> (level, propagate, handlers attached by us)


def _attach_events(name: str, handler: logging.Handler) -> None:
    """Print ``name``'s INFO records through ``handler``; the logger's settings are restored by the last detach."""
    logger = logging.getLogger(name)
    with _events_lock:
        level, propagate, count = _events_saved.get(name, (logger.level, logger.propagate, 0))
        _events_saved[name] = (level, propagate, count + 1)
        if not logger.isEnabledFor(logging.INFO):
            logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(handler)


def _detach_events(name: str, handler: logging.Handler) -> None:
    logger = logging.getLogger(name)
    with _events_lock:
        logger.removeHandler(handler)
        level, propagate, count = _events_saved.pop(name, (logger.level, logger.propagate, 1))
        if count > 1:
            _events_saved[name] = (level, propagate, count - 1)
        else:
            logger.setLevel(level)
            logger.propagate = propagate


def _same_stream(a: object, b: object) -> bool:
    """The same stream object, or two objects on the same open file (sys.stderr and sys.__stderr__)."""
    if a is b:
        return True
    try:
        fa, fb = a.fileno(), b.fileno()  # type: ignore[attr-defined]
        return bool(os.path.sameopenfile(fa, fb))
    except (AttributeError, OSError, ValueError):
        return False
