"""One lifecycle for every long-lived component.

A ``Service`` is started once, closed once (both idempotent), usable as
``async with``, and owns its background tasks in an ``asyncio.TaskGroup``:
nothing is fire-and-forget. If a background task fails, the group cancels
its siblings, the service is marked failed, and ``wait_closed()`` re-raises,
so an error never disappears silently into a log line.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Any, Coroutine, Self

log = logging.getLogger(__name__)


class Status(enum.Enum):
    CREATED = "created"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"


class Service:
    """Base class: override ``_start`` (set up, spawn tasks) and ``_close`` (release)."""

    def __init__(self) -> None:
        self.status = Status.CREATED
        self._group: asyncio.TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._closed = asyncio.Event()
        self._error: BaseException | None = None
        self._failure_close: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, timeout: float | None = None) -> Self:
        """Start the service (no-op if already running). Fails if it does not start in time."""
        async with self._lock:
            if self.status is Status.RUNNING:
                return self
            if self.status is not Status.CREATED:
                raise RuntimeError(f"{type(self).__name__} cannot start: it is {self.status.value}")
            self.status = Status.STARTING
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._runner = asyncio.create_task(self._run(ready), name=f"{type(self).__name__}.run")
            try:
                await asyncio.wait_for(asyncio.shield(ready), timeout)
                await self._start()
            except BaseException:
                await self._shutdown()
                raise
            self.status = Status.RUNNING
            return self

    async def close(self, reason: str = "") -> None:
        """Stop background tasks and release resources. Safe to call more than once."""
        async with self._lock:
            if self.status in (Status.CLOSED, Status.FAILED, Status.CLOSING):
                return
            if reason:
                log.debug("closing %s: %s", type(self).__name__, reason)
            self.status = Status.CLOSING
            await self._shutdown()

    @property
    def error(self) -> BaseException | None:
        """The error that failed a background task, once the service has failed."""
        return self._error

    async def wait_closed(self) -> None:
        """Wait until the service is closed; re-raise the error that failed it, if any."""
        await self._closed.wait()
        if self._error is not None:
            raise self._error

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close("context exit")

    # -- for subclasses --------------------------------------------------------------------

    async def _start(self) -> None:
        """Set up resources and spawn background tasks. Runs inside ``start``."""

    async def _close(self) -> None:
        """Release resources. Runs after background tasks are cancelled."""

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a background task owned by this service."""
        if self._group is None:
            coro.close()
            raise RuntimeError(f"{type(self).__name__} is not running; cannot spawn {name}")
        return self._group.create_task(coro, name=f"{type(self).__name__}.{name}")

    # -- internals -------------------------------------------------------------------------

    async def _run(self, ready: asyncio.Future[None]) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                ready.set_result(None)
                await asyncio.Event().wait()  # until cancelled by close()
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # a background task failed
            self._error = e
            log.error("%s failed: %r", type(self).__name__, e)
            # close() cancels nothing more here (the group is done); it releases resources.
            self._failure_close = asyncio.get_running_loop().create_task(self.close("background task failed"))
        finally:
            self._group = None

    async def _shutdown(self) -> None:
        runner = self._runner
        if runner is not None and not runner.done():
            runner.cancel()
            try:
                await runner
            except asyncio.CancelledError:
                pass
        try:
            await self._close()
        finally:
            self.status = Status.FAILED if self._error else Status.CLOSED
            self._closed.set()
