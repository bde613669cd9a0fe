"""The virtual-time event loop: asyncio code runs unchanged, time only jumps."""

from __future__ import annotations

import asyncio

import pytest

from gossiptrain.sim.vtime import LoopClock, SimulationStalled, run_virtual


def test_sleeping_takes_virtual_time_only() -> None:
    async def main() -> float:
        clock = LoopClock()
        start = clock.now()
        await asyncio.sleep(3600)
        return clock.now() - start

    # An hour of virtual time; were it real, the per-test timeout would fail this test.
    assert run_virtual(main()) == pytest.approx(3600)


def test_timers_fire_in_order_and_timeouts_work() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        seen: list[tuple[str, float]] = []

        async def after(name: str, delay: float) -> None:
            await asyncio.sleep(delay)
            seen.append((name, loop.time()))

        await asyncio.gather(after("c", 3.0), after("a", 1.0), after("b", 2.0), after("a2", 1.0))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), timeout=5.0)
        seen.append(("timeout", loop.time()))
        return seen

    assert run_virtual(main()) == [("a", 1.0), ("a2", 1.0), ("b", 2.0), ("c", 3.0), ("timeout", 8.0)]


def test_a_deadlock_is_reported_not_hung() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(SimulationStalled):
        run_virtual(main())


def test_many_tiny_steps_accumulate_exactly_enough() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        for _ in range(10_000):
            await asyncio.sleep(0.001)
        return loop.time()

    assert run_virtual(main()) == pytest.approx(10.0, rel=1e-9)


def _runs_after_some_virtual_time(arm: object) -> bool:
    """Whether the event ``arm(loop, event)`` arranges to be set gets set while virtual time passes."""

    async def main() -> bool:
        done = asyncio.Event()
        arm(asyncio.get_running_loop(), done)  # type: ignore[operator]
        for _ in range(1000):  # each sleep is a loop iteration at least
            if done.is_set():
                return True
            await asyncio.sleep(0.01)
        return False

    return run_virtual(main())


def test_a_thread_safe_call_gets_through_though_the_loop_polls_only_when_written_to() -> None:
    import threading

    def arm(loop: asyncio.AbstractEventLoop, done: asyncio.Event) -> None:
        thread = threading.Thread(target=lambda: loop.call_soon_threadsafe(done.set))
        thread.start()
        thread.join()

    assert _runs_after_some_virtual_time(arm)


def test_a_loop_signal_handler_runs_though_the_loop_polls_only_when_written_to() -> None:
    import os
    import signal

    def arm(loop: asyncio.AbstractEventLoop, done: asyncio.Event) -> None:
        def handled() -> None:
            loop.remove_signal_handler(signal.SIGUSR1)
            done.set()

        loop.add_signal_handler(signal.SIGUSR1, handled)
        os.kill(os.getpid(), signal.SIGUSR1)

    assert _runs_after_some_virtual_time(arm)


def test_the_loop_clock_follows_a_new_loop() -> None:
    clock = LoopClock()

    async def now() -> float:
        return clock.now()

    assert run_virtual(now(), start=5.0) == 5.0
    assert run_virtual(now(), start=9.0) == 9.0  # the first loop is closed: the clock reads the running one
