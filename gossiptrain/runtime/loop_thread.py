"""An asyncio event loop in a background thread, for code that trains synchronously.

A training loop is ordinary blocking Python; the network side is asyncio.
``LoopThread`` runs the loop (uvloop when installed) in a daemon thread and
lets the training thread submit coroutines and callbacks to it, so that
heartbeats and gossip keep flowing while the trainer computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where available (faster socket polling), else the default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """Owns one event loop running in one thread; ``stop()`` ends both."""

    def __init__(self, name: str = "gossiptrain-loop") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = threading.Event()

    def start(self) -> "LoopThread":
        self._thread.start()
        self._started.wait()
        return self

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result from this (another) thread."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{getattr(coro, '__name__', 'operation')} did not finish in {timeout} s") from None
        except BaseException:
            future.cancel()
            raise

    def call(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """Run the plain function ``fn(*args)`` on the loop and wait for its result (what touches the loop's objects)."""

        async def on_loop() -> T:
            return fn(*args)

        on_loop.__name__ = getattr(fn, "__name__", "call")
        return self.run(on_loop(), timeout)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the loop without waiting (thread-safe)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
