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
