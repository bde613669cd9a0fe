"""Time as an injectable dependency.

Protocol cores never read the clock: their drivers pass ``now`` in. Drivers
take a ``Clock`` so that the real runtime uses monotonic time and the
simulator a virtual one, with the same code above them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """Where drivers read the time (seconds, monotonic) and wait."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """Monotonic wall time; sleeping yields to the event loop."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


REAL_CLOCK = RealClock()
