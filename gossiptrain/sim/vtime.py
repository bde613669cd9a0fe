"""An asyncio event loop in virtual time: the simulator's clock.

The loop's ``time()`` is a number the loop advances itself. Whenever no
callback is ready, instead of sleeping until the next timer it jumps the
clock to that timer (trio's MockClock with autojump does the same). So the
unchanged asyncio code of the runtime (heartbeat loops, ``asyncio.sleep``,
``wait_for`` timeouts, ``loop.call_later`` in the sim transport) runs in
virtual time, as fast as the CPU allows and identically on every run.

Real computation (a torch step) takes wall time but no virtual time; the
simulator charges virtual time for it explicitly with ``asyncio.sleep``.
"""

from __future__ import annotations

import asyncio
import selectors
import threading
from typing import Any, Coroutine, Mapping, TypeVar

from gossiptrain.errors import GossipError

T = TypeVar("T")


class SimulationStalled(GossipError):
    """Nothing is scheduled and nothing can happen: the simulated world is deadlocked."""


class _JumpingSelector(selectors.BaseSelector):
    """Polls the real selector without blocking; a would-be wait advances virtual time instead.

    The loop still has real file descriptors (its self-pipe for thread-safe
    wake-ups); they are polled with a zero timeout so that nothing blocks.
    """

    def __init__(self, loop: "VirtualTimeLoop") -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # Polling is a system call per loop iteration: skip it while the loop's own self-pipe is all
        # there is and nothing was written to it (``call_soon_threadsafe``) since the last poll. Signals
        # handled by the loop (``add_signal_handler``) reach the pipe from C, unseen: then always poll.
        loop = self._loop
        if loop._self_woken or len(self._real.get_map()) > 1 or getattr(loop, "_signal_handlers", None):
            loop._self_woken = False
            events = self._real.select(0)
        else:
            events = []
        if events or timeout == 0:
            return events
        if timeout is None:
            raise SimulationStalled("no timer is scheduled and no task can run: the simulation would wait forever")
        self._loop.advance(timeout)
        return events

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock starts at ``start`` and only moves by jumps."""

    def __init__(self, start: float = 0.0) -> None:
        self._virtual_now = float(start)
        self._self_woken = True  # poll once at the start
        super().__init__(selector=_JumpingSelector(self))
        # asyncio runs timers due before now + resolution; with 0 a timer due exactly
        # now would wait forever, and jumps may land an ulp short of a timer.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._virtual_now

    def _write_to_self(self) -> None:
        self._self_woken = True  # before the byte, so that a poll that misses the flag still finds the byte later
        super()._write_to_self()

    def advance(self, seconds: float) -> None:
        """Move the clock forward (never backward)."""
        if seconds > 0:
            self._virtual_now += seconds


def run_virtual(main: Coroutine[Any, Any, T], *, start: float = 0.0, debug: bool = False) -> T:
    """``asyncio.run`` for virtual time: run ``main`` on a fresh ``VirtualTimeLoop``."""
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(start), debug=debug) as runner:
        return runner.run(main)


class LoopClock:
    """The ``Clock`` of whatever loop is running: virtual in the simulator, real elsewhere.

    The loop is remembered while it runs on this thread: ``asyncio.get_running_loop()``
    checks the process id, a system call, and the simulator reads the clock at every message.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0

    def now(self) -> float:
        loop = self._loop
        if loop is None or self._thread != threading.get_ident() or not loop.is_running():
            loop = self._loop = asyncio.get_running_loop()
            self._thread = threading.get_ident()
        return loop.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))
