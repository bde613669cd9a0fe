"""A TCP relay that delays every byte by a fixed time each way: link delay where the kernel has no ``tc netem``.

This machine's kernel lacks netem (``gossiptrain.testing.netns.why_no_netem``)
and loads no modules, so a link's delay cannot be set in the kernel. A
``DelayProxy`` stands in front of one member: others dial the proxy (the
member advertises the proxy's host, on the same port), and the proxy opens
its own connection to the member and passes the bytes on, each chunk
``delay`` seconds after it arrived, in order, in both directions. A round
trip through it takes ``2 * delay`` more, for every message the real
transport sends (ZeroMQ's handshake included), which is what netem's delay
on both ends of a link does. It loses nothing and limits no rate; for loss,
drop packets to and from it with ``iptables`` in a namespace
(``gossiptrain.testing.netns.random_drop``, as ``experiments/real_delay.py
--loss`` does), and TCP recovers them as over a lossy link.

Runs its own event loop in a thread (``start``/``close``, or ``with``), so
a benchmark that waits on processes in blocking calls can use it.
"""

from __future__ import annotations

import asyncio
import random
import threading
from types import TracebackType
from typing import Any, Coroutine

#: Bytes read at a time from either side...
CHUNK = 1 << 16
#: ...and reads held back for their delay at most, per direction of a connection (16 MiB).
HELD_CHUNKS = 256


class DelayProxy:
    """Listen on ``host:port`` (0: the OS picks), relay to ``target`` ("host:port", settable later), ``delay`` s each way.

    ``jitter``: each chunk waits up to that much more, at random (``seed``), never overtaking the one before
    (TCP delivers in order: what netem's jitter does to one connection's bytes, as TCP sees them).
    """

    def __init__(self, host: str, delay: float, target: str | None = None, port: int = 0, *, jitter: float = 0.0,
                 seed: int | None = None) -> None:
        if delay < 0 or jitter < 0:
            raise ValueError(f"delay and jitter must be >= 0, got {delay} and {jitter}")
        self.host, self.delay, self.jitter, self.target = host, delay, jitter, target
        self._rng = random.Random(seed)
        self.port = port
        self.relayed = 0  # bytes passed on, both ways
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"delay-proxy-{host}", daemon=True)
        self._server: asyncio.Server | None = None
        self._target_set = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "DelayProxy":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        if self.target is not None:
            self.set_target(self.target)
        return self

    def set_target(self, target: str) -> None:
        """Where to relay to ("host:port"); connections that came before wait for it."""
        self.target = target
        self._loop.call_soon_threadsafe(self._target_set.set)

    def close(self) -> None:
        if not self._thread.is_alive():
            if not self._loop.is_running():
                self._loop.close()  # never started (or closed already: closing again does nothing)
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "DelayProxy":
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accepted, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def release_time(self, ahead: float, now: float) -> float:
        """When a chunk read at ``now`` goes on: ``delay`` and up to ``jitter`` later, never before the chunk ahead
        of it (released at ``ahead``)."""
        extra = self._rng.uniform(0.0, self.jitter) if self.jitter else 0.0
        return max(ahead, now + self.delay + extra)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._target_set.wait()
        assert self.target is not None
        host, _, port = self.target.rpartition(":")
        try:
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
        except OSError:
            writer.close()
            return
        self._spawn(self._pump(reader, up_writer))
        self._spawn(self._pump(up_reader, writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read from one side and write each chunk to the other ``delay`` seconds after it came, in order.

        At most ``HELD_CHUNKS`` wait at a time: past that the reading waits too,
        and TCP slows the sender down, as a full link would.
        """
        loop = asyncio.get_running_loop()
        due: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(maxsize=HELD_CHUNKS)  # None: the other side ended

        async def deliver() -> None:
            while (item := await due.get()) is not None:
                at, data = item
                if (wait := at - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                self.relayed += len(data)
                await writer.drain()

        sender = loop.create_task(deliver())
        last = 0.0
        try:
            while data := await reader.read(CHUNK):
                last = self.release_time(last, loop.time())
                await due.put((last, data))
            await due.put(None)
            await sender
        except ConnectionError:
            pass  # either side reset: the other is closed below, as a broken link would leave it
        finally:
            sender.cancel()
            writer.close()
