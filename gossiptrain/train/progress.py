"""Live progress for people: one rewritten status line on a terminal, sparse log lines elsewhere."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Shows the latest status; on a non-terminal stream prints at most every ``plain_every`` seconds."""

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True, plain_every: float = 10.0) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self.plain_every = plain_every
        self._last_plain = -float("inf")
        self._width = 0

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        if self.live:
            pad = " " * max(0, self._width - len(text))
            self.stream.write("\r" + text + pad)
            self.stream.flush()
            self._width = len(text)
        elif time.monotonic() - self._last_plain >= self.plain_every:
            self._last_plain = time.monotonic()
            self.stream.write(text + "\n")
            self.stream.flush()

    def finish(self, text: str = "") -> None:
        """End the live line (so later output starts on a fresh line) and print ``text``."""
        if not self.enabled:
            return
        if self.live and self._width:
            self.stream.write("\n")
        if text:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._width = 0
