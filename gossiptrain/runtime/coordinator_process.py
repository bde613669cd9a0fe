"""Running a coordinator until told to stop, from the CLI or in-process (the demo, tests)."""

from __future__ import annotations

import asyncio
import signal
from typing import Callable

from gossiptrain.config import RunConfig, SecurityConfig
from gossiptrain.net.addressing import parse_hostport, tcp_url
from gossiptrain.net.transport import listen
from gossiptrain.protocol.admission import warn_open
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.runtime.coordinator import Coordinator, coordinator_limits
from gossiptrain.runtime.loop_thread import LoopThread, new_event_loop


async def serve_coordinator(
    config: RunConfig,
    bind: str,
    stop: asyncio.Event,
    on_ready: Callable[[Coordinator], None] | None = None,
    security: SecurityConfig | None = None,
    spec: ParamSpec | None = None,
    relay: bool = True,
) -> None:
    """Listen on ``bind`` (HOST:PORT) and answer joins until ``stop`` is set; CURVE with ``security``.

    ``spec`` is the swarm's model when the caller knows it (a named workload): joins with another are refused.
    ``relay``: pass messages between client-mode members (peers behind NAT, which cannot reach each other),
    within ``limits.relay_*``. Every client holds a connection to the coordinator (its reports), so the
    coordinator has a way to each; in a secure swarm what it passes is sealed for the target alone.
    """
    host, port = parse_hostport(bind, "bind address")
    transport = listen(tcp_url(host, port), coordinator_limits(config.limits), security=security)
    async with transport, Coordinator(config, transport, spec=spec) as coordinator:
        if security is None:
            warn_open("coordinator", transport.address)
        if relay:
            transport.serve_as_relay(asyncio.get_running_loop().time())
        if on_ready:
            on_ready(coordinator)
        stopped = asyncio.create_task(stop.wait())
        failed = asyncio.create_task(coordinator.wait_closed())
        done, pending = await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()  # re-raise a background failure


def run_coordinator_forever(
    config: RunConfig,
    bind: str,
    on_ready: Callable[[Coordinator], None],
    security: SecurityConfig | None = None,
    spec: ParamSpec | None = None,
    relay: bool = True,
) -> None:
    """Serve on this thread until SIGINT or SIGTERM (the CLI's `gossiptrain coordinator`)."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_coordinator(config, bind, stop, on_ready, security, spec, relay)

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())


class BackgroundCoordinator:
    """A coordinator on its own event-loop thread: for the demo and for tests."""

    def __init__(
        self,
        config: RunConfig,
        bind: str = "127.0.0.1:0",
        security: SecurityConfig | None = None,
        spec: ParamSpec | None = None,
        relay: bool = True,
    ) -> None:
        self._thread = LoopThread("gossiptrain-coordinator").start()
        self._stop = asyncio.Event()
        ready: asyncio.Future[Coordinator] = self._thread.loop.create_future()

        def on_ready(c: Coordinator) -> None:
            ready.set_result(c)

        async def start() -> Coordinator:
            self._task = asyncio.create_task(serve_coordinator(config, bind, self._stop, on_ready, security, spec, relay))
            done, _ = await asyncio.wait({self._task, ready}, return_when=asyncio.FIRST_COMPLETED)
            if self._task in done:
                self._task.result()
            return ready.result()

        try:
            self.coordinator = self._thread.run(start(), timeout=10)
        except BaseException:
            self._thread.stop()
            raise
        self.address = self.coordinator.address

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if not self._thread.loop.is_running():
            return

        async def stop() -> None:
            self._stop.set()
            await self._task

        try:
            self._thread.run(stop(), timeout=5)
        finally:
            self._thread.stop()

    def __enter__(self) -> "BackgroundCoordinator":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
